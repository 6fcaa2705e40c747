"""Every replay the gate prints reproduces its row, as printed, from another folder.

Each run below plants failures (`plants.py`, installed through the environment in the gate's pytest and in every
command it prints), runs the gate (`pytest -m parity`) in a subprocess on a folder of fixture traces, takes every
`replay:` line of its output and every command of its `report.md`, and runs each in a subprocess from another
working directory with the same plants. Each must exit 1 with its row's figure (the error the rule judged, from
`results.jsonl`, within 1e-3 relative); a free-running row's replay also names the first drifting tensor and the
first teacher-forced layer out of the rule. The runs cover every kind of row the gate can fail on: a block's input,
a module's output, the model's inputs and outputs, the sampler's x0, a VAE layer and a generation step;
teacher-forced and free-running; a bf16 recording and its fp32 twin; every approximate attention backend's kernel;
the 8-bit linears (int8 with its rotated layers, through a `--tier`); ComfyUI's fast-mode class rule; an approximate
mode's drift against its baseline; and the e2e frames gate's drift.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from parity_tests.discovery import FIXTURES
from tests.gate import plants

REPO = Path(__file__).resolve().parents[2]
BF16 = ("trace_fx_bf16_ref2va_bf16", "trace_fx_bf16_ref2va_fp32", "h3_fx_bf16", "inputs_fx_ref2va")
MORE = ("trace_fx_curve_nvfp4_ref2va_fp32", "h3_fx_curve_nvfp4", "trace_fx_curve_bf16_t2va_mask_fp32",
        "h3_fx_curve_bf16", "inputs_fx_t2va_mask", "trace_fx_micro_td80_t2va_fp32", "h3_fx_micro_td80_bf16",
        "inputs_fx_td80_t2va", "trace_gen_fx_curve_bf16_t2va_fp32", "inputs_fx_t2va",
        "trace_vae_video_decode_fp16", "trace_vae_video_decode_fp32", "vae_video_fx", "vae_inputs_fixture")
BF16_TEACHER = ["-k", "test_dit_layers and teacher and ref2va_bf16"]
# rows whose planted layer teacher forcing re-runs itself (the `fc1`, `qkv` and `inner` plants: the inner forward is
# the model's teacher-forced site); the other free rows' bugs sit between layers
TEACHER_SEES = ("blocks.1.mlp.fc1.out", "blocks.1.attn.qkv_proj.out", "dit_inner.out.video")
TIERS = {"schema": "h3-tiers/1", "machine": {"device_name": "cpu"},
         "tiers": {"int8_rotated": {"options": {"fp8_linear": "stream", "fp8_linear_format": "int8",
                                                "fp8_linear_rotate": "qkv_proj,fc1"}, "rule": "drift"}}}


@dataclass(frozen=True)
class Run:
    plants: str
    files: dict[str, tuple[str, ...]]  # sub-folder ("" for the root) -> fixture file stems copied there
    flags: tuple[str, ...] = ()
    rows: tuple[tuple[str, str, str], ...] = ()  # (case stem, row name's start, part) of rows that must be replayed
    sage: tuple[str, ...] = ()  # sub-folders given a ComfyUI+sage recording of their bf16 case
    baselines: dict = field(default_factory=dict)  # sub-folder or "e2e" -> the mode label baselined there


KERNEL_ROWS = ("sage2", "ck_int8", "fa3_fp8", "sol_attn", "budget_attn")  # the approximate backends replayed here
SAME_ROW_AS = {"kj_head_sliced": "sage2"}  # its calls are its inner backend's (sage2 by default): that row

RUNS = {
    # the block input (the plant the issue found: only a whole-model run sees it), a module output in both dtypes,
    # the model's input and outputs, the sampler's x0, a VAE layer and a generation step
    "layers": Run("glue@h3_fx_bf16:bf16,fc1@h3_fx_bf16:bf16,qkv@h3_fx_bf16:fp32,carry@h3_fx_curve_nvfp4,"
                  "x0@h3_fx_curve_bf16,inner@h3_fx_micro_td80_bf16,vae",
                  {"": BF16 + MORE}, ("-m", "parity and not planted"),
                  (("trace_fx_bf16_ref2va_bf16", "blocks.1.in.0", "free"),
                   ("trace_fx_bf16_ref2va_bf16", "blocks.1.mlp.fc1.out", "teacher"),
                   ("trace_fx_bf16_ref2va_fp32", "blocks.1.attn.qkv_proj.out", "teacher"),
                   ("trace_fx_bf16_ref2va_fp32", "blocks.1.attn.qkv_proj.out", "free"),
                   ("trace_fx_curve_nvfp4_ref2va_fp32", "dit_inner.in.audio", "free"),
                   ("trace_fx_curve_bf16_t2va_mask_fp32", "sampler.denoised.video", "free"),
                   ("trace_fx_micro_td80_t2va_fp32", "dit_inner.out.video", "teacher"),
                   ("trace_fx_micro_td80_t2va_fp32", "dit_inner.out.video", "free"),
                   ("trace_vae_video_decode_fp16", "", "vae"),
                   ("trace_vae_video_decode_fp32", "", "vae"),
                   ("trace_gen_fx_curve_bf16_t2va_fp32", "sampler.step0.", "e2e"))),
    # every approximate backend's kernel row, each a CPU stand-in 20 % off what its contract holds it to
    **{f"kernel-{b}": Run(f"stand_in={b}:0.2", {"": BF16},
                          ("--attention", b, *BF16_TEACHER),
                          (("trace_fx_bf16_ref2va_bf16", "token_refiner.blocks.0.attn.out_proj.in", "kernel"),))
       for b in KERNEL_ROWS},
    # the 8-bit linears through a tier: int8 with its rotated layers (e4m3 takes the same replay with its format flag)
    "tier": Run("fp8", {"": BF16}, ("--tier", "int8_rotated", *BF16_TEACHER),
                (("trace_fx_bf16_ref2va_bf16", "blocks.0.", "kernel"),)),
    "class-and-drift": Run("stand_in=sage2:0.03", {"c1": BF16, "c2": BF16},
                           ("--attention", "sage2", "-k", "test_dit_layers and free and ref2va_bf16"),
                           (("trace_fx_bf16_ref2va_bf16", "dit_inner.out.", "class"),
                            ("trace_fx_bf16_ref2va_bf16", "drift.", "drift")),
                           sage=("c1",), baselines={"c2": "sage2"}),
    "e2e-frames": Run("", {"": BF16}, ("--e2e-path", "fp8_linear", "-k", "test_e2e_frames_vs_exact"),
                      (("e2e_bundled_96x64x22_4steps", "drift.", "drift"),), baselines={"e2e": "fp8_linear"}),
}


def _copy(folder: Path, stems: tuple[str, ...]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for stem in stems:
        for suffix in (".safetensors", ".json"):
            if (FIXTURES / f"{stem}{suffix}").is_file():
                shutil.copy(FIXTURES / f"{stem}{suffix}", folder / f"{stem}{suffix}")
    if any(s.startswith("trace_vae_") for s in stems):
        shutil.copy(FIXTURES / "vae_config_fixture.json", folder / "vae_config_fixture.json")


def _sage_recording(folder: Path) -> None:
    """ComfyUI+sage's recording of the folder's bf16 case, stood in by ComfyUI's own bf16 recording (its tensors and
    their digests unchanged, its manifest saying sage): the class rule's reference."""
    stem = BF16[0]
    shutil.copy(folder / f"{stem}.safetensors", folder / f"{stem}_sage.safetensors")
    m = json.loads((folder / f"{stem}.json").read_text())
    (folder / f"{stem}_sage.json").write_text(json.dumps({**m, "attention": "attention_sage"}))


def _baseline(path: Path, label: str, names: dict[str, int]) -> None:
    """A baseline far below what the mode measures (1e-7 each): the planted drift."""
    from parity_tests.drift import Quantity, data

    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **data(label, {n: Quantity(1e-7, 0.0, paths) for n, paths in names.items()}))


def _setup(run: Run, root: Path) -> tuple[Path, Path]:
    from parity_tests.drift import store_for
    from parity_tests.e2e_frames import E2EModel

    traces, baselines = root / "traces", root / "baselines"
    for sub, stems in run.files.items():
        _copy(traces / sub, stems)
    for sub in run.sage:
        _sage_recording(traces / sub)
    for where, label in run.baselines.items():
        if where == "e2e":
            store = store_for(FIXTURES, E2EModel.load(None).id, "cpu", baselines)
            _baseline(store.path(label), label, {"frames": 2, "waveform": 2})
        else:
            store = store_for(traces / where, BF16[0], "cpu", baselines)
            _baseline(store.path(label), label, {"out.sampler.denoised.video": 1, "out.sampler.denoised.audio": 1,
                                                 "x0.video": 2, "x0.audio": 2})
    if "--tier" in run.flags:
        (root / "tiers.json").write_text(json.dumps(TIERS))
    return traces, baselines


def _replay_lines(stdout: str, report_md: str) -> set[str]:
    printed = set(re.findall(r"^\s+replay: (.+)$", stdout, re.M))
    reported = set(re.findall(r"^  `(python -m .+)`$", report_md, re.M))
    return printed | reported


def _figure(out: str, name: str) -> float | None:
    m = re.search(rf"^\[(?:h3direct[^\]]*|drift)\] {re.escape(name)}: .*OVER BUDGET \(error ([0-9.eE+-]+) >", out,
                  re.M)
    return float(m.group(1)) if m else None


@pytest.mark.parametrize("name", list(RUNS))
def test_every_printed_replay_reproduces_its_row(name, tmp_path):
    run = RUNS[name]
    traces, baselines = _setup(run, tmp_path)
    env = plants.environment(tmp_path / "plants", run.plants)
    env.pop("H3_COMFY_ROOT", None)
    env.pop("H3_COMFY_PYTHON", None)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["OMP_NUM_THREADS"] = "1"
    here, elsewhere = tmp_path / "gate", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    flags = list(run.flags)
    if "--tier" in flags:
        flags += ["--tiers", str(tmp_path / "tiers.json")]
    gate = subprocess.run([sys.executable, "-m", "pytest", "-m", "parity", "-q", "-p", "no:cacheprovider",
                           "--trace-dir", str(traces), "--baselines", str(baselines), "--parity-report",
                           str(here / "report"), *flags, str(REPO / "parity_tests")],
                          cwd=here, env=env, capture_output=True, text=True, timeout=600)
    report = here / "report"
    assert report.is_dir(), gate.stdout[-3000:] + gate.stderr[-3000:]
    assert "not replayable" not in gate.stdout, gate.stdout[-3000:]
    rows = [json.loads(line) for line in (report / "results.jsonl").read_text().splitlines()]
    commands = _replay_lines(gate.stdout, (report / "report.md").read_text())
    replayed = []
    for command in sorted(commands):
        row = next((r for r in rows if r["replay"] == command and not r["passed"]), None)
        assert row is not None, f"a printed replay names no failing row of results.jsonl: {command}"
        r = subprocess.run(["bash", "-c", command], cwd=elsewhere, env=env, capture_output=True, text=True,
                           timeout=600)
        out = r.stdout + r.stderr
        assert r.returncode == 1, f"{command}\nexit {r.returncode}:\n{out[-3000:]}"
        figure = _figure(r.stdout, row["layer"])
        assert figure is not None, f"{command}: no judged line for {row['layer']}:\n{out[-3000:]}"
        assert math.isclose(figure, float(row["error"]), rel_tol=1e-3), (command, figure, row["error"])
        if " --mode free" in command:
            drift = r.stdout.split("where the drift starts:")[1]
            assert "first recorded tensor out of the rule:" in drift, out[-3000:]
            if row["part"] == "exact" and row["layer"] in TEACHER_SEES:  # the planted layer itself
                assert f"teacher-forced, first layer out of the rule: {row['layer']}:" in drift, out[-3000:]
            elif row["part"] == "exact":  # a bug between the layers: each within its rule, said so
                assert "teacher-forced: all" in drift and "within the rule" in drift, out[-3000:]
        replayed.append((row["case"], row["layer"], row["mode"] if row["part"] == "exact" else row["part"]))
    for stem, layer, kind in run.rows:  # every planted kind of row was among them (kind: the mode of an exact row,
        # else the part that judged it)
        assert any(c.endswith(stem) and n.startswith(layer) and k == kind for c, n, k in replayed), (
            f"{name}: no replayed {kind} row {layer}* of {stem}; replayed: {replayed}\n{gate.stdout[-3000:]}")


def test_a_row_that_cannot_be_replayed_says_why_in_place_of_a_command(tmp_path):
    """Where the run's recordings do not outlive it (the live gate without --keep-traces) no command is printed that
    cannot work: the row says why, in the failure and in the report."""
    import dataclasses
    from types import SimpleNamespace

    from h3direct.traces.format import load_trace
    from parity_tests.discovery import find_dit_cases
    from parity_tests.gate import run_dit_case
    from parity_tests.plugin import replay_context
    from parity_tests.report import ReportCollector

    options = {"--comfy-root": "/comfy", "--keep-traces": False, "--comfy-python": None}
    config = SimpleNamespace(getoption=options.get, invocation_params=SimpleNamespace(dir=str(tmp_path)))
    context = replay_context(config)
    assert "removed at the end of the run" in context.unreplayable
    assert not replay_context(SimpleNamespace(getoption={**options, "--keep-traces": True}.get,
                                              invocation_params=config.invocation_params)).unreplayable
    case = next(c for c in find_dit_cases([FIXTURES])[0] if c.id.endswith("trace_fx_bf16_ref2va_fp32"))
    trace = load_trace(case.trace)
    name = "blocks.1.mlp.fc1.out"
    bent = dataclasses.replace(trace, tensors={**trace.tensors, name: trace.tensors[name] * 1.01})
    result = run_dit_case(case, mode="teacher", trace=bent, replay=context)
    first = result.first_failure
    assert first is not None and first.name == name, result.report()
    assert first.replay == f"not replayable: {context.unreplayable}", first.replay
    assert f"replay: not replayable: {context.unreplayable}" in result.report()
    collector = ReportCollector()
    collector.add_case(result)
    assert f"not replayable: {context.unreplayable}" in collector.markdown()


def test_every_approximate_attention_backend_has_its_kernel_row_replayed():
    """The kernel rows above cover every approximate backend the registry holds, each by its own run or by the run of
    the backend whose calls it makes (a backend added without a replay run fails this test)."""
    from h3direct.dit import attention as A

    approximate = {name for name, b in A._REGISTRY.items() if not b.exact}
    assert set(KERNEL_ROWS) | set(SAME_ROW_AS) == approximate, approximate
    assert set(SAME_ROW_AS.values()) <= set(KERNEL_ROWS)
