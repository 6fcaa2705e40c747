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

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.traces import metrics
from parity_tests import ladder, models
from parity_tests.budgets import Measured
from parity_tests.drift import Quantity
from parity_tests.results import LayerResult, Replay, attention_key

HEAD_CHUNK_BYTES = 1 << 30  # the eager Sol-Attn reference materialises scores: bound its memory per call


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    return metrics.cosine(x, ref)


def _run_dtype(backend, dtype: torch.dtype, device) -> torch.dtype:
    """The dtype the backend runs these operands in (`models.own_dtype`)."""
    name = next(k for k, v in models.DTYPES.items() if getattr(torch, v) == dtype)
    return getattr(torch, models.DTYPES[models.own_dtype(backend, name, str(device))])


def ran_backend(backend, stats: dict) -> str:
    """Which registered backend computed the last call of `backend` (a name or AttentionOptions; stats: the
    attention counts of that one call, `h3direct.counts`)."""
    from h3direct.dit.attention import as_options, slice_backend

    opts = as_options(backend)
    if opts.backend == "kj_head_sliced":
        return slice_backend(opts)
    backend = opts.backend
    for what in (stats.get(backend) or {}):
        if what.startswith("fallback to "):
            return what.removeprefix("fallback to ").split(":")[0]
    return backend


def exact_attention(q, k, v) -> torch.Tensor:
    """fp32 softmax attention, [B, H, S, D] -> [B, S, H·D]."""
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return rearrange(out, "b h s d -> b s (h d)")


def sol_algorithm(q, k, v, prefix_rows, options=None) -> torch.Tensor:
    """comfy-kitchen's eager Sol-Attn (the algorithm the kernel implements, in fp32) with the arguments the backend
    passes the kernel under `options` (SolOptions; default: its defaults); heads in chunks so that its dense score
    matrix stays under HEAD_CHUNK_BYTES."""
    from comfy_kitchen.backends.eager.sol_attn import sol_attn

    from h3direct.dit.sol_options import SolOptions

    # the algorithm's exact query rows are its own (sink_q), whichever backend computes them in the runtime
    kw = dataclasses.replace(options or SolOptions(), rows_backend="kernel").kernel_kwargs(prefix_rows)
    kw.pop("token_aug", None)  # the eager reference has no token routing stage
    b, h, s, d = q.shape
    per_head = b * s * s * 4
    step = max(1, HEAD_CHUNK_BYTES // max(per_head, 1))
    outs = []
    for i in range(0, h, step):
        qs, ks, vs = (x[:, i:i + step].transpose(1, 2).float() for x in (q, k, v))  # [B, S, h, D]
        outs.append(sol_attn(qs, ks, vs, **kw))
    return rearrange(torch.cat(outs, dim=2), "b s h d -> b s (h d)")


def attention_site(gate, site, backend, device) -> None:
    """backend: a name or AttentionOptions (the backend runs with those options, its reference too)."""
    from h3direct.counts import counting
    from h3direct.dit.attention import as_options, attention, sequence_hints
    from h3direct.dit.options import describe

    backend = as_options(backend)

    q, k, v, prefix = site.operands()
    dtype = _run_dtype(backend, q.dtype, device)
    qq, kk, vv = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    with counting() as calls, sequence_hints(prefix):  # this call's own counts (not the run's: not a model call)
        out = attention(qq, kk, vv, backend)[0].float()
    gate.site_calls.add(calls.as_dict())
    ran = ran_backend(backend, calls.as_dict().get("attention", {}))
    exact = exact_attention(qq, kk, vv)[0]
    vs_exact = metrics.rel_l2(out, exact)
    key = gate.key("kernel", "attention", attention=ran if ran != "exact" else "exact", compute="*", weights="*")
    from h3direct.dit.attention import is_exact

    if is_exact(ran):
        key["attention"] = "exact"
    b = gate.budgets.lookup(**key)
    info = f"{describe(backend)} ran {ran}" if ran != backend.backend else ""
    if b.rule == "rounding":
        m = Measured(vs_exact, produced=str(dtype).removeprefix("torch."))
        gate.result.layers.append(_row(gate, site.name, b, m, out, exact, info,
                                       roundings=gate.budgets.roundings("attention"), attention=backend,
                                       device=device))
        return
    if b.reference == "emulation":
        from h3direct.dit.fp8_attention import fp8_attention_reference

        fp8 = backend.fa3_fp8
        emu = fp8_attention_reference(qq, kk, vv, smooth_v=fp8.smooth_v, rotate=fp8.rotate)
        emu = rearrange(emu, "b h s d -> b s (h d)")[0].float()
        m = Measured(vs_exact, twin=(vs_exact, metrics.rel_l2(emu, exact)))
        ref = exact
    elif b.reference == "algorithm":
        ref = sol_algorithm(qq, kk, vv, prefix, backend.sol_attn)[0].to(out.device)
        m = Measured(metrics.rel_l2(out, ref), cos=cosine(out, ref))
        info = (info + "; " if info else "") + (f"vs exact {vs_exact:.3e}, the sparse algorithm itself vs exact "
                                                f"{metrics.rel_l2(ref, exact):.3e}")
    else:
        m = Measured(vs_exact, cos=cosine(out, exact))
        ref = exact
    gate.result.layers.append(_row(gate, site.name, b, m, out, ref, info, attention=backend, device=device))


def _row(gate, name, b, m: Measured, ours, ref, info: str, roundings: int | None = None, attention=None,
         device: str = "cpu"):
    from parity_tests.budgets import verdict

    v = verdict(b, m, roundings=roundings)
    replay = Replay(gate.case.trace, gate.comfy_root, attention=attention, device=str(device)).command(name, b, v.limit)
    return LayerResult(name, "kernel", "teacher", m.err, metrics.sqnr_db(ours, ref), metrics.max_abs(ours, ref),
                       v.passed, v.text, b.provenance, replay, m.twin, v.error, v.limit, "kernel", info)


def fp8_linear_names(model) -> set[str]:
    from h3direct.dit.linear import FP8Linear

    return {n for n, mod in model.named_modules() if isinstance(mod, FP8Linear)}


def dense_weight(module) -> torch.Tensor:
    """The exact weight of a block linear, fp32 [out, in]."""
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight(torch.float32)
    return module.weight.detach().float()


def gemm_rho(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """‖sqrt((X∘X)(W∘W)ᵀ)‖ / ‖Y‖: how large a product's rounding noise is against its result when every operand
    element carries an independent relative rounding error (`budgets.py`, the quantized-product rounding bound)."""
    noise = torch.sqrt((x.double() ** 2) @ (w.double() ** 2).T)
    den = float(torch.linalg.vector_norm(y.double()))
    return float(torch.linalg.vector_norm(noise)) / den if den else math.inf


def int8_rho(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """The expected relative error of an int8 W8A8 product (per-row scales s = amax / 127 on both operands) against
    its result Y: each code's rounding error is uniform on ±s/2 (variance s²/12), independent, so the product's
    noise has variance (s_x[m]²·‖w_n‖² + s_w[n]²·‖x_m‖²) / 12 at (m, n) (the products of two errors are far smaller).
    The steps are the rule's own (amax / 127 of each row, computed here), not the implementation's."""
    sx, sw = (t.double().abs().amax(dim=-1) / 127.0 for t in (x, w))
    x2, w2 = (x.double() ** 2).sum(-1), (w.double() ** 2).sum(-1)
    var = (sx[:, None] ** 2 * w2[None, :] + sw[None, :] ** 2 * x2[:, None]) / 12.0
    den = float(torch.linalg.vector_norm(y.double()))
    return math.sqrt(float(var.sum())) / den if den else math.inf


def fp8_linear_site(gate, site, model, fp8_model) -> None:
    from h3direct.dit.linear import W8A8_WEIGHTS_KEYS

    path = site.name.removesuffix(".out")
    x = site.args()[0]
    exact_mod, fp8_mod = model.get_submodule(path), fp8_model.get_submodule(path)
    ours = fp8_mod(x).float()
    w = dense_weight(exact_mod).to(x.device)
    bias = exact_mod.bias.detach().float() if exact_mod.bias is not None else None
    x2 = x.reshape(-1, x.shape[-1]).float()
    exact = F.linear(x2, w, bias).reshape(ours.shape)
    rho = int8_rho if fp8_mod.fmt == "int8" else gemm_rho
    m = Measured(metrics.rel_l2(ours, exact), gemm_rho=rho(x2, w, exact.reshape(x2.shape[0], -1)))
    b = gate.budgets.lookup(**gate.key("kernel", "linear", weights=W8A8_WEIGHTS_KEYS[fp8_mod.fmt], attention="*",
                                       compute="*"))
    gate.result.layers.append(_row(gate, site.name, b, m, ours, exact, ""))


CLASS_NAMESAKE = "sage2"  # the backend whose class rule a mode claiming ComfyUI+sage's class (--sage-class) is held to


def free_approximate(gate, dit, inputs, device, exact_backend, attention, fp8_linear: str, exact: dict) -> None:
    """One denoiser evaluation of the approximate mode (attention: a name or AttentionOptions; the FP8 block linears
    when fp8_linear is on), traced, beside the exact run's tensors `exact`: the class rule and the ladder against
    ComfyUI's recordings (`ladder.py`), x0 against the exact path (reported), and the mode's measured quality for
    its baseline (`result.measured`, `drift.py`)."""
    from h3direct.dit.attention import as_options
    from h3direct.dit.options import describe
    from h3direct.dit.tracing import Tracer
    from h3direct.traces.evaluate import one_step

    case, result = gate.case, gate.result
    compute = models.compute_name(dit)
    approx_compute = models.own_dtype(attention, compute, device)
    exact_model = dit
    if approx_compute != compute:  # a bf16-only approximate backend on an fp32 case: the exact path in bf16 too
        exact_model = models.model(str(case.checkpoint), approx_compute, models.nvfp4_mode(case), device)
        with Tracer(exact_model) as t:
            out = one_step(exact_model, inputs, backend=exact_backend, device=device)
        exact = {**t.tensors, **out}
    approx_model = exact_model if fp8_linear == "off" else models.model(
        str(case.checkpoint), approx_compute, models.nvfp4_mode(case), device, fp8_linear)
    with Tracer(approx_model) as t:
        out = one_step(approx_model, inputs, backend=attention, device=device)
    ours = {**t.tensors, **out}
    gate.refs = refs = ladder.references(case)
    points, exact_points = ladder.measure(ours, refs), ladder.measure(exact, refs)
    low_run = approx_compute != "fp32"  # the drift rule's scale: ComfyUI's own rounding where the mode rounds alike

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
        twin = refs.fp32.path if refs.fp32 is not None and refs.fp32.path != case.trace else None
        replay = Replay(case.trace, gate.comfy_root, "free", attention, str(device),
                        approx_compute if approx_compute != case.compute else None, fp8_linear, twin, refs.sage.path)
        ladder.class_rows(gate, points, ours, b, replay)

    for name in ladder.LADDER:
        p = points.get(name)
        if p is not None and refs.usable:
            result.measured[f"out.{name}"] = Quantity(p.err, p.comfy if low_run else 0.0, 1)
    for stream in ("video", "audio"):
        name = f"sample_out.{stream}"
        a, e = ours[name].float().cpu(), exact[name].float().cpu()
        rel = metrics.rel_l2(a, e)
        r = points[name].comfy if low_run and name in points and refs.usable else 0.0
        result.measured[f"x0.{stream}"] = Quantity(rel, r, 2)
        result.layers.append(LayerResult(
            f"quality.x0.{stream}", "x0", "free", rel, metrics.sqnr_db(a, e), metrics.max_abs(a, e), True,
            "reported; held to the mode's baseline (drift rule)", "",
            f"approximate vs exact path ({approx_compute}, {exact_backend})", None, rel, math.inf, "quality",
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

