"""The gate must be able to fail: a 1e-3 relative error injected at any layer kind (in the trace, or in one
h3direct layer) makes it fail and name that layer; a 1 % error in a copied trace file fails with the replay
command. Uses the first fp32, bf16-checkpoint trace of fixtures/ (full detail)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3direct.traces.format import Trace, tensor_sha256, tensor_stats
from parity_tests.discovery import find_dit_cases
from parity_tests.gate import run_dit_case


@pytest.fixture(scope="module")
def fp32_case(request):
    from parity_tests.discovery import FIXTURES

    cases, _ = find_dit_cases([FIXTURES])  # the gate's own proof uses the committed fixtures, whatever the roots
    full = [c for c in cases if c.compute == "fp32" and c.weights == "bf16"
            and json.loads(c.trace.with_suffix(".json").read_text()).get("trace_detail", "full") == "full"]
    assert full, "fixtures/ yields no fp32 trace of a bf16 checkpoint with full detail: the gate's proof needs one"
    return full[0]


def _perturbed(trace: Trace, name: str, factor: float) -> Trace:
    tensors = dict(trace.tensors)
    tensors[name] = tensors[name] * factor
    return Trace(trace.path, tensors, trace.manifest, trace.stored)


def _one_site_per_kind(case):
    from h3direct.traces.evaluate import conditioning_of
    from h3direct.traces.inputs import load_inputs
    from h3direct.traces.replay import available_sites
    from parity_tests.models import model as load_model
    from parity_tests.models import trace as load_trace_cached

    trace = load_trace_cached(str(case.trace))
    inputs = load_inputs(case.inputs)
    model = load_model(str(case.checkpoint), case.compute, "w4a16", "cpu")
    picked = {}
    for s in available_sites(model, trace, conditioning_of(inputs), inputs["text_states"]):
        picked.setdefault(s.kind, s.name)
    return trace, picked


def test_gate_passes_unperturbed(fp32_case):
    for mode in ("teacher", "free"):
        result = run_dit_case(fp32_case, mode=mode)
        assert result.passed, result.report()


@pytest.mark.parametrize("mode", ["teacher", "free"])
def test_trace_perturbation_is_caught_at_each_kind(fp32_case, mode):
    trace, picked = _one_site_per_kind(fp32_case)
    assert {"linear", "norm", "rope", "attention", "adaln", "block", "output"} <= set(picked), picked
    for kind, name in picked.items():
        if mode == "free" and name not in trace.names_in_order():
            continue
        result = run_dit_case(fp32_case, mode=mode, trace=_perturbed(trace, name, 1.0 + 1e-3))
        first = result.first_failure
        assert first is not None, f"{mode}: 1e-3 at {name} ({kind}) passed the gate"
        # an alias of the same stored tensor may come first in execution order; it is the same layer output
        same = {name} | {a for a, t in trace.aliases.items() if t == name} | {trace.aliases.get(name, name)}
        assert first.name in same, f"{mode}: perturbed {name}, gate blamed {first.name}"


def test_h3direct_layer_perturbation_is_caught(fp32_case, monkeypatch):
    from parity_tests.models import model as load_model

    model = load_model(str(fp32_case.checkpoint), fp32_case.compute, "w4a16", "cpu")
    target = model.blocks[len(model.blocks) - 1].mlp.fc1
    handle = target.register_forward_hook(lambda m, a, out: out * (1.0 + 1e-3))
    try:
        result = run_dit_case(fp32_case, mode="teacher")
    finally:
        handle.remove()
    last = len(model.blocks) - 1
    assert result.first_failure is not None
    assert result.first_failure.name == f"blocks.{last}.mlp.fc1.out", result.report()


def test_scaled_layer_in_a_copied_trace_fails_with_replay_command(fp32_case, tmp_path):
    for p in (fp32_case.trace, fp32_case.trace.with_suffix(".json"), fp32_case.checkpoint, fp32_case.inputs):
        shutil.copy(p, tmp_path / p.name)
    layer = "blocks.0.mlp.fc1.out"
    path = tmp_path / fp32_case.trace.name
    tensors = load_file(path)
    assert layer in tensors, "fixture trace must store the layer unaliased"
    tensors[layer] = tensors[layer] * 1.01
    save_file(tensors, path)
    # a trace that really recorded this (manifest digests consistent), not an edited file discovery would refuse
    mpath = path.with_suffix(".json")
    m = json.loads(mpath.read_text())
    m["tensors"][layer].update(tensor_stats(tensors[layer]), sha256=tensor_sha256(tensors[layer]))
    mpath.write_text(json.dumps(m))
    cases, problems = find_dit_cases([tmp_path])
    assert not problems and len(cases) == 1
    result = run_dit_case(cases[0], mode="teacher")
    assert result.first_failure is not None and result.first_failure.name == layer
    text = result.report()
    assert layer in text and f"python -m oracle replay --trace {path} --layer {layer}" in text
    assert torch.isfinite(torch.tensor(result.first_failure.rel_l2))
