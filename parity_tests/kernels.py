"""Parts (b) and (c) of an approximate mode's gate (`gate.py`): its kernels against exact arithmetic on the recorded
operands, and its outputs against h3direct's own exact path.

- attention sites: the backend on the recorded q/k/v (the dtype it runs in, the sequence hint the model gives it)
  against exact fp32 softmax attention on the same operands; the contract of the backend that actually ran (sol_attn's
  documented fallback for short calls, kj_head_sliced's inner backend) applies, with the reference implementation
  it names (`emulation`: fa3_fp8's torch emulation of the same FP8 scaling; `algorithm`: comfy-kitchen's eager
  Sol-Attn with the same routing arguments). An exact backend that ran instead is held to the attention rounding bound.
- FP8 linear sites: the e4m3 W8A8 product on the recorded input against the exact fp32 product with the checkpoint's
  weights, under the statistical e4m3 rounding bound (`budgets.py`).
- quality: x0 of one denoiser evaluation, approximate vs exact path, video and audio.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.traces import metrics
from parity_tests.budgets import Measured

HEAD_CHUNK_BYTES = 1 << 30  # the eager Sol-Attn reference materialises scores: bound its memory per call


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    return metrics.cosine(x, ref)


def _run_dtype(backend, dtype: torch.dtype, device) -> torch.dtype:
    """The dtype the backend runs these operands in (`gate.own_dtype`)."""
    from parity_tests.gate import DTYPES, own_dtype

    name = next(k for k, v in DTYPES.items() if getattr(torch, v) == dtype)
    return getattr(torch, DTYPES[own_dtype(backend, name, str(device))])


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

        emu = rearrange(fp8_attention_reference(qq, kk, vv), "b h s d -> b s (h d)")[0].float()
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
    from parity_tests.gate import LayerResult, replay_command, rule_flags

    v = verdict(b, m, roundings=roundings)
    replay = replay_command(gate.case.trace, name, gate.comfy_root, rule_flags(b, v.limit, attention, str(device)))
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


def fp8_linear_site(gate, site, model, fp8_model) -> None:
    path = site.name.removesuffix(".out")
    x = site.args()[0]
    exact_mod, fp8_mod = model.get_submodule(path), fp8_model.get_submodule(path)
    ours = fp8_mod(x).float()
    w = dense_weight(exact_mod).to(x.device)
    bias = exact_mod.bias.detach().float() if exact_mod.bias is not None else None
    x2 = x.reshape(-1, x.shape[-1]).float()
    exact = F.linear(x2, w, bias).reshape(ours.shape)
    m = Measured(metrics.rel_l2(ours, exact), gemm_rho=gemm_rho(x2, w, exact.reshape(x2.shape[0], -1)))
    b = gate.budgets.lookup(**gate.key("kernel", "linear", weights="fp8_w8a8", attention="*", compute="*"))
    gate.result.layers.append(_row(gate, site.name, b, m, ours, exact, ""))


def quality_x0(gate, model, inputs, device, exact_backend, attention, fp8_linear: str, exact_out) -> None:
    """x0 of the approximate mode against the exact path's, same inputs, device and dtype (part c); attention: a
    name or AttentionOptions."""
    from h3direct.dit.linear import FP8_WEIGHTS_KEY
    from h3direct.traces.evaluate import one_step
    from parity_tests.budgets import verdict
    from parity_tests.gate import DTYPES, LayerResult, _model, _nvfp4_mode, attention_key, own_dtype

    case = gate.case
    compute = {v: k for k, v in DTYPES.items()}[str(model.compute_dtype).removeprefix("torch.")]
    approx_compute = own_dtype(attention, compute, device)
    if approx_compute != compute:  # a bf16-only approximate backend on an fp32 case: the exact path in bf16 too
        model = _model(str(case.checkpoint), approx_compute, _nvfp4_mode(case), device)
        exact_out = one_step(model, inputs, backend=exact_backend, device=device)
    approx_model = model if fp8_linear == "off" else _model(str(case.checkpoint), approx_compute, _nvfp4_mode(case),
                                                            device, fp8_linear)
    ours = one_step(approx_model, inputs, backend=attention, device=device)
    weights = FP8_WEIGHTS_KEY if fp8_linear != "off" else case.weights
    b = gate.budgets.lookup(**gate.key("quality", "x0", compute="*", weights=weights,
                                       attention=attention_key(attention)))
    for stream in ("video", "audio"):
        a, e = ours[f"sample_out.{stream}"].float(), exact_out[f"sample_out.{stream}"].float()
        m = Measured(metrics.rel_l2(a, e))
        v = verdict(b, m)
        name = f"quality.x0.{stream}"
        gate.result.layers.append(LayerResult(name, "x0", "free", m.err, metrics.sqnr_db(a, e),
                                              metrics.max_abs(a, e), v.passed, v.text, b.provenance,
                                              f"approximate vs exact path ({approx_compute}, {exact_backend})",
                                              None, v.error, v.limit, "quality"))
