"""`python -m oracle record` / `replay` against a real ComfyUI checkout and the shared traces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3direct.traces.format import load_trace
from oracle.compare import diff_traces
from oracle.replay import report
from parity_tests.discovery import SHARED_ORACLE as SHARED

ROUND_OFF = 1e-6  # fp32 round-off between machines (rel-L2 per key), the DONE criterion


def _oracle(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "oracle", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.comfy
@pytest.mark.shared
def test_record_reproduces_shared_mask_trace_and_replays(tmp_path: Path, comfy_root: str) -> None:
    out = tmp_path / "mask.safetensors"
    r = _oracle(
        "record",
        "--comfy-root",
        comfy_root,
        "--checkpoint",
        str(SHARED / "h3_tiny_curve_bf16.safetensors"),
        "--inputs",
        str(SHARED / "inputs_public_curve_t2va_mask.safetensors"),
        "--compute-dtype",
        "fp32",
        "--detail",
        "full",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    mine = load_trace(out)
    d = diff_traces(mine, load_trace(SHARED / "trace_curve_bf16_t2va_mask_fp32.safetensors"))
    assert not d.only_in_reference and not d.shape_mismatch
    assert d.worst.rel_l2 <= ROUND_OFF, d.worst.line()
    assert mine.manifest["bf16_patched"] is False and mine.manifest["attention"] == "attention_pytorch"
    assert mine.manifest["layout"]["segments"] == [[0, 12, "text"], [12, 32, "audio"], [32, 68, "video"]]

    # teacher forcing: block 1 re-run from its recorded inputs reproduces its recorded output
    r = _oracle(
        "replay",
        "--comfy-root",
        comfy_root,
        "--trace",
        str(out),
        "--layer",
        "blocks.1",
        "--checkpoint",
        str(SHARED / "h3_tiny_curve_bf16.safetensors"),
    )
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "[comfy] blocks.1.out" in r.stdout


def test_replay_report_fails_on_injected_error() -> None:
    from h3direct.traces.format import Trace
    from oracle.replay import Rule

    ref = torch.randn(8, 4)
    trace = Trace(Path("x.safetensors"), {"x.out": ref}, {})
    ok, _ = report("comfy", [("x.out", ref.clone())], trace, Rule(budget=1e-5))
    assert ok
    bad = ref.clone()
    bad[3, 1] += 0.05 * ref.norm()
    ok, lines = report("comfy", [("x.out", bad)], trace, Rule(budget=1e-5))
    assert not ok and "OVER BUDGET" in lines[0] and "[3, 1]" in lines[0]
    ok, lines = report("comfy", [("x.out", bad)], trace, Rule())
    assert ok is None and "OVER" not in lines[0]  # no rule given: reported, not judged
    ok, lines = report("comfy", [("x.out", ref.clone())], trace, Rule())
    assert ok is True and "ok" in lines[0]  # bitwise equal: within any rule, never "drifted"
    two = Trace(Path("x.safetensors"), {"a.out": ref, "b.out": ref}, {})
    ok, _ = report("comfy", [("a.out", ref.clone()), ("b.out", bad)], two, Rule())
    assert ok is None  # one equal, one unjudged: no verdict, never "all within budget"
    ok, _ = report("comfy", [("a.out", ref.clone()), ("b.out", bad)], two, Rule(budget=1e-5))
    assert ok is False


def test_the_fp32_twin_goes_beside_the_low_precision_trace():
    from oracle.record import twin_path

    assert twin_path("/x/trace_bf16_ref2va_bf16.safetensors").name == "trace_bf16_ref2va_fp32.safetensors"
    assert twin_path("/x/trace_case_fp16.safetensors").name == "trace_case_fp32.safetensors"
    assert twin_path("/x/run.safetensors").name == "run_fp32.safetensors"
