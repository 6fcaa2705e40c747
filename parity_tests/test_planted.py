"""The gate lane's one planted-failure check: on this run's first DiT case, with this run's backend and device, an
h3direct linear scaled by 1.01 must fail the gate and be named. A green run therefore shows that this machine's gate
can fail, not only that the committed tests once showed it (the unit lane, tests/gate/, checks every rule)."""

from __future__ import annotations

import pytest

from parity_tests.gate import run_dit_case
from parity_tests.models import model, run_dtype

pytestmark = [pytest.mark.parity, pytest.mark.planted]

LAYER = "blocks.1.mlp.fc1"


def test_a_planted_linear_bug_fails_the_gate(request, gate_options):
    from parity_tests.conftest import _cases

    cases = [c for c in _cases(request.config).dit if c.compute == "fp32" or c.twin_fp32 is not None
             or gate_options["no_twin"]]
    if not cases:
        pytest.skip("no DiT case in these roots")  # the lane's own no-case check fails such a run
    case = cases[0]
    attention, device = gate_options["attention"], gate_options["device"]
    compute, reason = run_dtype(attention, case.compute, device)
    if reason is not None:  # the lane's collection check stops such a run first; here too it is red, not a skip
        pytest.fail(f"--attention {gate_options['attention_label']}: {reason}", pytrace=False)
    from h3direct.dit.attention import is_exact

    key = compute if is_exact(attention) and compute != case.compute else case.compute
    nvfp4 = case.weights.split("_")[1] if case.weights.startswith("nvfp4") else "w4a16"
    dit = model(str(case.checkpoint), key, nvfp4, device)
    layer = LAYER if LAYER in dict(dit.named_modules()) else "token_refiner.blocks.0.mlp.fc1"
    handle = dit.get_submodule(layer).register_forward_hook(lambda m, a, out: out * 1.01)
    try:
        result = run_dit_case(case, mode="teacher", attention=attention, device=device,
                              budgets=gate_options["budgets"], compute=compute, no_twin=gate_options["no_twin"])
    finally:
        handle.remove()
    first = result.first_failure
    assert first is not None and first.name == f"{layer}.out", (
        f"a 1.01 scale of h3direct's {layer} passed the gate on {case.id}:\n{result.report()}")
