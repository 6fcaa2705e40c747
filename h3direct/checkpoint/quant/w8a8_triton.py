"""Triton kernels of the FP8 W8A8 path (`w8a8.py` holds the torch reference math they must equal bit for bit).

- :func:`quantize_rows`: per-row (per-token) e4m3 quantization, one program per row, one read of the row;
- :func:`nvfp4_to_e4m3`: an NVFP4 weight (packed E2M1 codes, swizzled E4M3 block scales, fp32 global scale) to an
  e4m3 weight under precomputed per-row scales, one pass over the packed bytes.

Both encode e4m3 with integer arithmetic (round to nearest, ties to even, inputs clamped to ±448 first) rather than
a float8 cast, and divide with IEEE rounding (`tl.fdiv(..., ieee_rounding=True)`), so the result does not depend on
the cast instructions of the GPU or of Triton's interpreter (`TRITON_INTERPRET=1`, which the CPU tests use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _encode_e4m3(v):
    """fp32 in [-448, 448] -> int32 e4m3fn code (0..255), round to nearest even; |v| < 2^-10 -> ±0."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    e = ((bits >> 23) & 0xFF) - 127
    sig = (bits & 0x7FFFFF) | 0x800000
    # keep 3 fraction bits for normals (e >= -6); subnormals keep fewer (quantum 2^-9)
    shift = tl.minimum(tl.where(e >= -6, 20, 14 - e), 30)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    code = tl.where(e >= -6, (e + 6) * 8 + q, q)  # a carry out of the fraction bumps the exponent by itself
    return code | (sign << 7)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.fdiv(amax, amax * 0.0 + 448.0, ieee_rounding=True)  # literals: Triton kernels may not read globals
    s = tl.where(amax > 0.0, s, 1.0)
    v = tl.fdiv(x, tl.zeros_like(x) + s, ieee_rounding=True)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_ptr + row * K + cols, _encode_e4m3(v).to(tl.uint8), mask=mask)
    tl.store(s_ptr + row, s)


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (unit column stride) -> (float8_e4m3fn [M, K] contiguous, fp32 scales [M])."""
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    q = torch.empty((m, k), dtype=torch.uint8, device=x2d.device)
    s = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m and k:
        block = triton.next_power_of_2(k)
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        _quant_rows_kernel[(m,)](x2d, q, s, k, x2d.stride(0), BLOCK=block, num_warps=warps)
    return q.view(torch.float8_e4m3fn), s


@triton.jit
def _nvfp4_e4m3_kernel(p_ptr, bs_ptr, g_ptr, s_ptr, q_ptr, N, K, SCALE_COLS, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    mask = (r < N) & (c < K)
    r64 = r.to(tl.int64)
    byte = tl.load(p_ptr + r64 * (K // 2) + c // 2, mask=mask, other=0).to(tl.int32)
    nib = tl.where((c % 2) == 0, byte >> 4, byte & 15)  # even column in the high nibble
    mag = nib & 7
    e = mag >> 1
    mb = (mag & 1).to(tl.float32)
    val = tl.where(e == 0, mb * 0.5, tl.where(e == 1, 1.0 + mb * 0.5, tl.where(e == 2, 2.0 + mb, 4.0 + 2.0 * mb)))
    val = tl.where((nib & 8) != 0, -val, val)
    # block scale (r, c // 16) inside cuBLAS' 128x4 tiles: [32 rows][4 row groups][4 columns] per tile
    b = c // 16
    tile = (r // 128) * (SCALE_COLS // 4) + b // 4
    off = tile.to(tl.int64) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + (b % 4)
    sc = tl.load(bs_ptr + off, mask=mask, other=0).to(tl.int32)
    ex = (sc >> 3) & 15
    mt = sc & 7
    pow2 = (((ex - 10) + 127) << 23).to(tl.float32, bitcast=True)  # 2^(ex - 10), ex in 1..15
    scv = tl.where(ex == 0, mt.to(tl.float32) * 0.001953125, (8 + mt).to(tl.float32) * pow2)
    scv = tl.where((sc & 128) != 0, -scv, scv)
    g = tl.load(g_ptr)
    w = val * (g * scv)
    s = tl.load(s_ptr + r, mask=r < N, other=1.0)
    v = tl.fdiv(w, tl.zeros_like(w) + s, ieee_rounding=True)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_ptr + r64 * K + c, _encode_e4m3(v).to(tl.uint8), mask=mask)


def nvfp4_to_e4m3(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                  scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N16, K16/2], tiled e4m3 block scales, fp32 global scale, fp32 per-row scales [N16] ->
    float8_e4m3fn [N16, K16] (the whole padded storage; callers slice the logical shape)."""
    n, half = packed.shape
    k = 2 * half
    raw = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    scale_cols = raw.numel() // (-(-n // 128) * 128)
    q = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
    br, bc = 32, 128
    grid = (triton.cdiv(n, br), triton.cdiv(k, bc))
    _nvfp4_e4m3_kernel[grid](packed.contiguous(), raw.contiguous(), global_scale.to(torch.float32).reshape(1),
                             scales.to(torch.float32).contiguous(), q, n, k, scale_cols, BR=br, BC=bc, num_warps=4)
    return q.view(torch.float8_e4m3fn)
