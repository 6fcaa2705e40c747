"""The end-to-end merge gate: every recorded step of every ComfyUI generation trace (`parity_tests/e2e.py`)."""

from __future__ import annotations

import pytest

from parity_tests.e2e import run_e2e_case

pytestmark = pytest.mark.parity


def test_e2e_per_step_latents(gen_case, gate_options, report):
    result = run_e2e_case(gen_case, attention=gate_options["attention"], budgets=gate_options["budgets"],
                          device=gate_options["device"])
    report.add_case(result)
    steps = int(gen_case.manifest["steps"])
    assert sum(r.name.startswith("sampler.step") for r in result.layers) == 4 * steps, "per-step latents missing"
    assert result.passed, result.report()
