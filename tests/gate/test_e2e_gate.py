"""The end-to-end gate can fail: a perturbed recorded step, a flipped EasyCache decision."""

from __future__ import annotations

import pytest

from parity_tests.budgets import load_budgets
from parity_tests.discovery import FIXTURES, find_generate_cases
from parity_tests.e2e import run_e2e_case


@pytest.fixture(scope="module")
def gate_options():
    return {"attention": "sdpa", "budgets": load_budgets(), "device": "cpu"}


@pytest.fixture(scope="module", params=[0, 1], ids=["first", "second"])
def gen_case(request):
    cases, problems = find_generate_cases([FIXTURES])
    assert not problems and len(cases) >= 2, problems
    plain = [c for c in cases if not c.manifest.get("cache")]
    return (plain or cases)[request.param % len(plain or cases)]


def test_e2e_gate_catches_a_perturbed_step(gen_case, gate_options):
    """A 1e-3 relative error in one recorded mid-run step makes the e2e gate fail there."""
    from h3direct.traces.format import Trace, load_trace

    name = f"sampler.step{int(gen_case.manifest['steps']) // 2}.denoised.video"
    trace = load_trace(gen_case.trace)
    tensors = dict(trace.tensors)
    tensors[name] = tensors[name] * 1.001
    result = run_e2e_case(gen_case, attention=gate_options["attention"], budgets=gate_options["budgets"],
                          device=gate_options["device"], trace=Trace(trace.path, tensors, trace.manifest, trace.stored))
    assert result.first_failure is not None and result.first_failure.name == name, result.report()


def test_easycache_runs_reproduce_comfyui_decisions(gate_options):
    """ComfyUI's EasyCache node (fixtures/trace_gen_*_easycache*): h3direct's `easycache` reuses exactly the steps
    ComfyUI reused and reproduces every step; a flipped decision in the record is caught at `cache.evaluated`."""
    from h3direct.traces.format import Trace, load_trace
    from parity_tests.discovery import FIXTURES

    cases = [c for c in find_generate_cases([FIXTURES])[0] if c.manifest.get("cache")]
    assert len(cases) >= 2, "the EasyCache fixture traces are missing"
    for case in cases:
        trace = load_trace(case.trace)
        evaluated = trace.get("cache.evaluated")
        assert 0 < int(evaluated.sum()) < len(evaluated), f"{case.id}: ComfyUI reused no step (or every step)"
        result = run_e2e_case(case, attention="sdpa", budgets=gate_options["budgets"])
        assert result.passed, result.report()
        assert any(r.name == "cache.evaluated" and r.passed for r in result.layers)
        flipped = evaluated.clone()
        i = int((evaluated == 0).nonzero()[0])
        flipped[i] = 1
        tensors = dict(trace.tensors)
        tensors["cache.evaluated"] = flipped
        bad = run_e2e_case(case, attention="sdpa", budgets=gate_options["budgets"],
                           trace=Trace(trace.path, tensors, trace.manifest, trace.stored))
        assert any(r.name == "cache.evaluated" and not r.passed for r in bad.layers), bad.report()
