"""Every registered attention backend, gated on the teacher-forced attention sites of the traces.

Backends that cannot run here are `pytest.param`s skipped with the backend's own reason (from the library
probe in `h3direct.dit.attention`), so a GPU run exercises them and a CPU run says why it did not.
"""

from __future__ import annotations

import pytest
import torch

from h3direct.dit.attention import backends, unavailable_reason
from parity_tests.gate import run_dit_case

pytestmark = pytest.mark.parity


def _params():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe = torch.empty(0, device=device, dtype=torch.bfloat16)  # dtype-specific reasons come per case
    out = []
    for name in backends():
        reason = unavailable_reason(name, probe)
        out.append(pytest.param(name, id=name, marks=pytest.mark.skipif(reason is not None, reason=str(reason))))
    return out


@pytest.fixture(scope="module")
def sample_cases(request):
    """One trace per compute dtype (the first found): enough to exercise a backend's numerics."""
    from h3direct.traces.discovery import find_dit_cases
    from parity_tests.plugin import trace_roots

    cases, _ = find_dit_cases(trace_roots(request.config))
    picked = {}
    for c in cases:
        picked.setdefault(c.compute, c)
    if not picked:
        pytest.skip("no DiT traces found")
    return list(picked.values())


@pytest.mark.parametrize("backend", _params())
def test_attention_backend_on_recorded_inputs(backend, sample_cases, gate_options):
    device = gate_options["device"]
    if backend != "sdpa" and device == "cpu" and torch.cuda.is_available():
        device = "cuda"
    ran, reasons = 0, []
    for case in sample_cases:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.compute]
        reason = unavailable_reason(backend, torch.empty(0, device=device, dtype=dtype))
        if reason is not None:
            reasons.append(f"{case.id}: {reason}")
            continue
        ran += 1
        result = run_dit_case(case, mode="teacher", attention=backend, device=device, budgets=gate_options["budgets"])
        attn = [r for r in result.layers if r.kind == "attention"]
        assert attn, f"{case.id}: no attention site"
        bad = [r for r in attn if not r.passed]
        assert not bad, "\n".join(r.line() for r in bad)
    if not ran:
        pytest.skip("; ".join(reasons))
