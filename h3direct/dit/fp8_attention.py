"""FP8 (e4m3) attention on FlashAttention-3's FP8 forward, with per-(batch, head) scales, smoothing and a rotation.

The `fa3_fp8` backend (h3direct/dit/attention.py) quantizes q, k, v to e4m3 and calls FA3's FP8 kernel, which takes
one fp32 descale per (batch, kv head) for each of q, k, v (`q_descale` etc., shape [B, H_k]) and folds
q_descale·k_descale into the softmax scale and v_descale into the output. Four things keep the error small:

- per-(batch, head) scales: scale = amax / 448 of that head (448 = e4m3's largest finite value), so a head with
  large values does not flatten the others (with one scale per tensor the heads of small values lose most of their
  precision);
- K smoothing: k' = k − mean over tokens of k (per head and channel). For every query, q·k' = q·k − q·mean, a
  constant along the softmax row, so the attention weights are unchanged while the common channel offset of the keys
  (which would take e4m3's range) is removed before quantizing;
- V smoothing: v' = v − mean over tokens of v; every softmax row sums to one, so attn(v') + mean = attn(v). The mean
  is added back to FA3's bf16 output (option `fp8_attn_smooth_v` off turns it off);
- a rotation of q and k (option `fp8_attn_rotate`): both are multiplied by the same orthogonal matrix
  R = diag(signs)·Hadamard/√b (Sylvester Hadamard blocks of size b, fixed random signs), so q·k is unchanged.
  e4m3 rounds each element with a relative error up to 2⁻⁴, so the error a key's rounding puts on its score is
  Σ_c q_c·k_c·ε_c: large where the channels that carry most of q's energy also carry k's, as a trained network's q
  and k do (their channel variances correlate); R spreads every channel over all b, which removes that alignment.
  This is FlashAttention-3's "incoherent processing" (Shah et al., 2024, §3.3 and Table 3: FP8 attention's error on
  inputs with outlier channels 2.6× lower with it and block scales). What it does on the validation set:
  benchmarks/results/LOG.md, "fa3_fp8 rotated".

Quantization of one tensor is two passes: per-channel sum, min and max over tokens (torch reductions, which read the
strided q/k views of the qkv projection in place), then one Triton pass that rotates (a ±1 matrix product on the
tensor cores, exact products in the input's bf16 summed in fp32), subtracts the mean, scales, rounds to e4m3
(nearest, ties to even) and writes FA3's [B, S, H, D] layout. Without CUDA or Triton the same math runs in torch
(`quantize_torch`), which is also what `fp8_attention_reference` (the numerical emulation of the whole backend,
fp32 attention with FA3's FP8 probability rounding) uses.

The head's scale needs no second reduction:
- unrotated, rounding is monotone, so max_t fl(x_t − m) = fl(max_t x_t − m) and the head's amax is
  max_c max(fl(max_c − m_c), fl(m_c − min_c));
- rotated, an element of (x − m)·diag(signs)·H is a ±1 sum over one block of b channels, so its magnitude is at most
  the sum of those channels' amax: the scale is set by that bound (never an overflow; where the bound is loose the
  values sit lower in e4m3's range, whose relative precision is the same down to 2⁻⁶ of the scale).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from h3direct.checkpoint.quant import hadamard
from h3direct.triton_build import FP_OPTIONS

try:  # Triton is optional (CUDA wheels of torch ship it; the test extra installs it for TRITON_INTERPRET=1 tests)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - environments without Triton
    triton = None

E4M3_MAX = 448.0
# FA3's FP8 forward evaluates the probabilities as exp2(score − row max + 8) before rounding them to e4m3 for the
# PV product (they lie in [0, 256] instead of [0, 1], away from e4m3's subnormals); the emulation does the same
P_OFFSET_LOG2 = 8.0
# head dims FA3's FP8 kernels take: a multiple of 16 (16-byte rows of e4m3), at most 256
FP8_HEAD_DIM_ALIGN = 16
FP8_MAX_HEAD_DIM = 256


@dataclass
class Quantized:
    """One tensor in e4m3: `data` [B, S, H, D] (contiguous), `descale` [B, H] fp32, `mean` [B, H, D] fp32 or None
    (the per-channel token mean subtracted before scaling), `rotation` [D, D] fp32 or None (the orthogonal R the
    data is in: data · descale ≈ (x − mean)·R)."""

    data: torch.Tensor
    descale: torch.Tensor
    mean: torch.Tensor | None
    rotation: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """[B, H, S, D] fp32: data · descale (· Rᵀ) (+ mean)."""
        x = self.data.transpose(1, 2).float() * self.descale[:, :, None, None]
        if self.rotation is not None:
            x = x @ self.rotation.to(x.device).T
        return x if self.mean is None else x + self.mean[:, :, None, :]


def rotation(d: int, device=None, normalized: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[d, d] in `dtype`: diag(signs)·blockdiag(H_b, …) (entries ±1, or 0 off the blocks), divided by √b when
    `normalized` (then orthogonal: R·Rᵀ = I, to `dtype`'s rounding of 1/√b). Made once per device (a copy to the
    GPU inside the DiT step would wait for the stream); read-only."""
    return _rotation(d, torch.device(device) if device is not None else torch.device("cpu"), normalized, dtype)


@functools.cache
def _rotation(d: int, device: torch.device, normalized: bool, dtype: torch.dtype) -> torch.Tensor:
    signs, h = hadamard.signed_hadamard(d)
    b = h.shape[0]
    r = (signs[:, None] * torch.block_diag(*[h] * (d // b))).double()
    return (r / math.sqrt(b) if normalized else r).to(device=device, dtype=dtype)


def channel_stats(x: torch.Tensor, center: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """x [B, H, S, D] -> (per-channel token mean [B, H, D] fp32 if `center`, else None; per-channel amax [B, H, D]
    fp32 of x − mean), from per-channel max and min (see the module docstring)."""
    lo, hi = torch.aminmax(x, dim=2)  # exact in x's dtype
    hi, lo = hi.float(), lo.float()
    if not center:
        return None, torch.maximum(hi.abs(), lo.abs())
    mean = x.sum(dim=2, dtype=torch.float32) / x.shape[2]
    return mean, torch.maximum(hi - mean, mean - lo)


def head_amax(channel_amax: torch.Tensor, rotate: bool) -> torch.Tensor:
    """[B, H, D] per-channel amax -> [B, H]: the largest |element| of the head, or with `rotate` the bound on the
    largest |element| of its ±1 rotation (the largest sum of channel amax over one Hadamard block)."""
    if not rotate:
        return channel_amax.amax(dim=-1)
    b = hadamard.block(channel_amax.shape[-1])
    return channel_amax.unflatten(-1, (-1, b)).sum(dim=-1).amax(dim=-1)


def scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax [B, H] -> (descale = amax / 448, inverse = 448 / amax); an all-zero head gets 1 and 1."""
    nonzero = amax > 0
    one = torch.ones_like(amax)
    descale = torch.where(nonzero, amax / E4M3_MAX, one)
    inverse = torch.where(nonzero, E4M3_MAX / torch.where(nonzero, amax, one), one)
    return descale.contiguous(), inverse.contiguous()


def quantize_torch(x: torch.Tensor, mean: torch.Tensor | None, inverse: torch.Tensor,
                   rotate: bool = False) -> torch.Tensor:
    """The quantizer's math in torch: e4m3(clamp((x·P − mean) · inverse, ±448)) as [B, S, H, D] contiguous, where
    P = `rotation(D, normalized=False)` with `rotate` (else the identity; `mean` is then the rotated mean, mean·P)."""
    y = x.float()
    if rotate:
        y = y @ rotation(x.shape[-1], y.device, normalized=False)
    if mean is not None:
        y = y - mean[:, :, None, :]
    y = (y * inverse[:, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).transpose(1, 2).contiguous()


if triton is not None:
    @triton.jit
    def _round_e4m3(y):
        # round |y| <= 448 to the nearest e4m3 value (ties to even) in fp32 arithmetic, so that the final cast is
        # exact whatever rounding the target's conversion uses (Triton's CPU interpreter truncates)
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        sub = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # below 2^-6: multiples of 2^-9
        r = tl.where(a >= 0.015625, normal, sub)
        # y's sign bit onto r by an integer OR, so that -0.0 stays -0.0 (as torch casts it) whatever the target
        # makes of a float negation
        sign = y.to(tl.int32, bitcast=True) & -2147483648
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_kernel(x_ptr, mean_ptr, inv_ptr, out_ptr, S, H, D, sxb, sxh, sxs, HAS_MEAN: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < S) & (cols[None, :] < D)
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32)
        if HAS_MEAN:
            m = tl.load(mean_ptr + bh * D + cols, mask=cols < D, other=0.0)
            y = y - m[None, :]
        y = y * tl.load(inv_ptr + bh)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        q = _round_e4m3(y).to(tl.float8e4nv)
        tl.store(out_ptr + ((b * S + rows[:, None]) * H + h) * D + cols[None, :], q, mask=mask)

    @triton.jit
    def _quantize_rotated_kernel(x_ptr, sign_ptr, had_ptr, mean_ptr, inv_ptr, out_ptr, S, H, sxb, sxh, sxs,
                                 D: tl.constexpr, RB: tl.constexpr, HAS_MEAN: tl.constexpr, IEEE: tl.constexpr,
                                 BLOCK_S: tl.constexpr, TILES: tl.constexpr):
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kk = tl.arange(0, RB)
        had = tl.load(had_ptr + kk[:, None] * RB + kk[None, :])  # the ±1 Hadamard block, fp32: loaded once
        inv = tl.load(inv_ptr + bh)
        for t in tl.static_range(TILES):  # TILES row tiles per program share the loaded block
            rows = (tl.program_id(0) * TILES + t) * BLOCK_S + tl.arange(0, BLOCK_S)
            inside = rows[:, None] < S
            for j in tl.static_range(D // RB):
                cols = j * RB + kk
                x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :], mask=inside, other=0.0)
                x = x.to(tl.float32) * tl.load(sign_ptr + cols)[None, :]  # a sign flip: exact
                if IEEE:
                    y = tl.dot(x, had, input_precision="ieee")
                else:  # bf16 / fp16 values are exact in tf32 (one factor is ±1): exact products, fp32 sums
                    y = tl.dot(x, had, input_precision="tf32")
                if HAS_MEAN:
                    y = y - tl.load(mean_ptr + bh * D + cols)[None, :]
                y = tl.minimum(tl.maximum(y * inv, -448.0), 448.0)
                q = _round_e4m3(y).to(tl.float8e4nv)
                tl.store(out_ptr + ((b * S + rows[:, None]) * H + h) * D + cols[None, :], q, mask=inside)


# the rotated quantizer's launch (rows per tile, tiles per program, warps), tuned on the H200 at the workload's
# shape (LOG.md, "fa3_fp8 rotated")
ROTATED_LAUNCH = {"block_s": 128, "tiles": 2, "num_warps": 4}


def quantize_triton(x: torch.Tensor, mean: torch.Tensor | None, inverse: torch.Tensor,
                    rotate: bool = False) -> torch.Tensor:
    """`quantize_torch` in one Triton pass: reads x [B, H, S, D] (any strides, unit channel stride) and writes e4m3
    [B, S, H, D] contiguous. Unrotated it is bitwise equal; rotated, its sums run in another order, so an element
    may round to the neighbouring e4m3 value where x·P lies within fp32 rounding of a tie."""
    if triton is None:
        raise RuntimeError("Triton is not importable")
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, s, d = x.shape
    out = torch.empty(b, s, h, d, dtype=torch.float8_e4m3fn, device=x.device)
    mean_arg = mean.contiguous() if mean is not None else inverse  # a dummy pointer when there is no mean
    if rotate:
        signs, had = hadamard.operands(d, x.device, torch.float32)  # the kernel's: fp32 on x's device
        rb = had.shape[0]
        block_s, tiles = ROTATED_LAUNCH["block_s"], ROTATED_LAUNCH["tiles"]
        _quantize_rotated_kernel[(triton.cdiv(s, block_s * tiles), b * h)](
            x, signs, had, mean_arg, inverse.contiguous(), out, s, h,
            x.stride(0), x.stride(1), x.stride(2), D=d, RB=rb, HAS_MEAN=mean is not None,
            IEEE=x.dtype not in (torch.bfloat16, torch.float16), BLOCK_S=block_s, TILES=tiles,
            num_warps=ROTATED_LAUNCH["num_warps"], **FP_OPTIONS)
        return out
    block_d = triton.next_power_of_2(d)
    block_s = max(1, min(64, 8192 // block_d))
    _quantize_kernel[(triton.cdiv(s, block_s), b * h)](
        x, mean_arg, inverse.contiguous(), out, s, h, d, x.stride(0), x.stride(1), x.stride(2),
        HAS_MEAN=mean is not None, BLOCK_S=block_s, BLOCK_D=block_d, **FP_OPTIONS)
    return out


def quantize(x: torch.Tensor, center: bool, per_head: bool = True, kernel: bool | None = None,
             rotate: bool = False) -> Quantized:
    """x [B, H, S, D] -> `Quantized`. `center`: subtract the per-channel token mean first (smoothing). `per_head`:
    one scale per (batch, head) (False: one for the whole tensor, the coarse variant, for comparison). `rotate`:
    quantize (x − mean)·R (module docstring). `kernel`: the Triton pass (default: when x is on CUDA and Triton is
    importable), else torch."""
    mean, channel_amax = channel_stats(x, center)
    amax = head_amax(channel_amax, rotate)
    if not per_head:
        amax = amax.amax().expand_as(amax)
    descale, inverse = scales(amax)
    shift, r = mean, None
    if rotate:  # the data hold (x − mean)·P with P = √b·R: the descale takes the 1/√b
        d = x.shape[-1]
        descale = descale / math.sqrt(hadamard.block(d))
        r = rotation(d, x.device)
        if mean is not None:
            shift = mean @ rotation(d, x.device, normalized=False)
    if kernel is None:
        kernel = x.is_cuda and triton is not None
    data = (quantize_triton if kernel else quantize_torch)(x, shift, inverse, rotate)
    return Quantized(data, descale, mean, r)


def quantize_qkv(q, k, v, smooth_k: bool = True, smooth_v: bool = True, per_head: bool = True,
                 kernel: bool | None = None, rotate: bool = True) -> tuple[Quantized, Quantized, Quantized]:
    """q is scaled only (a per-query offset would change the softmax); k and v optionally smoothed; q and k
    optionally rotated (the same R: q·k unchanged)."""
    return (quantize(q, False, per_head, kernel, rotate), quantize(k, smooth_k, per_head, kernel, rotate),
            quantize(v, smooth_v, per_head, kernel))


def fa3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
                      smooth_v: bool = True, per_head: bool = True, rotate: bool = True) -> torch.Tensor:
    """q, k, v [B, H, S, D] bf16 on an sm_90 GPU -> [B, H, S, D] bf16 (a view of FA3's [B, S, H, D] output).
    `smooth_v`, `rotate`: the backend's options (`FP8AttentionOptions`); `smooth_k=False` / `per_head=False`: the
    coarser variants, for measurements."""
    qq, kq, vq = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v, per_head=per_head, rotate=rotate)
    return fa3_fp8_call(qq, kq, vq, q.shape[-1])


def fa3_fp8_call(qq: Quantized, kq: Quantized, vq: Quantized, head_dim: int) -> torch.Tensor:
    """FA3's FP8 forward on quantized q, k, v -> [B, H, S, D] bf16 (the v mean added back)."""
    from fa3_fwd_interface import flash_attn_func

    out = flash_attn_func(qq.data, kq.data, vq.data, softmax_scale=head_dim ** -0.5, causal=False,
                          q_descale=qq.descale, k_descale=kq.descale, v_descale=vq.descale)
    if isinstance(out, tuple):
        out = out[0]
    if vq.mean is not None:  # the rows of the softmax sum to one: attn(v − mean) + mean = attn(v)
        out.add_(vq.mean[:, None].to(out.dtype))
    return out.transpose(1, 2)


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def fp8_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
                            smooth_v: bool = True, per_head: bool = True, rotate: bool = True, fp8: bool = True,
                            fp8_p: bool = True, dtype: torch.dtype = torch.float32, q_chunk: int = 4096,
                            rows: slice | None = None, p_offset_log2: float = P_OFFSET_LOG2) -> torch.Tensor:
    """Numerical emulation of `fa3_fp8_attention` in torch: [B, H, S, D] -> [B, H, S, D] in `dtype`.

    Same quantization (torch form of the quantizer; q and k rotated with `rotate`); scores q8·k8 accumulated in
    `dtype`, times q_descale·k_descale·D^-1/2; probabilities exp2 of (score − row max)·log2(e) + 8, rounded to e4m3
    for the PV product (`fp8_p`), normalised by the sum of the unrounded ones; times v_descale; the v mean added back
    in bf16. FA3 rescales block by block with a running max, so its probability roundings differ from these (which use
    the final row max) in detail, not in size. `fp8=False`: the same smoothing and rotation without any
    quantization (exact algebra, for the invariance checks); the result is then not rounded to bf16. `rows`: only
    these query rows (the scales and means still come from every token). `p_offset_log2`: the exponent offset of the
    probabilities before their e4m3 rounding (FA3's 8; 0 models a kernel that rounds probabilities in [0, 1])."""
    if fp8:
        qq, kq, vq = quantize_qkv(q, k, v, smooth_k, smooth_v, per_head, kernel=False, rotate=rotate)
        qd = qq.data.transpose(1, 2).to(dtype)
        kd = kq.data.transpose(1, 2).to(dtype)
        vd = vq.data.transpose(1, 2).to(dtype)
        q_desc, k_desc, v_desc = (t.descale.to(dtype)[:, :, None, None] for t in (qq, kq, vq))
        v_mean = vq.mean
    else:
        qd, kd, vd = (x.to(dtype) for x in (q, k, v))
        if smooth_k:
            kd = kd - kd.mean(dim=2, keepdim=True)
        v_mean = vd.mean(dim=2) if smooth_v else None
        if v_mean is not None:
            vd = vd - v_mean[:, :, None, :]
        if rotate:
            r = rotation(q.shape[-1], q.device, dtype=dtype)
            qd, kd = qd @ r, kd @ r
        q_desc = k_desc = v_desc = torch.ones((), dtype=dtype, device=q.device)
    if rows is not None:
        qd = qd[:, :, rows]
    scale_log2 = q.shape[-1] ** -0.5 * math.log2(math.e) * q_desc * k_desc  # [B, H, 1, 1]
    out = torch.empty(qd.shape[:-1] + vd.shape[-1:], dtype=dtype, device=q.device)
    for i in range(0, qd.shape[2], q_chunk):
        s = qd[:, :, i:i + q_chunk] @ kd.transpose(-1, -2)
        s = (s - s.amax(dim=-1, keepdim=True)) * scale_log2
        if fp8:
            s = s + p_offset_log2
        p = torch.exp2(s)
        denom = p.sum(dim=-1, keepdim=True)
        if fp8 and fp8_p:
            p = p.float().to(torch.float8_e4m3fn).to(dtype)
        out[:, :, i:i + q_chunk] = (p @ vd) / denom * v_desc
    if not fp8:
        return out if v_mean is None else out + v_mean[:, :, None, :].to(dtype)
    out = _round_bf16(out)  # FA3 writes bf16
    if v_mean is not None:
        out = _round_bf16(out + _round_bf16(v_mean.to(dtype))[:, :, None, :])
    return out
