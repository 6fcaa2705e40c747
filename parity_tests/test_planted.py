"""The gate lane's one planted-failure check: a green run shows that this machine's gate can fail, not only that the
committed tests once showed it (the unit lane, tests/gate/, checks every rule). On this run's first case, with this
run's backend and device, a 1 % error must fail the gate and be named:

- a DiT case: an h3direct linear scaled by 1.01 (teacher-forced);
- a VAE-only run: one of h3direct's recorded module outputs scaled by 1.01;
- a generation-only run: one recorded step latent of ComfyUI's trace scaled by 1.01.
"""

from __future__ import annotations

import dataclasses

import pytest

from parity_tests.gate import run_dit_case
from parity_tests.models import model, run_dtype

pytestmark = [pytest.mark.parity, pytest.mark.planted]

LAYER = "blocks.1.mlp.fc1"
PLANT = 1.01


def test_a_planted_bug_fails_the_gate(request, gate_options):
    from parity_tests.conftest import _cases

    found = _cases(request.config)
    dit = [c for c in found.dit if c.compute == "fp32" or c.twin_fp32 is not None or gate_options["no_twin"]]
    if dit:
        _planted_linear(dit[0], gate_options)
    elif found.vae:
        _planted_vae_output(found.vae[0], gate_options)
    elif found.gen:
        _planted_step(found.gen[0], gate_options)
    else:  # the lane's own no-case check stops such a run before this test
        pytest.fail("no case in these roots to plant a bug in", pytrace=False)


def _planted_linear(case, gate_options) -> None:
    attention, device = gate_options["attention"], gate_options["device"]
    compute, reason = run_dtype(attention, case.compute, device)
    if reason is not None:  # the lane's collection check stops such a run first; here too it is red, not a skip
        pytest.fail(f"--attention {gate_options['attention_label']}: {reason}", pytrace=False)
    from h3direct.dit.attention import is_exact

    key = compute if is_exact(attention) and compute != case.compute else case.compute
    nvfp4 = case.weights.split("_")[1] if case.weights.startswith("nvfp4") else "w4a16"
    dit = model(str(case.checkpoint), key, nvfp4, device)
    layer = LAYER if LAYER in dict(dit.named_modules()) else "token_refiner.blocks.0.mlp.fc1"
    handle = dit.get_submodule(layer).register_forward_hook(lambda m, a, out: out * PLANT)
    try:
        result = run_dit_case(case, mode="teacher", attention=attention, device=device,
                              budgets=gate_options["budgets"], compute=compute, no_twin=gate_options["no_twin"])
    finally:
        handle.remove()
    _named(result, f"{layer}.out", f"a {PLANT} scale of h3direct's {layer}")


def _planted_vae_output(case, gate_options) -> None:
    from parity_tests.vae_gate import h3direct_trace, run_vae_case

    ours = h3direct_trace(str(case.weights), str(case.config), str(case.inputs), case.dtype, case.kind.split("_")[1])
    key = ours.names_in_order()[0]
    bent = dataclasses.replace(ours, tensors={**ours.tensors, key: ours.tensors[key] * PLANT})
    result = run_vae_case(case, attention=gate_options["attention_label"], budgets=gate_options["budgets"], ours=bent)
    _named(result, key, f"a {PLANT} scale of h3direct's {key}")


def _planted_step(case, gate_options) -> None:
    from h3direct.traces.format import load_trace
    from parity_tests.e2e import run_e2e_case

    trace = load_trace(case.trace)
    key = next(n for n in trace.names_in_order() if n.startswith("sampler.step") and ".denoised." in n)
    bent = dataclasses.replace(trace, tensors={**trace.tensors, key: trace.tensors[key] * PLANT})
    result = run_e2e_case(case, attention=gate_options["attention"], budgets=gate_options["budgets"],
                          device=gate_options["device"], trace=bent)
    _named(result, key, f"a {PLANT} scale of ComfyUI's recorded {key}")


def _named(result, name: str, what: str) -> None:
    first = result.first_failure
    if first is None or first.name != name:
        pytest.fail(f"{what} was not named as the gate's first failure on {result.case.id}:\n{result.report()}",
                    pytrace=False)
