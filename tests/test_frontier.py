"""Choosing tiers (`h3direct/app/frontier/`, `benchmarks/frontier.py`), on the CPU: the grid its axes expand to (the
hand-written grid it replaces; the grid without fa3), the choice on a synthetic frontier (the fastest candidate inside
the bound, the margin from the cases held out, a tier no candidate qualifies for), the tiers file it writes read back
by the runtime, the plot rendered and its pixels looked at, the report's order and wording, the user's own cases
found, and the command run end to end at tiny sizes on stand-in cases."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h3direct.app.frontier import choice as F
from h3direct.app.frontier import grid, report

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"exact": ("exact", None), "sage_class": ("class", 1.5), "fastest": ("drift", 3.0)}


def row(s, exact=False, sparse=False, **x_sage):
    """A candidate's measurements as the frontier keeps them: its speed and its quality over the cases."""
    cases = {c: {"error_x_comfyui_sage": x, "error_x_comfyui_bf16": 2 * x} for c, x in x_sage.items()}
    return {"s_per_step": s, "exact": exact, "sparse": sparse,
            "options": {"attention": "budget_attn" if sparse else "sdpa"}, "status": "ok",
            "quality": {"cases": cases, "error_x_comfyui_bf16": 2 * max(x_sage.values()),
                        "error_x_comfyui_sage": max(x_sage.values())}}


ROWS = {
    "exact": row(2.0, exact=True, a=0.5, b=0.6, c=0.5),
    "sage": row(1.6, a=1.0, b=1.05, c=1.02),
    "risky": row(1.3, a=1.2, b=1.4, c=1.45),  # inside 1.5 everywhere, but its cases spread: unseen data may be worse
    "fast": row(1.0, a=2.0, b=2.9, c=2.2),
    "fastest": row(0.8, a=4.0, b=3.5, c=5.0),
    "slow_exact": row(2.4, exact=True, a=0.5, b=0.5, c=0.5),
}

# the hand-written grid the axes replace (benchmarks/frontier-candidates.json before the axes), with the exact
# backend that runs on an H100 (fa3) in place of `{exact}`
SOL = {"attention": "sol_attn", "options": {"sol_rows_backend": "fa3", "sol_fallback": "fa3"}}
I8, MLP, ALL = {"fp8_linear_format": "int8"}, {"fp8_linear_layers": "fc1,fc2"}, "qkv_proj,out_proj,fc1,fc2"
ROT_MLP, ROT_ALL = {**I8, **MLP, "fp8_linear_rotate": "fc1,fc2"}, {**I8, "fp8_linear_rotate": ALL}


def _sol(tau, **linears):
    path = {**SOL, "options": {"sol_tau": tau, **SOL["options"], **linears}}
    return {**path, "fp8_linear": "stream"} if linears else path


def _budget(mass, **linears):
    path = {"attention": "budget_attn", "options": {"budget_mass": mass, "budget_fallback": "fa3", **linears}}
    return {**path, "fp8_linear": "stream"} if linears else path


def _lin(attention="fa3", **options):
    return {"attention": attention, "fp8_linear": "stream", "options": options}


HAND_WRITTEN = {
    "exact_fa3": {"attention": "fa3"}, "exact_cudnn_sdpa": {"attention": "cudnn_sdpa"},
    "exact_sdpa": {"attention": "sdpa"}, "sage2": {"attention": "sage2"}, "ck_int8": {"attention": "ck_int8"},
    "fa3_fp8": {"attention": "fa3_fp8"}, "sol_1.0": _sol(1.0), "sol_1.3": _sol(1.3), "sol_1.8": _sol(1.8),
    "sol_2.5": _sol(2.5), "int8_mlp": _lin(**I8, **MLP), "int8_all": _lin(**I8),
    "e4m3_mlp": _lin(**MLP, fp8_accum="fast"), "e4m3_all": _lin(fp8_accum="fast"), "int8_mlp_rot": _lin(**ROT_MLP),
    "int8_all_rot": _lin(**ROT_ALL), "int8_mlp_rot+sol_1.0": _sol(1.0, **ROT_MLP),
    "int8_mlp_rot+sol_1.3": _sol(1.3, **ROT_MLP), "int8_all_rot+sol_1.3": _sol(1.3, **ROT_ALL),
    "int8_all_rot+sol_1.8": _sol(1.8, **ROT_ALL), "e4m3_mlp+sol_1.3": _sol(1.3, **MLP, fp8_accum="fast"),
    "e4m3_all+sol_2.5": _sol(2.5, fp8_accum="fast"), "int8_mlp_rot+fa3_fp8": _lin("fa3_fp8", **ROT_MLP),
}
# the candidates of budget_attn added to it (issue 45): three budgets alone, two with the rotated int8 MLP
BUDGET = {"budget_0.03": _budget(0.03), "budget_0.05": _budget(0.05), "budget_0.1": _budget(0.1),
          "int8_mlp_rot+budget_0.05": _budget(0.05, **ROT_MLP), "int8_mlp_rot+budget_0.1": _budget(0.1, **ROT_MLP)}


def test_the_axes_expand_to_the_hand_written_grid():
    """Where every backend runs (an H100 with fa3): the 23 candidates of the hand-written grid and budget_attn's five,
    path for path."""
    got = grid.expand(lambda backend: None)
    assert set(got) == set(HAND_WRITTEN) | set(BUDGET)
    for name, path in {**HAND_WRITTEN, **BUDGET}.items():
        assert got[name] == path, name


def test_the_grid_without_fa3_keeps_its_combinations_on_what_runs():
    """Without fa3 (a GB10: fa3 and fa3_fp8 unavailable), the exact role is cuDNN's SDPA, the 8-bit linears' 8-bit
    attention is sage2, and nothing the grid measures names fa3; without cuDNN either, PyTorch's SDPA."""
    no_fa3 = grid.expand(lambda b: "planted: not built for this GPU" if b.startswith("fa3") else None)
    assert "int8_mlp_rot+fa3_fp8" not in no_fa3
    assert no_fa3["int8_mlp_rot+sage2"] == _lin("sage2", **ROT_MLP)
    for tau in (1.0, 1.3):
        assert no_fa3[f"int8_mlp_rot+sol_{tau}"]["options"] == {
            "sol_tau": tau, "sol_rows_backend": "cudnn_sdpa", "sol_fallback": "cudnn_sdpa", **ROT_MLP}
    assert no_fa3["int8_mlp"]["attention"] == no_fa3["e4m3_all"]["attention"] == "cudnn_sdpa"
    runs_here = {n: p for n, p in no_fa3.items() if n not in ("exact_fa3", "fa3_fp8")}  # left out, each by reason
    assert "fa3" not in json.dumps(runs_here), runs_here
    assert no_fa3["int8_mlp_rot+budget_0.05"]["options"]["budget_fallback"] == "cudnn_sdpa"
    assert len(no_fa3) == len(HAND_WRITTEN) + len(BUDGET)
    sdpa_only = grid.expand(lambda b: None if b in ("sdpa", "sage2", "sol_attn") else "planted: unavailable")
    assert sdpa_only["sol_1.0"]["options"]["sol_fallback"] == "sdpa" and sdpa_only["int8_all"]["attention"] == "sdpa"


def test_the_choice_is_the_fastest_candidate_inside_the_bound():
    assert F.choose(ROWS, 1.5, "class") == "risky"
    assert F.choose(ROWS, 3.0, "drift") == "fast"
    assert F.choose(ROWS, None, "exact") == "exact"  # the fastest exact candidate, whatever its error
    assert F.choose(ROWS, 1.5, "class", cases=["a"]) == "risky"
    assert F.choose(ROWS, 0.1, "class") is None
    # a faster candidate without a figure on one case (not measured there, or NaN) is out: that case may be its worst
    for unmeasured in (row(0.5, a=0.1, b=0.1), row(0.5, a=0.1, b=0.1, c=float("nan"))):
        assert F.choose({**ROWS, "unmeasured": unmeasured}, 1.5, "class", cases=["a", "b", "c"]) == "risky"


def test_the_margin_is_the_worst_gap_of_a_held_out_case():
    m, folds = F.margin(ROWS, 1.5, "class", ["a", "b", "c"])
    # held out c: chosen on a and b -> risky (worst 1.4 there); on c it errs 1.45: the gap is 1.45 / 1.4
    gaps = {f["held_out"]: f["gap"] for f in folds}
    assert {f["held_out"]: f["chosen"] for f in folds} == {"a": "risky", "b": "risky", "c": "risky"}
    assert gaps["c"] == pytest.approx(1.45 / 1.4) and gaps["a"] < 1 and gaps["b"] < 1
    assert m == pytest.approx(1.45 / 1.4)
    assert F.margin(ROWS, 1.5, "class", ["a"]) == (1.0, [])  # one case: nothing to hold out


def test_the_margin_moves_the_choice_and_a_tier_nothing_fits_says_so(capsys):
    rows = {**ROWS, "risky": row(1.3, a=1.0, b=1.05, c=1.46)}  # c is far worse than the others: a large gap
    choices = F.choose_tiers(rows, BOUNDS, ["a", "b", "c"])
    # without a margin: risky (sage class) and fast (fastest); with it, what unseen data can still keep in bound
    assert F.choose(rows, 1.5, "class") == "risky" and F.choose(rows, 3.0, "drift") == "fast"
    assert choices["sage_class"]["margin"] == pytest.approx(1.46 / 1.05) and choices["sage_class"]["chosen"] == "sage"
    assert choices["exact"]["chosen"] == "exact" and choices["fastest"]["chosen"] == "risky"
    none = F.choose_tiers({"fastest": ROWS["fastest"]}, {"sage_class": BOUNDS["sage_class"]}, ["a", "b", "c"])
    assert none["sage_class"]["chosen"] is None
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if "no candidate qualifies" in ln]
    assert len(lines) == 1 and "tier sage_class" in lines[0], lines


def test_a_sparse_candidate_takes_a_tier_only_while_its_error_is_even():
    """A sparse candidate whose worst case is more than `SPARSE_SPREAD` (1.3) × its median case is passed over, even
    inside the bound; an even one is taken; an uneven candidate that is not sparse is judged by its bound alone. In a
    fold the spread is over the cases the choice sees, so the held-out case can make it uneven."""
    from h3direct.app.tiers import SPARSE_SPREAD

    assert SPARSE_SPREAD == 1.3
    uneven = row(0.9, sparse=True, a=1.0, b=1.05, c=1.4)  # inside 1.5; worst / median 1.4 / 1.05 = 1.33
    assert F.spread(uneven) == pytest.approx(1.4 / 1.05) and F.spread(uneven, ["a", "b"]) == pytest.approx(1.05 / 1.025)
    rows = {**ROWS, "uneven": uneven}
    assert F.choose(rows, 1.5, "class") == "risky"
    assert F.choose({**rows, "dense": {**uneven, "sparse": False}}, 1.5, "class") == "dense"
    assert F.choose({**rows, "even": row(0.95, sparse=True, a=1.1, b=1.2, c=1.25)}, 1.5, "class") == "even"
    m, folds = F.margin(rows, 1.5, "class", ["a", "b", "c"])
    chosen = {f["held_out"]: f["chosen"] for f in folds}
    # on two cases it is even (without c: 1.05 / 1.025; without a: 1.4 / 1.225): taken in every fold, 1.4 on c
    assert chosen == {"a": "uneven", "b": "uneven", "c": "uneven"}
    assert m == pytest.approx(1.4 / 1.05)
    assert F.choose_tiers(rows, BOUNDS, ["a", "b", "c"])["sage_class"]["chosen"] == "sage"  # 1.05 x 1.33 <= 1.5
    nan = row(0.5, sparse=True, a=1.0, b=1.0, c=float("nan"))
    assert F.spread(nan) == math.inf and F.choose({**ROWS, "nan": nan}, 1.5, "class", ["a", "b"]) == "nan"


def _measured(rows: dict) -> dict:
    """A frontier's measurements without speeds (what the frontier has before it times anything) of `row`s."""
    cases = sorted({c for r in rows.values() for c in r["quality"]["cases"]})
    quality = {c: {"status": "ok", "paths": {n: {"x_comfyui_bf16": [2 * q["error_x_comfyui_sage"]] * 2,
                                                 "x_comfyui_sage": [q["error_x_comfyui_sage"]] * 2, **q}
                                             for n, r in rows.items() if (q := r["quality"]["cases"].get(c))}}
               for c in cases}
    return {"candidates": {n: {"exact": r["exact"], "options": r["options"]} for n, r in rows.items()},
            "quality": quality, "made": {"cases": cases}}


def test_a_candidate_no_tier_can_take_is_not_timed_and_no_choice_changes():
    """The frontier times only the candidates whose quality lets them take a tier: the exact ones, and those inside
    a bound over the cases or over a fold's. Over random frontiers the tiers chosen with every speed and with the
    untimed candidates' speeds unknown are the same, margins and folds included."""
    import random

    # fastest errs above every bound on every fold; the uneven sparse one is even without c (a fold): timed
    uneven = row(0.9, sparse=True, a=1.0, b=1.05, c=2.0)
    skip = F.not_worth_timing(_measured({**ROWS, "uneven": uneven}), BOUNDS)
    assert skip == {"fastest": "worst x5.00 ComfyUI+sage"}
    # inside 3 everywhere, but uneven over the cases and over every fold (worst / median 1.43 to 2.5): not timed
    # when sparse, timed when dense (the fastest tier's bound alone)
    lopsided = row(0.7, sparse=True, a=0.5, b=1.0, c=2.5)
    dense = {**lopsided, "sparse": False, "options": {"attention": "sdpa"}}
    assert F.not_worth_timing(_measured({"lopsided": lopsided, "dense": dense}), BOUNDS) == {
        "lopsided": "worst x2.50 ComfyUI+sage, worst / median 2.50"}
    rng = random.Random(45)
    for _ in range(300):
        cases = ["a", "b", "c", "d"][:rng.randint(1, 4)]
        rows = {f"k{i}": row(rng.uniform(0.5, 3.0), exact=rng.random() < 0.15, sparse=rng.random() < 0.5,
                             **{c: rng.choice([rng.uniform(0.3, 1.6), rng.uniform(1.0, 4.0)]) for c in cases})
                for i in range(8)}
        skip = F.not_worth_timing(_measured(rows), BOUNDS)
        unknown = {n: {**r, "s_per_step": math.inf} if n in skip else r for n, r in rows.items()}
        assert F.choose_tiers(unknown, BOUNDS, cases, log=lambda _: None) == \
            F.choose_tiers(rows, BOUNDS, cases, log=lambda _: None)
        assert not any(rows[n]["exact"] for n in skip)


def test_the_attention_backends_that_drop_key_blocks_are_the_sparse_ones():
    from h3direct.dit.attention import backends, is_sparse
    from h3direct.dit.options import AttentionOptions

    assert {b for b in backends() if is_sparse(b)} == {"sol_attn", "budget_attn"}
    sliced = AttentionOptions(backend="kj_head_sliced")
    assert not is_sparse(sliced)
    assert F.sparse({"attention": "budget_attn"}) and not F.sparse({"attention": "fa3"})


def test_pareto_points():
    assert F.pareto(ROWS) == ["fastest", "fast", "risky", "sage", "exact", "slow_exact"]  # slow_exact errs least


def test_the_tiers_file_reads_back_in_the_runtime(tmp_path):
    from h3direct.app import tiers
    from h3direct.dit.options import Options

    rows = {n: {**r, "options": {**Options().flat(), "attention": "sdpa", "mlp_chunks": i + 1}}
            for i, (n, r) in enumerate(ROWS.items())}
    choices = F.choose_tiers(rows, BOUNDS, ["a", "b", "c"])
    data = F.tiers_file({"machine": {"device_name": "cpu"}, "made": {"commit": "x"}}, rows, choices,
                        {"sage": {"s_per_step": 2.0}})
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(data))
    got = tiers.load(path)
    assert set(got.tiers) == {"exact", "sage_class", "fastest"}
    t = got.get("fastest")
    chosen = rows[choices["fastest"]["chosen"]]
    assert t.options == {"attention": "sdpa", "mlp_chunks": chosen["options"]["mlp_chunks"]}  # only what differs
    assert t.rule == "drift" and t.bound == 3.0 and t.figures["margin"] == choices["fastest"]["margin"]
    assert t.figures["x_comfyui_sage"] == pytest.approx(2.0 / chosen["s_per_step"])
    assert t.figures["error_x_comfyui_sage"] == max(c["error_x_comfyui_sage"] for c in chosen["quality"]["cases"].values())


def test_the_plot_shows_the_points_the_bounds_and_the_choices(tmp_path):
    """Rendered and looked at: the Pareto points in blue, the bounds' green lines (nominal and effective), ComfyUI's
    orange squares."""
    import numpy as np
    from PIL import Image

    choices = F.choose_tiers(ROWS, BOUNDS, ["a", "b", "c"])
    comfy = {"default": {"s_per_step": 3.0, "worst_x_sage": 0.7}, "sage": {"s_per_step": 2.2, "worst_x_sage": 1.0}}
    png = report.plot(ROWS, comfy, choices, tmp_path / "f.png")
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)

    def pixels(hex_color, tol=12):
        rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(img - rgb).max(axis=-1) <= tol).sum())

    assert pixels("#1f6fb2") > 200, "no Pareto points drawn"
    assert pixels("#d9480f") > 100, "no ComfyUI reference points drawn"
    assert pixels("#2b8a3e") > 300, "no bound lines or chosen rings drawn"
    empty = report.plot({}, {}, {}, tmp_path / "empty.png")
    e = np.asarray(Image.open(empty).convert("RGB")).astype(int)
    assert int((np.abs(e - np.array([0x1f, 0x6f, 0xb2])).max(axis=-1) <= 12).sum()) == 0


@pytest.fixture(scope="module")
def stand_in_cases(tmp_path_factory) -> Path:
    from tests.gate.test_gate_class_and_drift import _copy_case, write_sage_recording

    root = tmp_path_factory.mktemp("validation")
    for name, factor in (("case_a", 3.0), ("case_b", 1.5)):
        (root / name).mkdir()
        _copy_case(root / name)
        write_sage_recording(root / name, factor)
    return root


def test_the_command_writes_frontier_tiers_plot_and_report(tmp_path, stand_in_cases):
    """End to end at tiny sizes (--smoke, CPU): a GPU-only candidate is left out with its reason, the rest measured on
    both cases, the tiers file read back by `h3direct generate --tier`."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("H3_")}, "OMP_NUM_THREADS": "1",
           "H3_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.frontier", "--trace-dir", str(stand_in_cases), "--out",
                        str(out), *(a for n in ("exact_fa3", "exact_sdpa", "int8_mlp", "e4m3_all") for a in
                                    ("--candidate", n)), "--case", "case_a", "--case", "case_b",
                        "--device", "cpu", "--smoke", "--steps", "1", "--install"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "left out exact_fa3: fa3: " in p.stdout, p.stdout[-2000:]
    frontier = json.loads((out / "frontier.json").read_text())
    assert set(frontier["candidates"]) == {"exact_sdpa", "int8_mlp", "e4m3_all"}
    for r in frontier["candidates"].values():
        assert r["quality"]["status"] == "ok" and set(r["quality"]["cases"]) == {"case_a", "case_b"}
        assert math.isfinite(r["s_per_step"]) or r["status"].startswith("not timed: qualifies for no tier (worst x")
    assert math.isfinite(frontier["candidates"]["exact_sdpa"]["s_per_step"])
    assert (out / "frontier.png").stat().st_size > 10_000 and "data:image/png;base64," in (out / "report.html").read_text()
    assert (tmp_path / "cache" / "tiers.json").read_bytes() == (out / "tiers.json").read_bytes()
    chosen = frontier["choices"]["exact"]["chosen"]
    assert chosen == "exact_sdpa"
    from h3direct.app import cli, cli_generate

    args = cli.build_parser("generate").parse_args(["generate", "--tier", "fastest", "--tiers", str(out / "tiers.json"),
                                                   "-o", str(tmp_path / "x.mp4")])
    job = cli_generate.parse(args, env={})
    assert job.options.tier["name"] == "fastest" and job.options.tier["file"] == str((out / "tiers.json").resolve())


def test_a_candidate_that_fails_is_recorded_and_the_run_goes_on_then_exits_1(tmp_path, stand_in_cases, monkeypatch,
                                                                             capsys):
    """One candidate raising in its quality step and its timed steps (a kernel that does not compile, say) is its
    result, named with its error; the other candidates are measured and chosen from, and the command exits 1."""
    from benchmarks import frontier, quality, run_contract

    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path / "cache"))
    measure_path, run_path = quality.measure_path, run_contract._run_path

    def quality_step(case, options, device):
        if options.kernels.fp8_linear != "off":
            raise RuntimeError("planted: the kernel did not compile\nsecond line")
        return measure_path(case, options, device)

    def timed_steps(contract, args, name, *rest):
        if name == "int8_all":
            raise RuntimeError("planted: the kernel did not compile")
        return run_path(contract, args, name, *rest)

    monkeypatch.setattr(quality, "measure_path", quality_step)
    monkeypatch.setattr(run_contract, "_run_path", timed_steps)
    out = tmp_path / "out"
    rc = frontier.main(["--trace-dir", str(stand_in_cases), "--out", str(out), "--candidate", "exact_sdpa",
                        "--candidate", "int8_all", "--case", "case_a", "--case", "case_b", "--device", "cpu", "--smoke",
                        "--steps", "1", "--time-all"])
    assert rc == 1
    logged = capsys.readouterr().out
    assert "candidate int8_all failed: RuntimeError: planted: the kernel did not compile (not chosen" in logged, logged
    written = json.loads((out / "frontier.json").read_text())
    broken, ok = written["candidates"]["int8_all"], written["candidates"]["exact_sdpa"]
    assert broken["status"] == "failed: RuntimeError: planted: the kernel did not compile"
    assert set(F.failed_cases(broken)) == {"case_a", "case_b"} and broken["quality"]["error_x_comfyui_sage"] is None
    assert broken["s_per_step"] == "inf" and math.isfinite(ok["s_per_step"])
    assert ok["quality"]["status"] == "ok" and set(ok["quality"]["cases"]) == {"case_a", "case_b"}
    assert {c["chosen"] for c in written["choices"].values()} <= {"exact_sdpa", None}


def test_the_committed_tiers_file_is_what_the_runtime_reads():
    """benchmarks/results/tiers-h100.json (the frontier of one H100 on the 24 structured cases, LOG.md) loads as the
    runtime loads a tiers file, for that GPU only, and its choices are its candidates' figures: the worst case's
    error, which times the tier's margin stays inside its bound."""
    from h3direct.app import tiers
    from h3direct.errors import ConfigError

    path = ROOT / "benchmarks" / "results" / "tiers-h100.json"
    got = tiers.load(path)
    assert got.machine["device_name"] == "NVIDIA H100 80GB HBM3" and set(got.tiers) == {"exact", "sage_class",
                                                                                         "fastest"}
    data = json.loads(path.read_text())
    for t in got.tiers.values():
        row = data["candidates"][t.figures["candidate"]]
        per_case = row["quality"]["cases"]
        assert set(per_case) == set(data["made"]["cases"])
        assert t.figures["error_x_comfyui_sage"] == max(c["error_x_comfyui_sage"] for c in per_case.values())
        assert t.figures["error_x_comfyui_sage"] * t.figures["margin"] <= (t.bound or math.inf)
    with pytest.raises(ConfigError, match="chosen on NVIDIA H100 80GB HBM3, this device is cpu"):
        got.check_device("cpu")


def test_the_report_sorts_by_speed_and_says_what_it_means(tmp_path):
    """The candidates' table fastest first (one without a speed last), each case a column; the exact tier's lack of
    a bound and an unknown or changed commit said in words, never as None / unknown; each bounded tier's effective
    bound (its bound over its margin) given beside the nominal one."""
    rows = {**ROWS, "broken": {**row(0.1, a=0.1, b=0.1, c=0.1), "s_per_step": math.inf, "status": "failed: x"}}
    choices = F.choose_tiers(rows, BOUNDS, ["a", "b", "c"])
    png = report.plot(rows, {}, choices, tmp_path / "f.png")
    frontier = {"candidates": rows, "choices": choices, "machine": {"device_name": "cpu"}, "left_out": {},
                "made": {"commit": "unknown", "tree": "2b5a2fae07c8e5b4c3f6", "cases": ["a", "b", "c"]}}
    page = report.report_html(frontier, png)
    table = page[page.index("<table>"):]
    order = sorted((table.index(f"<tr><td>{n}</td>"), n) for n in rows)
    assert [n for _, n in order] == ["fastest", "fast", "risky", "sage", "exact", "slow_exact", "broken"]
    assert "None" not in page and "unknown" not in page
    assert "commit not known (the measuring checkout had no git history)" in page and "git tree 2b5a2fae07c8" in page
    assert "exact_fa3" not in page and "the exact rules (no error bound" in page
    m = choices["sage_class"]["margin"]
    assert f"margin ×{m:.3f}: effective bound ×{1.5 / m:.3f}" in page
    changed = report.report_html({**frontier, "made": {**frontier["made"], "commit": "e1694bfa5172+changes"}}, png)
    assert "commit e1694bfa5172 with uncommitted changes" in changed


def test_no_two_labels_of_the_plot_overlap():
    """Crowded points (the exact backends on top of each other, as on an H100) and two tiers' bounds close together:
    every label placed overlaps no other and no point; a label with no room is left off, not drawn over another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    pts = [(1.0 + 0.01 * i, 2.0 + 0.005 * i) for i in range(12)] + [(2.0, 1.5), (2.05, 1.5)]
    ax.scatter(*zip(*pts, strict=True))
    ax.set_xlim(0.5, 3)
    ax.set_ylim(1, 3)
    labels = [(f"candidate_{i}", p, {"fontsize": 8}) for i, p in enumerate(pts)]
    placed = report.place_labels(ax, labels, pts)
    renderer = fig.canvas.get_renderer()
    boxes = [a.get_window_extent(renderer) for a in placed]
    assert 2 <= len(placed) < len(labels)  # some fit, not all twelve of the crowd
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1:])
    plt.close(fig)


def test_choosing_again_from_the_committed_frontier_gives_the_committed_tiers(tmp_path):
    """`h3direct choose-tiers` on the H100's committed measurements (benchmarks/results/frontier-h100.json) chooses
    what that run chose (tiers-h100.json, written by the frontier of the day), with the same margins and figures."""
    from h3direct.app import cli

    committed = json.loads((ROOT / "benchmarks" / "results" / "tiers-h100.json").read_text())["tiers"]
    assert cli.main(["choose-tiers", "--frontier", str(ROOT / "benchmarks" / "results" / "frontier-h100.json"),
                     "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "tiers.json").read_text())["tiers"]
    assert set(got) == set(committed)
    for name, t in committed.items():
        assert got[name]["candidate"] == t["candidate"] and got[name]["options"] == t["options"]
        for key in ("margin", "error_x_comfyui_sage", "s_per_step"):
            assert got[name][key] == pytest.approx(t[key], rel=1e-12), (name, key)
    assert cli.main(["choose-tiers", "--frontier", str(ROOT / "README.md"), "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("edit, says", [
    (lambda f: f.pop("quality"), "no quality (an object)"),
    (lambda f: f["made"].pop("cases"), "no made.cases (a list)"),
    (lambda f: f["quality"].pop(f["made"]["cases"][-1]), "no quality.v30_local_nvfp4_v4c_s5072"),
    (lambda f: f.clear(), "no made.cases (a list), machine (an object), candidates (an object), quality (an object)"),
])
def test_choose_tiers_refuses_what_is_not_a_frontier_in_one_line(tmp_path, capsys, edit, says):
    """A frontier file without what the choice reads, or a --frontier that does not exist: one line, exit 2, before
    any choice is made and nothing written."""
    from h3direct.app import cli

    frontier = json.loads((ROOT / "benchmarks" / "results" / "frontier-h100.json").read_text())
    edit(frontier)
    path = tmp_path / "f.json"
    path.write_text(json.dumps(frontier))
    assert cli.main(["choose-tiers", "--frontier", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out" / "tiers.json").exists()
    assert cli.main(["choose-tiers", "--frontier", str(tmp_path / "none.json"), "--out", str(tmp_path / "o2")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_the_users_own_cases_are_found(tmp_path):
    """A folder of --trace-dir that is not a validation-set case counts when ComfyUI's bf16 trace has its fp32 twin and
    its sage recording and S >= 5,000 (the manifests' layout); every other one is named with why not."""
    from parity_tests import validation
    from tests.gate.test_gate_class_and_drift import _copy_case, write_sage_recording

    def case(name: str, sage: bool = True, seq_len: int | None = 6000, twin: bool = True) -> None:
        folder = tmp_path / name
        folder.mkdir()
        _copy_case(folder)
        if sage:
            write_sage_recording(folder, 1.5)
        for manifest in folder.glob("*.json"):
            m = json.loads(manifest.read_text())
            if "layout" in m and seq_len is not None:
                m["layout"]["seq_len"] = seq_len
                manifest.write_text(json.dumps(m))
        if not twin:
            for f in folder.glob("*fp32*"):
                f.unlink()

    case("my_prompt_s6000")
    case("my_prompt_no_sage", sage=False)
    case("my_prompt_short", seq_len=4999)
    case("my_prompt_no_twin", twin=False)
    case("v4_local_nvfp4_s5072")  # a case of the set: judged as one of the set, not as the user's
    (tmp_path / "notes").mkdir()
    counted, others = validation.own_cases(tmp_path)
    assert counted == ["my_prompt_s6000"]
    assert set(others) == {"my_prompt_no_sage", "my_prompt_short", "my_prompt_no_twin", "notes"}
    assert "--use-sage-attention" in others["my_prompt_no_sage"] and "4999" in others["my_prompt_short"]
    assert "fp32 twin" in others["my_prompt_no_twin"]
