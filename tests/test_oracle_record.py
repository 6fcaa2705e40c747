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
from oracle.replay_report import report
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
    from oracle.request import Rule

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


def test_the_sage_recording_goes_beside_the_trace_and_needs_sageattention(tmp_path, capsys, monkeypatch):
    """`--sage-twin` records ComfyUI --use-sage-attention as `<stem>_sage`; where SageAttention does not import it
    is one line and exit 2, before ComfyUI is opened; by default it is on only on CUDA where it imports."""
    import argparse

    from oracle import record as R
    from oracle.__main__ import main

    assert R.sage_path("/x/trace_v4_bf16.safetensors") == Path("/x/trace_v4_bf16_sage.safetensors")
    monkeypatch.setattr(R, "sage_importable", lambda: False)
    monkeypatch.setattr(R, "open_run", lambda args: pytest.fail("opened ComfyUI"))
    argv = ["record", "--checkpoint", "c.safetensors", "--inputs", "i.safetensors", "--compute-dtype", "bf16",
            "--out", str(tmp_path / "t_bf16.safetensors")]
    assert main(argv + ["--sage-twin"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs SageAttention, which is not importable here" in err[0], err

    def args(**kw):
        base = {"compute_dtype": "bf16", "attention": "pytorch", "sage_twin": None, "device": "cuda"}
        return argparse.Namespace(**{**base, **kw})

    assert R.wants_sage_twin(args()) is False  # auto: SageAttention does not import here
    monkeypatch.setattr(R, "sage_importable", lambda: True)
    assert R.wants_sage_twin(args()) is True and R.wants_sage_twin(args(device="cpu")) is False
    assert R.wants_sage_twin(args(sage_twin=False)) is False
    assert R.wants_sage_twin(args(compute_dtype="fp32")) is False
    with pytest.raises(Exception, match="--sage-twin records a low-precision case"):
        R.wants_sage_twin(args(compute_dtype="fp32", sage_twin=True))


def test_a_sage_call_that_fell_back_to_pytorch_attention_is_caught():
    """ComfyUI only logs "Error running sage attention ..., using pytorch attention instead": the recorder's
    handler counts those lines (and no others), so such a recording is refused."""
    import logging

    from oracle.record import _SageFallbacks

    h = _SageFallbacks()
    log = logging.getLogger("test_sage_fallbacks")
    log.addHandler(h)
    try:
        log.error("Error running sage attention: head_dim 80, using pytorch attention instead.")
        log.error("some other error")
        log.warning("Error running sage attention: a warning is not what ComfyUI writes")
    finally:
        log.removeHandler(h)
    assert len(h.lines) == 1 and "head_dim 80" in h.lines[0]
