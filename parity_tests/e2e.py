"""End-to-end parity: h3direct's sampler + denoiser over a short generation against ComfyUI's, step by step.

A generation trace is what `python -m oracle record-generate` writes (manifest `kind: generate`); its checkpoint and
inputs file lie beside it. h3direct runs the same generation (`h3direct.traces.evaluate.short_generation`: same
inputs, sampler, scheduler, shift, steps, step cache) and every recorded tensor (`sampler.sigmas`,
`sampler.step{i}.x.*`, `sampler.step{i}.denoised.*`, `sample_out.*`, `cache.evaluated`) is compared under the
budgets table's mode "e2e" (fp32: the fp32 rule; bf16: the ratio rule against the fp32 twin generation).
"""

from __future__ import annotations

import math

import torch

from h3direct.traces import metrics
from parity_tests.budgets import Measured, verdict
from parity_tests.discovery import GenerateCase
from parity_tests.models import model, nvfp4_mode
from parity_tests.results import (
    CaseResult,
    LayerResult,
    ReplayContext,
    attention_key,
    command,
    replay_request,
    run_options,
)


def run_e2e_case(case: GenerateCase, *, attention, budgets, device: str = "cpu", trace=None,
                 replay: ReplayContext | None = None) -> CaseResult:
    """attention: a backend's name or AttentionOptions. `trace`: an in-memory ComfyUI trace to compare with instead
    of the file (sensitivity tests)."""
    from h3direct.dit.attention import as_options
    from h3direct.dit.options import describe
    from h3direct.traces.evaluate import short_generation
    from h3direct.traces.format import load_trace
    from h3direct.traces.inputs import load_inputs

    trace = trace or load_trace(case.trace)
    dit = model(str(case.checkpoint), case.compute, nvfp4_mode(case), device)
    attention = as_options(attention)
    ours = short_generation(dit, load_inputs(case.inputs), case.manifest, backend=attention, device=device)
    twin = load_trace(case.twin_fp32) if case.twin_fp32 else None
    label = describe(attention)
    result = CaseResult(case, "e2e", label, title=f"{case.id} [e2e, {case.compute}, {case.weights}, {label}]",
                        unit="tensor")
    b = budgets.lookup(mode="e2e", kind="*", compute=case.compute, weights=case.weights,
                       attention=attention_key(attention), twin="yes" if twin is not None else "no")
    redo = replay_request(case.trace, replay, options=run_options(attention), device=device,
                          twin=case.twin_fp32)
    for name in trace.names_in_order():
        ref = trace.get(name)
        mine = ours.get(name)
        if mine is None or tuple(mine.shape) != tuple(ref.shape):
            nan = metrics.MaxAbs(math.inf, (), math.nan, math.nan)
            why = "not produced by h3direct" if mine is None else f"shape {tuple(mine.shape)} != {tuple(ref.shape)}"
            result.layers.append(LayerResult(name, "step", "e2e", math.inf, -math.inf, nan, False, why, "",
                                             command(redo, name), error=math.inf, limit=0.0))
            continue
        mine = mine.detach().float().cpu()
        rel = metrics.rel_l2(mine, ref)
        vs = None
        if twin is not None and name in twin:
            vs = (metrics.rel_l2(mine, twin.get(name)), metrics.rel_l2(ref, twin.get(name)))
        v = verdict(b, Measured(rel, identical=torch.equal(mine, ref.float()), twin=vs))
        result.layers.append(LayerResult(name, "step", "e2e", rel, metrics.sqnr_db(mine, ref),
                                         metrics.max_abs(mine, ref), v.passed, v.text, b.provenance,
                                         command(redo, name, b, v.limit), vs, v.error, v.limit))
    return result
