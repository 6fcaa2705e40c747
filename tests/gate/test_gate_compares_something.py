"""A parity run that compares nothing for the backend it was asked for is red, with one line that says why.

- A backend that cannot run any DiT case on this device (a GPU-only backend on the CPU; on a GPU without
  SageAttention, sol_attn and kj_head_sliced whose default fallback / inner backend is sage2; `--device cuda`
  without a GPU) stops the run before any compute: exit 4, one line naming the reason and the backends that run.
- A backend whose calls all ran its documented fallback (sol_attn on cases below its kernel's head_dim) fails the
  run at its end with one line; the same run with a case the kernel takes passes.
The GPU is simulated where needed by patching the availability probes (a pytest plugin given with -p).
"""

from __future__ import annotations

import pytest
import torch

from tests.gate.test_gate_options import REPO, _pytest

CASE = "trace_fx_bf16_ref2va_bf16"

GPU_WITHOUT_SAGE = '''
from h3direct.dit import attention as A

A._cuda_only = lambda like: None  # the probes see a GPU, an H200
A._capability = lambda like: (9, 0)
A.sol_kernel_reason = lambda like: None  # with comfy-kitchen's sol_attn kernel built for it
'''

SOL_ON_THE_CPU = '''
import torch.nn.functional as F
from h3direct.dit import attention as A


def eager_kernel(q, k, v, **kw):  # [B, S, H, D] -> [B, S, H, D]: exact attention, standing in for the sparse kernel
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


A._REGISTRY["sol_attn"] = A.Backend("sol_attn", lambda q, k, v, o: A.sol_call(q, k, v, eager_kernel, o),
                                    lambda like, o: None, exact=False, options=A._REGISTRY["sol_attn"].options)
A._REGISTRY["sage2"] = A.Backend("sage2", A._REGISTRY["sdpa"].fn, lambda like: None, exact=False)
'''


def _error_lines(r) -> list[str]:
    return [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("ERROR:")]


@pytest.mark.parametrize("backend, why", [
    ("fa3", "needs a CUDA device"),  # an exact GPU-only backend
    ("kj_head_sliced", "needs a CUDA device"),  # an approximate one through its inner backend (sol_attn: below)
])
def test_a_backend_that_cannot_run_here_stops_the_run_with_one_line(backend, why, tmp_path):
    r = _pytest(["-m", "parity", "--attention", backend, str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    lines = _error_lines(r)
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"--attention {backend} cannot run any DiT case on cpu" in lines[0] and why in lines[0], lines[0]
    assert "attention backends that run here: sdpa" in lines[0], lines[0]


@pytest.mark.parametrize("backend", ["sol_attn", "kj_head_sliced"])
def test_on_a_gpu_without_sageattention_its_default_fallback_stops_the_run(backend, tmp_path):
    r = _pytest(["-m", "parity", "--attention", backend, str(REPO / "parity_tests")], tmp_path,
                plugins={"gpu_without_sage": GPU_WITHOUT_SAGE})
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    lines = _error_lines(r)
    assert len(lines) == 1 and f"--attention {backend} cannot run any DiT case" in lines[0], lines
    assert "'sage2'" in lines[0] and "sageattention is not importable" in lines[0], lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_device_cuda_without_a_gpu_stops_the_run(tmp_path):
    r = _pytest(["-m", "parity", "--device", "cuda", str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4
    lines = _error_lines(r)
    assert len(lines) == 1 and "--device cuda: no CUDA device here" in lines[0], lines


def test_a_backend_that_ran_only_its_fallback_fails_the_run(tmp_path):
    """sol_attn on a case of head_dim 32 (its kernel takes 128): every call runs its fallback; each comparison
    passes, and the run fails at its end with one line naming the fallback and sol_strict."""
    args = ["-m", "parity", "--attention", "sol_attn", "--trace-dir", str(REPO / "fixtures"), "--baselines",
            str(tmp_path / "b"), "-k", f"test_dit_layers and teacher and {CASE}", str(REPO / "parity_tests")]
    r = _pytest(args, tmp_path, plugins={"sol_on_the_cpu": SOL_ON_THE_CPU})
    out = r.stdout
    assert r.returncode == 1 and "1 passed" in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("FAILED: parity gate")]
    assert len(lines) == 1, out[-3000:]
    assert "ran its fallback in every call (fallback to sage2: head_dim" in lines[0], lines[0]
    assert "its kernel was compared nowhere" in lines[0] and "--option sol_strict=on" in lines[0], lines[0]


def test_the_fallback_check_counts_kernel_calls():
    """The same check over the report's cases: a run where the kernel ran at least once is not flagged."""
    from h3direct.dit.options import AttentionOptions
    from parity_tests.session import kernel_compared_nowhere

    sol = AttentionOptions("sol_attn")
    only = [{"attention_calls": {"sol_attn": {"fallback to sage2: short": 4}}}]
    both = [{"attention_calls": {"sol_attn": {"fallback to sage2: short": 4}}},
            {"attention_calls": {"sol_attn": {"kernel": 2}}}]
    assert "ran its fallback in every call" in kernel_compared_nowhere(sol, "cpu", only)
    assert kernel_compared_nowhere(sol, "cpu", both) is None
    assert kernel_compared_nowhere(sol, "cpu", [{"attention_calls": None}]) is None


RAISES_IN_THE_TEACHER_RUN = '''
from parity_tests import gate

_run = gate.run_dit_case


def run_dit_case(case, *, mode, **kw):
    if mode == "teacher":
        raise RuntimeError("planted: the int8 kernel did not build\\nits second line")
    return _run(case, mode=mode, **kw)


gate.run_dit_case = run_dit_case
'''


def test_a_case_run_that_raises_is_a_failed_case_in_the_report_too(tmp_path):
    """A case test that raises before it concludes (a kernel that does not build on this machine) fails in pytest with
    its traceback and counts as a failed case run in the parity report, its error in place of a failing layer: the
    report and pytest agree (no 'count the case tests differently' warning)."""
    r = _pytest(["-m", "parity", str(REPO / "parity_tests" / "test_dit_parity.py"), "-k", CASE,
                 "--parity-report", str(tmp_path / "report")], tmp_path,
                plugins={"raises_in_the_teacher_run": RAISES_IN_THE_TEACHER_RUN})
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "RuntimeError: planted: the int8 kernel did not build" in out, out[-3000:]
    assert "2 gated rows (a row: one trace of a case, teacher-forced or free-running): 1 passed, 1 failed, as pytest " \
        "counts them" in out, out[-3000:]
    assert "count the case tests differently" not in out, out[-3000:]
    for name in ("report.md", "report.html"):
        assert "raised RuntimeError: planted: the int8 kernel did not build" in (tmp_path / "report" / name).read_text()
