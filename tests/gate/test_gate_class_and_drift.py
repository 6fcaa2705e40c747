"""An approximate mode's free run against ComfyUI's fast mode of its class, and against its own history.

- Discovery pairs ComfyUI's `--use-sage-attention` recording of a case with the case (it is no case of its own).
- The class rule: a CPU stand-in of sage2 within its contract passes at every output against a recording of
  ComfyUI+sage; one far off fails there, as a "class" row, while every exact comparison passes. Without the
  recording the case says its class reference is missing; sol_attn (no ComfyUI counterpart) has no class rule.
- The ladder of a case: ComfyUI bf16 (×1), ComfyUI+sage, h3direct's exact path and the mode, × ComfyUI's error.
- The drift gate, as a user runs it (`pytest -m parity --fp8-linear`, CPU emulation): the first run records the
  mode's baseline and fails once ("created"), a rerun passes, and a planted coarsening of the FP8 activation
  scales fails naming the mode and the case.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parity_tests.discovery import FIXTURES, find_dit_cases
from tests.gate.test_gate_approximate import LARGE, SMALL
from tests.gate.test_gate_approximate import approximate as approximate  # the stand-in fixture, re-exported

CASE = "trace_fx_bf16_ref2va_bf16"
TWIN = "trace_fx_bf16_ref2va_fp32"
SAGE_ERROR = 3.0  # the recording's error at every tensor: sqrt(1 + 3²) × ComfyUI bf16's own


def _copy_case(root: Path) -> None:
    for stem in (CASE, TWIN):
        m = json.loads((FIXTURES / f"{stem}.json").read_text())
        for name in (f"{stem}.json", f"{stem}.safetensors", m["checkpoint"], m["inputs"]):
            shutil.copy(FIXTURES / name, root / name)


def write_sage_recording(root: Path, factor: float = SAGE_ERROR) -> Path:
    """A stand-in for ComfyUI+sage's recording of the case: its bf16 trace with every float tensor moved away from
    the fp32 twin by `factor` × the bf16 trace's own error there, in a seeded random direction."""
    from h3direct.traces.format import load_trace, save_trace

    low, f32 = load_trace(root / f"{CASE}.safetensors"), load_trace(root / f"{TWIN}.safetensors")
    g = torch.Generator().manual_seed(0)
    out = []
    for name in low.names_in_order():
        t = low.get(name)
        if t.is_floating_point() and name in f32 and f32.get(name).shape == t.shape:
            d = (t.double() - f32.get(name).double()).norm()
            n = torch.randn(t.shape, generator=g, dtype=torch.float64)
            t = (t.double() + factor * d * n / n.norm()).to(getattr(torch, low.produced_dtype(name)))
        out.append((name, t))
    manifest = {k: v for k, v in low.manifest.items() if k not in ("order", "tensors", "aliases", "trace_format")}
    manifest["attention"] = "attention_sage"
    return save_trace(root / f"{CASE}_sage.safetensors", out, manifest)


@pytest.fixture(scope="module")
def sage_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("with_sage")
    _copy_case(root)
    write_sage_recording(root)
    return root


def _case(root: Path):
    cases, problems = find_dit_cases([root])
    assert not problems, problems
    return next(c for c in cases if c.trace.stem == CASE)


def test_discovery_pairs_the_sage_recording_with_its_case(sage_root):
    cases, _ = find_dit_cases([sage_root])
    assert sorted(c.trace.stem for c in cases) == [CASE, TWIN]  # the recording is no case of its own
    bf16 = _case(sage_root)
    assert bf16.sage_twin == sage_root / f"{CASE}_sage.safetensors" and bf16.twin_fp32.stem == TWIN
    assert next(c for c in cases if c.trace.stem == TWIN).sage_twin is None


def test_the_class_rule_passes_a_backend_within_its_contract_and_reports_every_layer(sage_root, approximate):
    from parity_tests.gate import run_dit_case

    approximate("sage2", SMALL)
    result = run_dit_case(_case(sage_root), mode="free", attention="sage2")
    assert result.passed, result.report()
    rows = [r for r in result.layers if r.part == "class"]
    gated = [r for r in rows if r.kind == "output"]
    assert {r.name for r in gated} >= {"sampler.denoised.video", "sampler.denoised.audio", "dit_inner.out.video"}
    assert all(r.limit < float("inf") and "ComfyUI+sage" in r.rule for r in gated)
    assert len(rows) > 3 * len(gated) and all(r.limit == float("inf") for r in rows if r.kind != "output")
    modes = [row["mode"] for row in result.ladder["rows"]]
    assert modes[:2] == ["ComfyUI bf16", "ComfyUI --use-sage-attention"] and modes[-1] == "sage2"
    comfy, sage = result.ladder["rows"][0]["x"], result.ladder["rows"][1]["x"]
    assert comfy == {"sampler.denoised.video": 1.0, "sampler.denoised.audio": 1.0}
    for v in sage.values():  # what the recording was made with
        assert v == pytest.approx((1 + SAGE_ERROR ** 2) ** 0.5, rel=0.05)


def test_the_class_rule_fails_a_backend_far_off_its_class(sage_root, approximate):
    from parity_tests.gate import run_dit_case

    approximate("sage2", LARGE)
    result = run_dit_case(_case(sage_root), mode="free", attention="sage2")
    first = result.first_failure
    assert first is not None and first.part == "class" and first.kind == "output", result.report()
    assert "ratio rule" in first.rule and "ComfyUI+sage" in first.rule
    assert all(r.passed for r in result.layers if r.part == "exact")


def test_without_a_sage_recording_the_class_reference_is_missing(approximate):
    from parity_tests.gate import run_dit_case

    approximate("sage2", SMALL)
    case = _case(FIXTURES)
    result = run_dit_case(case, mode="free", attention="sage2")
    assert result.passed and not any(r.part == "class" for r in result.layers)
    assert any("class reference missing" in n for n in result.notes), result.notes


def test_sol_attn_has_no_class_rule(sage_root, approximate):
    from parity_tests.gate import run_dit_case

    approximate("sol_attn", SMALL)
    result = run_dit_case(_case(sage_root), mode="free", attention="sol_attn")
    assert result.passed and not any(r.part == "class" for r in result.layers)
    assert not any("class reference" in n for n in result.notes)
    assert set(result.measured) == {"out.sampler.denoised.video", "out.sampler.denoised.audio", "x0.video",
                                    "x0.audio"}


def test_a_mode_that_claims_the_sage_class_is_held_to_its_rule(sage_root, approximate):
    """--sage-class (`run_dit_case(sage_class=True)`): a mode outside the class (sol_attn; FP8 linears) is held to
    the class rule against ComfyUI+sage at every output, as sage2 is: within it it passes, far off it fails there."""
    from parity_tests.gate import run_dit_case

    approximate("sol_attn", SMALL)
    ok = run_dit_case(_case(sage_root), mode="free", attention="sol_attn", sage_class=True)
    rows = [r for r in ok.layers if r.part == "class" and r.kind == "output"]
    assert ok.passed and rows and all("ComfyUI+sage" in r.rule for r in rows), ok.report()
    approximate("sol_attn", LARGE)
    bad = run_dit_case(_case(sage_root), mode="free", attention="sol_attn", sage_class=True)
    assert bad.first_failure is not None and bad.first_failure.part == "class", bad.report()
    fp8 = run_dit_case(_case(sage_root), mode="free", attention="sdpa", fp8_linear="stream", sage_class=True)
    assert any(r.part == "class" for r in fp8.layers)  # FP8 linears alone: the class rule too (e4m3 errs ×5 here)
    exact = run_dit_case(_case(sage_root), mode="free", attention="sdpa", sage_class=True)
    assert not any(r.part == "class" for r in exact.layers)  # an exact path claims nothing: the exact rules hold it


# ---- the drift gate, as a user runs it ------------------------------------------------------------------

PLANT = '''
import h3direct.checkpoint.quant.w8a8 as w8a8

_scales = w8a8.row_scales


def coarse(t):  # activation and weight scales 2^16 too large: every code below 448 / 2^16, on e4m3's subnormal steps
    return _scales(t) * 65536.0


w8a8.row_scales = coarse
'''


def test_a_mode_records_its_baseline_then_holds_to_it_and_a_planted_growth_fails(tmp_path):
    from tests.gate.test_gate_options import REPO, _pytest

    root = tmp_path / "traces"
    root.mkdir()
    _copy_case(root)
    args = ["-m", "parity", "--trace-dir", str(root), "--fp8-linear", "-k", f"test_dit_layers and free and {CASE}",
            "-p", "no:randomly", str(REPO / "parity_tests")]
    first = _pytest(args, tmp_path)
    baseline = root / "baselines" / "cpu" / CASE / "sdpa_+_fp8_linear_stream.npz"
    assert first.returncode == 1 and f"baseline created: {baseline} " in first.stdout, first.stdout[-3000:]
    assert baseline.is_file()
    # the first run says so in one line per mode and case, with no traceback, and its report counts it as pytest does
    # (pytest's short summary repeats the message whole where it runs on CI, so lines are counted, not substrings)
    said = [line for line in first.stdout.splitlines() if line.startswith("baseline created: ")]
    assert len(said) == 1 and "Traceback" not in first.stdout, first.stdout[-3000:]
    assert "1 gated row (a row: one trace of a case, teacher-forced or free-running): 0 passed, 1 failed, as pytest " \
        "counts them)" in first.stdout, first.stdout[-3000:]
    again = _pytest(args, tmp_path)
    assert again.returncode == 0 and "1 passed" in again.stdout, again.stdout[-3000:]
    planted = _pytest(args, tmp_path, plugins={"coarse_fp8_scales": PLANT})
    out = planted.stdout
    assert planted.returncode == 1, out[-3000:]
    assert f"traces/{CASE} [free" in out and "fp8_w8a8 (stream)" in out, out[-3000:]
    assert "first failing layer in execution order: drift." in out and "drift rule" in out, out[-3000:]
