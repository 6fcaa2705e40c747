"""The frontier and the choice of tiers (`benchmarks/frontier.py`), on the CPU: the choice on a synthetic frontier
(the fastest candidate inside the bound, the margin from the cases held out, a tier no candidate qualifies for),
the tiers file it writes read back by the runtime, the plot rendered and its pixels looked at, and the command run
end to end at tiny sizes on stand-in cases."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier as F  # noqa: E402

BOUNDS = {"exact": {"rule": "exact", "bound": None}, "sage_class": {"rule": "class", "bound": 1.5},
          "fastest": {"rule": "drift", "bound": 3.0}}


def row(s, exact=False, **x_sage):
    return {"s_per_step": s, "exact": exact, "x_sage": x_sage, "x_bf16": {k: 2 * v for k, v in x_sage.items()},
            "options": {"attention": "sdpa"}}


ROWS = {
    "exact": row(2.0, exact=True, a=0.5, b=0.6, c=0.5),
    "sage": row(1.6, a=1.0, b=1.05, c=1.02),
    "risky": row(1.3, a=1.2, b=1.4, c=1.45),  # inside 1.5 everywhere, but its cases spread: unseen data may be worse
    "fast": row(1.0, a=2.0, b=2.9, c=2.2),
    "fastest": row(0.8, a=4.0, b=3.5, c=5.0),
    "slow_exact": row(2.4, exact=True, a=0.5, b=0.5, c=0.5),
}


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


def test_pareto_points():
    assert F.pareto(ROWS) == ["fastest", "fast", "risky", "sage", "exact", "slow_exact"]  # slow_exact errs least


def test_the_tiers_file_reads_back_in_the_runtime(tmp_path):
    from h3direct.app import tiers
    from h3direct.dit.options import Options

    rows = {n: {**r, "options": {**Options().flat(), "attention": "sdpa", "mlp_chunks": i + 1}}
            for i, (n, r) in enumerate(ROWS.items())}
    choices = F.choose_tiers(rows, BOUNDS, ["a", "b", "c"])
    data = F.tiers_file({"device_name": "cpu"}, rows, choices, {"sage": {"s_per_step": 2.0}}, {"commit": "x"})
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(data))
    got = tiers.load(path)
    assert set(got.tiers) == {"exact", "sage_class", "fastest"}
    t = got.get("fastest")
    chosen = rows[choices["fastest"]["chosen"]]
    assert t.options == {"attention": "sdpa", "mlp_chunks": chosen["options"]["mlp_chunks"]}  # only what differs
    assert t.rule == "drift" and t.bound == 3.0 and t.figures["margin"] == choices["fastest"]["margin"]
    assert t.figures["x_comfyui_sage"] == pytest.approx(2.0 / chosen["s_per_step"])
    assert t.figures["error_x_comfyui_sage"] == F.worst(chosen)


def test_the_plot_shows_the_points_the_bounds_and_the_choices(tmp_path):
    """Rendered and looked at: the Pareto points in blue, the bounds' dashed green lines, ComfyUI's orange squares."""
    import numpy as np
    from PIL import Image

    choices = F.choose_tiers(ROWS, BOUNDS, ["a", "b", "c"])
    comfy = {"default": {"s_per_step": 3.0, "worst_x_sage": 0.7}, "sage": {"s_per_step": 2.2, "worst_x_sage": 1.0}}
    png = F.plot(ROWS, comfy, choices, tmp_path / "f.png")
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)

    def pixels(hex_color, tol=12):
        rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(img - rgb).max(axis=-1) <= tol).sum())

    assert pixels("#1f6fb2") > 200, "no Pareto points drawn"
    assert pixels("#d9480f") > 100, "no ComfyUI reference points drawn"
    assert pixels("#2b8a3e") > 300, "no bound lines or chosen rings drawn"
    empty = F.plot({}, {}, {}, tmp_path / "empty.png")
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
    grid = json.loads((ROOT / "benchmarks" / "frontier-candidates.json").read_text())
    grid["candidates"] = {"exact_fa3": {"attention": "fa3"}, "exact_sdpa": {"attention": "sdpa"},
                          "int8_mlp": {"attention": "{exact}", "fp8_linear": "stream",
                                       "options": {"fp8_linear_format": "int8", "fp8_linear_layers": "fc1,fc2"}},
                          "e4m3_all": {"attention": "{exact}", "fp8_linear": "stream"}}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("H3_")}, "OMP_NUM_THREADS": "1",
           "H3_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.frontier", "--trace-dir", str(stand_in_cases), "--out",
                        str(out), "--candidates", str(tmp_path / "grid.json"), "--case", "case_a", "--case", "case_b",
                        "--device", "cpu", "--smoke", "--steps", "1", "--install"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "left out exact_fa3: fa3: " in p.stdout, p.stdout[-2000:]
    frontier = json.loads((out / "frontier.json").read_text())
    assert set(frontier["candidates"]) == {"exact_sdpa", "int8_mlp", "e4m3_all"}
    for r in frontier["candidates"].values():
        assert set(r["x_sage"]) == {"case_a", "case_b"} and math.isfinite(r["s_per_step"])
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
    import quality
    import run_contract

    grid = json.loads((ROOT / "benchmarks" / "frontier-candidates.json").read_text())
    grid["candidates"] = {"exact_sdpa": {"attention": "sdpa"}, "broken": {"attention": "sdpa", "fp8_linear": "stream",
                                                                            "options": {"fp8_linear_format": "int8"}}}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path / "cache"))
    measure_path, run_path = quality.measure_path, run_contract._run_path

    def quality_step(case, options, device):
        if options.kernels.fp8_linear != "off":
            raise RuntimeError("planted: the kernel did not compile\nsecond line")
        return measure_path(case, options, device)

    def timed_steps(contract, args, name, *rest):
        if name == "broken":
            raise RuntimeError("planted: the kernel did not compile")
        return run_path(contract, args, name, *rest)

    monkeypatch.setattr(quality, "measure_path", quality_step)
    monkeypatch.setattr(run_contract, "_run_path", timed_steps)
    out = tmp_path / "out"
    rc = F.main(["--trace-dir", str(stand_in_cases), "--out", str(out), "--candidates", str(tmp_path / "grid.json"),
                 "--case", "case_a", "--case", "case_b", "--device", "cpu", "--smoke", "--steps", "1"])
    assert rc == 1
    logged = capsys.readouterr().out
    assert "candidate broken failed: RuntimeError: planted: the kernel did not compile (not chosen" in logged, logged
    frontier = json.loads((out / "frontier.json").read_text())
    broken, ok = frontier["candidates"]["broken"], frontier["candidates"]["exact_sdpa"]
    assert broken["status"] == "failed: RuntimeError: planted: the kernel did not compile"
    assert set(broken["failed"]) == {"case_a", "case_b"} and broken["x_sage"] == {}
    assert math.isinf(float(broken["s_per_step"])) and math.isfinite(ok["s_per_step"])
    assert set(ok["x_sage"]) == {"case_a", "case_b"}
    assert {c["chosen"] for c in frontier["choices"].values()} <= {"exact_sdpa", None}


def test_the_committed_tiers_file_is_what_the_runtime_reads():
    """benchmarks/results/tiers-h100.json (the frontier of one H100 on the six structured cases, LOG.md) loads as the
    runtime loads a tiers file, for that GPU only, and its choices are its candidates' figures."""
    from h3direct.app import tiers
    from h3direct.errors import ConfigError

    path = ROOT / "benchmarks" / "results" / "tiers-h100.json"
    got = tiers.load(path)
    assert got.machine["device_name"] == "NVIDIA H100 80GB HBM3" and set(got.tiers) == {"exact", "sage_class",
                                                                                         "fastest"}
    data = json.loads(path.read_text())
    for t in got.tiers.values():
        row = data["candidates"][t.figures["candidate"]]
        assert t.figures["error_x_comfyui_sage"] == max(row["x_sage"].values())
        assert t.figures["error_x_comfyui_sage"] * t.figures["margin"] <= (t.bound or math.inf)
    with pytest.raises(ConfigError, match="chosen on NVIDIA H100 80GB HBM3, this device is cpu"):
        got.check_device("cpu")
