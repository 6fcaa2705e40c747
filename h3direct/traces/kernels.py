"""An approximate kernel at one recorded site, on the site's recorded operands, against exact arithmetic: what the
gate's kernel rows judge (`parity_tests/kernels.py`) and what `oracle replay --mode kernel` re-runs for them.

- attention (`attention_call`, then `measure_attention`): the backend on the recorded q/k/v, in the dtype it runs
  them in, with the sequence hint the model gives it, against exact fp32 softmax attention on the same operands, or
  against the reference implementation its contract names: `emulation` (fa3_fp8: h3direct's torch emulation of the
  same FP8 scaling, whose own error against exact attention scales the limit) or `algorithm` (sol_attn:
  comfy-kitchen's eager Sol-Attn with the same routing arguments; budget_attn: its own selection on the operands and
  its kernel's eager reference);
- 8-bit linears (`measure_linear`): the W8A8 product on the recorded input against the exact fp32 product with the
  checkpoint's weights, with rho, the size of the product's expected rounding noise for operands of its format.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.traces import metrics

HEAD_CHUNK_BYTES = 1 << 30  # the eager Sol-Attn reference materialises scores: bound its memory per call


def own_dtype(backend, dtype: torch.dtype, device) -> torch.dtype:
    """The dtype a backend (name or AttentionOptions) itself runs `dtype` operands in: that one, else bf16 for a
    backend that runs only in bf16/fp16."""
    from h3direct.dit.attention import unavailable_reason

    def runs(dt):
        return unavailable_reason(backend, torch.empty(0, device=device, dtype=dt)) is None

    return dtype if runs(dtype) or not runs(torch.bfloat16) else torch.bfloat16


def ran_backend(backend, stats: dict) -> str:
    """Which registered backend computed the last call of `backend` (a name or AttentionOptions; stats: the
    attention counts of that one call, `h3direct.counts`)."""
    from h3direct.dit.attention import as_options, slice_backend

    opts = as_options(backend)
    if opts.backend == "kj_head_sliced":
        return slice_backend(opts)
    for what in (stats.get(opts.backend) or {}):
        if what.startswith("fallback to "):
            return what.removeprefix("fallback to ").split(":")[0]
    return opts.backend


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


@dataclass(frozen=True)
class AttentionCall:
    """One call of an attention backend at a site: its operands as it ran them, its output and exact attention's,
    both [S, H·D] fp32 (batch 0), which backend computed it and the call's counts."""

    operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    prefix: int | None
    out: torch.Tensor
    exact: torch.Tensor
    ran: str
    dtype: torch.dtype
    calls: dict

    @property
    def vs_exact(self) -> float:
        return metrics.rel_l2(self.out, self.exact)


@dataclass(frozen=True)
class KernelMeasure:
    """A kernel's output against what its row compares it with (`ref`): rel-L2 and cosine; for a contract held
    against a reference implementation, (the kernel's, the reference implementation's) error against the exact
    result (`errs`); rho of a quantized product."""

    ours: torch.Tensor
    ref: torch.Tensor
    err: float
    cos: float
    errs: tuple[float, float] | None = None
    rho: float | None = None
    info: str = ""


def attention_call(site, backend, device) -> AttentionCall:
    """`backend` (a name or AttentionOptions) on the site's recorded operands (`Site.operands`)."""
    from h3direct.counts import counting
    from h3direct.dit.attention import as_options, attention, sequence_hints

    backend = as_options(backend)
    q, k, v, prefix = site.operands()
    dtype = own_dtype(backend, q.dtype, device)
    qq, kk, vv = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    with counting() as counted, sequence_hints(prefix):  # this call's own counts (not a model call's)
        out = attention(qq, kk, vv, backend)[0].float()
    calls = counted.as_dict()
    return AttentionCall((qq, kk, vv), prefix, out, exact_attention(qq, kk, vv)[0], ran_backend(
        backend, calls.get("attention", {})), dtype, calls)


def measure_attention(call: AttentionCall, reference: str, options=None) -> KernelMeasure:
    """The call against `reference`: exact (exact fp32 attention), emulation (exact, with the FP8 emulation's own
    error beside the kernel's) or algorithm (the sparse algorithm the backend implements, `algorithm`)."""
    from h3direct.dit.attention import as_options

    out, exact = call.out, call.exact
    if reference == "emulation":
        from h3direct.dit.fp8_attention import fp8_attention_reference

        fp8 = as_options(options or "fa3_fp8").fa3_fp8
        emu = fp8_attention_reference(*call.operands, smooth_v=fp8.smooth_v, rotate=fp8.rotate)
        emu = rearrange(emu, "b h s d -> b s (h d)")[0].float()
        return KernelMeasure(out, exact, call.vs_exact, metrics.cosine(out, exact),
                             errs=(call.vs_exact, metrics.rel_l2(emu, exact)))
    if reference == "algorithm":
        ref, what = algorithm(call, as_options(options or call.ran))
        info = (f"vs exact {call.vs_exact:.3e}, the sparse algorithm itself vs exact "
                f"{metrics.rel_l2(ref, exact):.3e}{what}")
        return KernelMeasure(out, ref, metrics.rel_l2(out, ref), metrics.cosine(out, ref), info=info)
    if reference != "exact":
        raise ValueError(f"unknown kernel reference {reference!r}")
    return KernelMeasure(out, exact, call.vs_exact, metrics.cosine(out, exact))


def algorithm(call: AttentionCall, options) -> tuple[torch.Tensor, str]:
    """The sparse algorithm the call's backend implements, in fp32 on the same operands ([S, H·D], batch 0), and
    what else it says: comfy-kitchen's eager Sol-Attn for sol_attn; for budget_attn its own selection on these
    operands and the eager reference of its kernel (`block_sparse_reference`), with the kept blocks' share."""
    if call.ran == "budget_attn":
        from h3direct.dit.block_sparse_triton import block_sparse_reference
        from h3direct.dit.budget_attention import select

        q, k, v = call.operands
        keep = select(q, k, call.prefix, options.budget_attn).keep
        out = block_sparse_reference(q.float(), k.float(), v.float(), keep, tail=options.budget_attn.tail)[0]
        ref = rearrange(out, "b h s d -> b s (h d)")[0].float().to(call.out.device)
        cpu = "" if call.out.is_cuda else " (on the CPU the backend runs this reference: nothing is held here)"
        return ref, f"; {float(keep.float().mean()):.3f} of the key blocks kept{cpu}"
    if call.ran != "sol_attn":
        raise ValueError(f"the algorithm reference is sol_attn's or budget_attn's; this call ran {call.ran!r}")
    return sol_algorithm(*call.operands, call.prefix, options.sol_attn)[0].to(call.out.device), ""


def dense_weight(module) -> torch.Tensor:
    """The exact weight of a block linear, fp32 [out, in]."""
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight(torch.float32)
    return module.weight.detach().float()


def gemm_rho(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """‖sqrt((X∘X)(W∘W)ᵀ)‖ / ‖Y‖: how large a product's rounding noise is against its result when every operand
    element carries an independent relative rounding error (the quantized-product rounding bound)."""
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


def measure_linear(site, exact_module, quantized_module) -> KernelMeasure:
    """The 8-bit module's product on the site's recorded input against the exact fp32 product with the checkpoint's
    weights; rho: `int8_rho` for an int8 module, else `gemm_rho`."""
    x = site.args()[0]
    ours = quantized_module(x).float()
    w = dense_weight(exact_module).to(x.device)
    bias = exact_module.bias.detach().float() if exact_module.bias is not None else None
    x2 = x.reshape(-1, x.shape[-1]).float()
    exact = F.linear(x2, w, bias).reshape(ours.shape)
    rho = int8_rho if quantized_module.fmt == "int8" else gemm_rho
    return KernelMeasure(ours, exact, metrics.rel_l2(ours, exact), metrics.cosine(ours, exact),
                         rho=rho(x2, w, exact.reshape(x2.shape[0], -1)))
