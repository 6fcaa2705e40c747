"""The VAE gate can fail: one recorded key scaled by 1.001 is caught and named; a different tile geometry fails."""

from __future__ import annotations

import pytest

from h3direct.traces.format import Trace
from parity_tests.discovery import find_vae_cases
from parity_tests.vae_gate import h3direct_trace, run_vae_case


@pytest.fixture(scope="module")
def fp32_vae_cases(request):
    from parity_tests.discovery import FIXTURES

    cases, _ = find_vae_cases([FIXTURES])  # the gate's own proof uses the committed fixtures, whatever the roots
    by_kind = {}
    for c in cases:
        if c.dtype == "fp32":
            by_kind.setdefault(c.kind, c)
    assert by_kind, "fixtures/ yields no fp32 ComfyUI VAE trace: the gate's proof needs one"
    return by_kind


def _scaled(trace: Trace, name: str, factor: float) -> Trace:
    tensors = dict(trace.tensors)
    tensors[name] = tensors[name] * factor
    return Trace(trace.path, tensors, trace.manifest, trace.stored)


def test_scaled_vae_key_is_caught_and_named(fp32_vae_cases):
    """Per VAE kind: a module key and the final output, each scaled by 1.001 in an in-memory copy, fail the gate
    with that key as the first failure."""
    from parity_tests.vae_gate import _trace

    for kind, case in sorted(fp32_vae_cases.items()):
        trace = _trace(str(case.trace))
        names = trace.names_in_order()
        module = next(n for n in names if not n.endswith((".vae_decode.out", ".vae_encode.out")))
        final = next(n for n in reversed(names) if n.endswith((".vae_decode.out", ".vae_encode.out")))
        assert run_vae_case(case, trace=trace).passed, f"{case.id}: unperturbed trace must pass"
        for name in (module, final):
            result = run_vae_case(case, trace=_scaled(trace, name, 1.001))
            first = result.first_failure
            assert first is not None, f"{kind}: 1e-3 at {name} passed the VAE gate"
            assert first.name == name, f"{kind}: perturbed {name}, gate blamed {first.name}"
            assert name in result.report()


def test_other_tile_geometry_fails(fp32_vae_cases):
    """The decoder's rope positions are per tile: decoding the same latents untiled must fail the fp32 gate."""
    import json

    import torch

    from h3direct.traces.format import load_vae_inputs
    from h3direct.vae import decode_video, load_vae

    case = fp32_vae_cases.get("video_decode")
    assert case is not None, "fixtures/ yields no fp32 ComfyUI video decode trace: the gate's proof needs one"
    from parity_tests.vae_gate import _trace

    trace = _trace(str(case.trace))
    vae = load_vae(case.weights, json.loads(case.config.read_text()))
    latents = load_vae_inputs(case.inputs)["video_decode"]
    ours = h3direct_trace(str(case.weights), str(case.config), str(case.inputs), "fp32", "decode")
    tensors = dict(ours.tensors)
    tiled_cases = [c for c, info in trace.manifest.get("cases", {}).items()
                   if len((info.get("split_tiles_h") or [[0]])[0]) > 1 and c in latents]
    assert tiled_cases, f"{case.id}: no spatially tiled case (fixtures/ records one; the proof needs it)"
    c = tiled_cases[0]
    with torch.inference_mode():
        tensors[f"{c}.vae_decode.out"] = decode_video(vae, latents[c]["latent"], tile_size=0)
    result = run_vae_case(case, ours=Trace(ours.path, tensors, ours.manifest, ours.stored))
    assert result.first_failure is not None and result.first_failure.name == f"{c}.vae_decode.out", result.report()
