"""Parts (b) and (c) of an approximate mode's gate (`gate.py`): its kernels against exact arithmetic on the recorded
operands, and its outputs against h3direct's own exact path.

- attention sites: the backend on the recorded q/k/v (the dtype it runs in, the sequence hint the model gives it)
  against exact fp32 softmax attention on the same operands; the contract of the backend that actually ran (sol_attn's
  documented fallback for short calls, kj_head_sliced's inner backend) applies, with the reference implementation
  it names (`emulation`: fa3_fp8's torch emulation of the same FP8 scaling; `algorithm`: comfy-kitchen's eager
  Sol-Attn with the same routing arguments). An exact backend that ran instead is held to the attention rounding bound.
- FP8 linear sites: the e4m3 W8A8 product on the recorded input against the exact fp32 product with the checkpoint's
  weights, under the statistical e4m3 rounding bound (`budgets.py`).
- free-running (`free_approximate`): one denoiser evaluation of the approximate mode, traced; every recorded tensor
  against ComfyUI's fp32 twin (the ladder and the class rule, `ladder.py`), x0 against h3direct's exact path, and
  what the mode measured for its baseline (`drift.py`).
"""

from __future__ import annotations

import dataclasses
import math

from h3direct.traces import kernels as K
from h3direct.traces import metrics
from parity_tests import ladder, models
from parity_tests.budgets import Measured
from parity_tests.results import LayerResult, attention_key


def attention_site(gate, site, backend, device) -> None:
    """backend: a name or AttentionOptions (the backend runs with those options, its reference too)."""
    from h3direct.dit.attention import as_options, is_exact
    from h3direct.dit.options import describe

    backend = as_options(backend)
    call = K.attention_call(site, backend, device)
    gate.site_calls.add(call.calls)
    ran = call.ran
    key = gate.key("kernel", "attention", attention="exact" if is_exact(ran) else ran, compute="*", weights="*")
    b = gate.budgets.lookup(**key)
    info = f"{describe(backend)} ran {ran}" if ran != backend.backend else ""
    request = gate.request("kernel", options=backend, device=str(device))
    if b.rule == "rounding":  # an exact backend that ran instead, or a kernel held to its own algorithm's arithmetic
        km = K.measure_attention(call, b.reference or "exact", backend)
        m = Measured(km.err, produced=str(call.dtype).removeprefix("torch."))
        info = "; ".join(x for x in (info, km.info) if x)
        gate.result.layers.append(_row(gate, site.name, b, m, km.ours, km.ref, info,
                                       request.at(site.name, reference=b.reference or "exact"),
                                       roundings=gate.budgets.roundings("attention")))
        return
    reference = b.reference or "exact"
    km = K.measure_attention(call, reference, backend)
    if reference == "emulation":
        m = Measured(km.err, twin=km.errs)
    else:
        m = Measured(km.err, cos=km.cos)
    info = "; ".join(x for x in (info, km.info) if x)
    gate.result.layers.append(_row(gate, site.name, b, m, km.ours, km.ref, info,
                                   request.at(site.name, reference=reference)))


def _row(gate, name, b, m: Measured, ours, ref, info: str, request, roundings: int | None = None):
    from parity_tests.budgets import verdict
    from parity_tests.results import command

    v = verdict(b, m, roundings=roundings)
    return LayerResult(name, "kernel", "teacher", m.err, metrics.sqnr_db(ours, ref), metrics.max_abs(ours, ref),
                       v.passed, v.text, b.provenance, command(request, name, b, v.limit), m.twin, v.error, v.limit,
                       "kernel", info)


def fp8_linear_names(model) -> set[str]:
    from h3direct.dit.linear import FP8Linear

    return {n for n, mod in model.named_modules() if isinstance(mod, FP8Linear)}


def fp8_linear_site(gate, site, model, fp8_model, fp8_linear: str) -> None:
    from h3direct.dit.linear import W8A8_WEIGHTS_KEYS

    path = site.name.removesuffix(".out")
    fp8_mod = fp8_model.get_submodule(path)
    km = K.measure_linear(site, model.get_submodule(path), fp8_mod)
    m = Measured(km.err, gemm_rho=km.rho)
    b = gate.budgets.lookup(**gate.key("kernel", "linear", weights=W8A8_WEIGHTS_KEYS[fp8_mod.fmt], attention="*",
                                       compute="*"))
    request = gate.request("kernel", fp8_linear=fp8_linear)
    gate.result.layers.append(_row(gate, site.name, b, m, km.ours, km.ref, "", request))


CLASS_NAMESAKE = "sage2"  # the backend whose class rule a mode claiming ComfyUI+sage's class (--sage-class) is held to


def free_approximate(gate, dit, inputs, device, exact_backend, attention, fp8_linear: str, exact: dict) -> None:
    """One denoiser evaluation of the approximate mode (attention: a name or AttentionOptions; the FP8 block linears
    when fp8_linear is on), traced, beside the exact run's tensors `exact`: the class rule and the ladder against
    ComfyUI's recordings (`ladder.py`), x0 against the exact path (reported), and the mode's measured quality for
    its baseline (`result.measured`, `drift.py`)."""
    from h3direct.dit.attention import as_options
    from h3direct.dit.options import describe
    from h3direct.traces.evaluate import traced_step
    from h3direct.traces.quality import quantities

    case, result = gate.case, gate.result
    compute = models.compute_name(dit)
    approx_compute = models.own_dtype(attention, compute, device)
    exact_model = dit
    if approx_compute != compute:  # a bf16-only approximate backend on an fp32 case: the exact path in bf16 too
        exact_model = models.model(str(case.checkpoint), approx_compute, models.nvfp4_mode(case), device)
        exact = traced_step(exact_model, inputs, backend=exact_backend, device=device)
    approx_model = exact_model if fp8_linear == "off" else models.model(
        str(case.checkpoint), approx_compute, models.nvfp4_mode(case), device, fp8_linear)
    ours = traced_step(approx_model, inputs, backend=attention, device=device)
    gate.refs = refs = ladder.references(case)
    points, exact_points = ladder.measure(ours, refs), ladder.measure(exact, refs)
    low_run = approx_compute != "fp32"  # the drift rule's scale: ComfyUI's own rounding where the mode rounds alike
    # the replay of this run's free rows: the mode's options, its dtype, ComfyUI's other recording of the case
    other = refs.low if case.compute == "fp32" else refs.fp32
    request = gate.request("free", options=attention, fp8_linear=fp8_linear,
                           compute=approx_compute if approx_compute != case.compute else None,
                           twin=other.path if other is not None else None)

    key = attention_key(attention)
    claimed = gate.sage_class
    b = (gate.budgets.find(mode="class", kind="output", compute=approx_compute, weights=case.weights,
                           attention=CLASS_NAMESAKE if claimed else key, twin="yes")
         if claimed or (key != "exact" and fp8_linear == "off") else None)
    if b is not None and refs.sage is None:
        result.notes.append(f"class reference missing: no ComfyUI --use-sage-attention recording of this case "
                            f"(`python -m oracle record --sage-twin`), so {result.approx} is held to its own "
                            f"baseline only")
    elif b is not None:
        ladder.class_rows(gate, points, ours, b, dataclasses.replace(request, against=refs.sage.path))

    result.measured.update(quantities(ours, exact, refs.fp32, refs.low, low_run))
    result.drift_request = dataclasses.replace(request, mode="drift")
    for stream in ("video", "audio"):
        name = f"sample_out.{stream}"
        a, e = ours[name].float().cpu(), exact[name].float().cpu()
        rel = result.measured[f"x0.{stream}"].err
        result.layers.append(LayerResult(
            f"quality.x0.{stream}", "x0", "free", rel, metrics.sqnr_db(a, e), metrics.max_abs(a, e), True,
            "reported; held to the mode's baseline (drift rule)", "",
            f"not a rule's row: its drift row replays it (approximate vs exact path, {approx_compute}, "
            f"{describe(as_options(exact_backend))})", None, rel, math.inf, "quality",
            f"SQNR {metrics.sqnr_db(a, e):.1f} dB"))
    if refs.usable:
        class_margin = [r.limit / r.error for r in result.layers if r.part == "class" and r.error > 0
                        and math.isfinite(r.limit)]
        result.ladder = {"comfy": {n: points[n].comfy for n in ladder.LADDER if n in points},
                         "rows": ladder.reference_rows(points, refs.low_dtype) + [
                             ladder.row(f"h3direct exact ({describe(as_options(exact_backend))}, {approx_compute})",
                                        exact_points),
                             ladder.row(result.approx, points, this=True, rule=min(class_margin, default=None))]}
    else:
        result.notes.append("no ladder: the case lacks ComfyUI's fp32 trace or its low-precision one")
