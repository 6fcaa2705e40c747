"""Triton side of the 8-bit W8A8 path (`w8a8.py` holds the torch reference math they must equal bit for bit).

- device functions, the one place the activation rule is written for the GPU: `quantize_tile` (per-row scale and
  e4m3 codes of a tile of whole rows) and `encode_e4m3`; `device_functions()` gives them built for the current mode
  (compiled / Triton's interpreter), to be passed to kernels as `tl.constexpr` arguments (`h3direct.triton_build`).
  The fused producer kernels (`h3direct.dit.fused`: norm + modulation, SwiGLU) call them to write their output as
  e4m3 rows directly; the NVFP4 -> e4m3 weight conversion (`nvfp4_triton.nvfp4_to_e4m3_triton`) calls `encode_e4m3`;
- :func:`quantize_rows`: per-row (per-token) e4m3 or int8 quantization of a stored activation, one read of each row
  (the inputs no fused kernel produces: the attention output; every input of an int8 linear);
- :func:`int8_epilogue`: the int8 GEMM's int32 result times the row and column scales (+ bias), one pass, rounded
  once to the output dtype.

int8 codes round to nearest even with `rint` (`cvt.rni`) when compiled and by adding and subtracting 1.5 · 2^23 in the
interpreter (exact for |v| <= 2^22); the product with the row's reciprocal is rounded before it, as torch does (no
fused multiply-add can join them: the rounding is no addition when compiled, and the interpreter fuses nothing). The
epilogue is built without floating-point contraction, so its two products and the bias add round as torch's do.

Divisions are IEEE-rounded (`tl.math.div_rn`: `div.rn.f32`, and no approximate division, in the PTX the CPU tests
compile), as torch divides; Triton's `/` on fp32 is the approximate `div.full.f32`. There is one per row (the scale
and its reciprocal); each element is one rounded product with the reciprocal (`w8a8`'s rule). The e4m3 encoding (inputs
clamped to ±448, round to nearest, ties to even) is the GPU's conversion instruction when compiled (sm_89+:
`cvt.rn.satfinite.e4m3x2.f32`, one instruction for two values) and integer arithmetic in Triton's interpreter
(`TRITON_INTERPRET=1`, which the CPU tests use; its float8 cast is not torch's). Both are held to torch's float8
cast: the integer one by the CPU tests, the instruction over every fp32 value in [-448, 448] by a GPU test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from h3direct.triton_build import FP_OPTIONS, OUT_CODES, build, interpreting


def encode_e4m3(v, INTERPRET: tl.constexpr):
    """fp32 -> uint8 e4m3fn code: clamped to ±448, rounded to nearest even; |v| < 2^-10 -> ±0."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if not INTERPRET:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
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
    return (code | (sign << 7)).to(tl.uint8)


def quantize_tile(x, ENCODE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 [R, B] whole rows (zeros past each row's end) -> (uint8 e4m3 codes [R, B], fp32 scales [R]):
    s = amax / 448 (1 below the smallest normal fp32, a zero row included), codes = encode(x · (1 / s));
    `w8a8.row_scales` / `w8a8.encode_rows`."""
    a = tl.abs(x)
    if INTERPRET:  # tl.max: a compiled-mode function when Triton was imported outside the interpreter
        amax = tl.reduce(a, 1, tl.standard._elementwise_max)
    else:
        amax = tl.max(a, axis=1)
    s = tl.math.div_rn(amax, amax * 0.0 + 448.0)  # literals: Triton kernels may not read globals
    s = tl.where(s >= 1.1754943508222875e-38, s, 1.0)  # w8a8.MIN_SCALE
    inverse = tl.math.div_rn(s * 0.0 + 1.0, s)
    return ENCODE(x * inverse[:, None], INTERPRET), s


def encode_int8(v, INTERPRET: tl.constexpr):
    """fp32 -> int8 code: clamped to ±127, rounded to nearest even."""
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    if INTERPRET:
        r = (v + 12582912.0) - 12582912.0
    else:
        r = libdevice.rint(v)
    return r.to(tl.int8)


def quantize_tile_int8(x, ENCODE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 [R, B] whole rows -> (int8 codes [R, B], fp32 scales [R]): s = amax / 127 (1 below the smallest normal
    fp32), codes = encode(x · (1 / s)); `w8a8.int8_row_scales` / `w8a8.encode_rows_int8`."""
    a = tl.abs(x)
    if INTERPRET:
        amax = tl.reduce(a, 1, tl.standard._elementwise_max)
    else:
        amax = tl.max(a, axis=1)
    s = tl.math.div_rn(amax, amax * 0.0 + 127.0)
    s = tl.where(s >= 1.1754943508222875e-38, s, 1.0)
    inverse = tl.math.div_rn(s * 0.0 + 1.0, s)
    return ENCODE(x * inverse[:, None], INTERPRET), s


def device_functions(fmt: str = "e4m3") -> tuple:
    """(quantize_tile, encode) of format `fmt` ("e4m3" | "int8") built for the current mode, for kernels' `QUANT` /
    `ENCODE` arguments."""
    if fmt == "int8":
        return build(quantize_tile_int8), build(encode_int8)
    return build(quantize_tile), build(encode_e4m3)


def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       QUANT: tl.constexpr, ENCODE: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    inside = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    codes, s = QUANT(x, ENCODE, INTERPRET)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], codes, mask=inside)
    tl.store(s_ptr + rows, s, mask=rows < M)


def quantize_rows(x2d: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (unit column stride) -> (codes [M, K] contiguous: float8_e4m3fn, or int8 for `fmt` "int8"; fp32 scales
    [M])."""
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    q = torch.empty((m, k), dtype=torch.int8 if fmt == "int8" else torch.uint8, device=x2d.device)
    s = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m and k:
        block = triton.next_power_of_2(k)
        warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
        quant, encode = device_functions(fmt)
        build(_quant_rows_kernel)[(m,)](x2d, q, s, m, k, x2d.stride(0), ROWS=1, BLOCK=block, QUANT=quant,
                                        ENCODE=encode, INTERPRET=interpreting(), num_warps=warps, **FP_OPTIONS)
    return (q, s) if fmt == "int8" else (q.view(torch.float8_e4m3fn), s)


def rotated_block(ptr, signs_ptr, h, rows, inside, cols, stride, ROUND: tl.constexpr, INTERPRET: tl.constexpr):
    """The rows' columns `cols` (one Hadamard block of b) times diag(signs) · H_b (h: bf16 ±1 [b, b]), accumulated in
    fp32 by one tensor-core product and rounded once to bf16 (returned as fp32 values): `hadamard.rotate_rows` of a
    bf16 tensor, block by block. ROUND: `round_out`, built for this mode."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    signed = (x * tl.load(signs_ptr + cols)[None, :]).to(tl.bfloat16)  # ±1: exact
    if INTERPRET:  # the interpreter's dot misreads bf16 operands; as fp32 they hold the same (bf16-exact) values
        acc = tl.dot(signed.to(tl.float32), h.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        acc = tl.dot(signed, h, out_dtype=tl.float32)
    bits = ROUND(acc, 2).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (bits << 16).to(tl.float32, bitcast=True)


def _rotate_encode_kernel(w_ptr, signs_ptr, h_ptr, rs_ptr, out_ptr, N, stride_w, stride_out, B: tl.constexpr,
                          BN: tl.constexpr, ENCODE: tl.constexpr, ROTATE: tl.constexpr, ROUND: tl.constexpr,
                          INTERPRET: tl.constexpr):
    # a program: rows n0..n0+BN of the B columns of one Hadamard block; ROTATE: `rotated_block`, built for this mode
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    kk = tl.arange(0, B)
    cols = tl.program_id(1) * B + kk
    inside = (rows < N)[:, None]
    h = tl.load(h_ptr + kk[:, None] * B + kk[None, :])
    rotated = ROTATE(w_ptr, signs_ptr, h, rows, inside, cols, stride_w, ROUND, INTERPRET)
    rs = tl.load(rs_ptr + rows, mask=rows < N, other=1.0)
    inverse = tl.math.div_rn(rs * 0.0 + 1.0, rs)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], ENCODE(rotated * inverse[:, None], INTERPRET),
             mask=inside)


def _rotate_quant_rows_kernel(x_ptr, signs_ptr, h_ptr, q_ptr, s_ptr, M, K, stride_x, B: tl.constexpr,
                              BM: tl.constexpr, ENCODE: tl.constexpr, ROTATE: tl.constexpr, ROUND: tl.constexpr,
                              INTERPRET: tl.constexpr):
    # a program: rows m0..m0+BM, whole; their rotated blocks made twice (the row's amax first, then the codes), so
    # that the rotated rows are never stored
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    kk = tl.arange(0, B)
    inside = (rows < M)[:, None]
    h = tl.load(h_ptr + kk[:, None] * B + kk[None, :])
    amax = tl.zeros([BM], dtype=tl.float32)
    for c in range(0, K // B):
        a = tl.abs(ROTATE(x_ptr, signs_ptr, h, rows, inside, c * B + kk, stride_x, ROUND, INTERPRET))
        if INTERPRET:  # tl.max: a compiled-mode function when Triton was imported outside the interpreter
            amax = tl.maximum(amax, tl.reduce(a, 1, tl.standard._elementwise_max))
        else:
            amax = tl.maximum(amax, tl.max(a, axis=1))
    # the scale of `quantize_tile_int8` (`w8a8.int8_row_scales`) from the whole row's amax
    s = tl.math.div_rn(amax, amax * 0.0 + 127.0)
    s = tl.where(s >= 1.1754943508222875e-38, s, 1.0)
    inverse = tl.math.div_rn(s * 0.0 + 1.0, s)
    for c in range(0, K // B):
        rotated = ROTATE(x_ptr, signs_ptr, h, rows, inside, c * B + kk, stride_x, ROUND, INTERPRET)
        tl.store(q_ptr + rows[:, None] * K + (c * B + kk)[None, :], ENCODE(rotated * inverse[:, None], INTERPRET),
                 mask=inside)
    tl.store(s_ptr + rows, s, mask=rows < M)


ROTATE_ROWS_PER_PROGRAM = 64


def _rotation_functions() -> dict:
    """The rotating kernels' device-function arguments, built for the current mode."""
    return {"ENCODE": device_functions("int8")[1], "ROTATE": build(rotated_block), "ROUND": build(round_out),
            "INTERPRET": interpreting()}


def rotate_encode_int8(w: torch.Tensor, signs: torch.Tensor, h: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (unit column stride), bf16 signs [K] and Hadamard block [b, b] (`hadamard.operands`), fp32 row
    scales [N] -> int8 [N, K]: each row rotated (`rotated_block`), times its row's reciprocal scale, encoded
    (`encode_int8`); `w8a8.rotated_int8_codes`' rule in one pass."""
    n, k = w.shape
    b = h.shape[0]
    out = torch.empty((n, k), dtype=torch.int8, device=w.device)
    if n and k:
        grid = (triton.cdiv(n, ROTATE_ROWS_PER_PROGRAM), k // b)
        build(_rotate_encode_kernel, do_not_specialize=["N"])[grid](
            w, signs.contiguous(), h.contiguous(), scales.contiguous(), out, n, w.stride(0), k, B=b,
            BN=ROTATE_ROWS_PER_PROGRAM, num_warps=4, **_rotation_functions(), **FP_OPTIONS)
    return out


def rotate_quantize_rows_int8(x: torch.Tensor, signs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """bf16 [M, K] (unit column stride) -> (int8 codes [M, K], fp32 scales [M]) of its rows rotated (`rotated_block`)
    under per-row scales set by each rotated row's amax: `w8a8.quantize_rotated_int8`'s rule, reading x twice and
    storing only the codes."""
    m, k = x.shape
    b = h.shape[0]
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m and k:
        build(_rotate_quant_rows_kernel, do_not_specialize=["M"])[(triton.cdiv(m, ROTATE_ROWS_PER_PROGRAM),)](
            x, signs.contiguous(), h.contiguous(), q, s, m, k, x.stride(0), B=b, BM=ROTATE_ROWS_PER_PROGRAM,
            num_warps=4, **_rotation_functions(), **FP_OPTIONS)
    return q, s


def round_out(y, OUT: tl.constexpr):
    """fp32 -> what a kernel stores for output dtype OUT (`triton_build.OUT_CODES`: 0 fp32, 1 fp16, 2 bf16): the value,
    or a 16-bit one's bit pattern as int16, rounded to nearest even (bf16 by integer arithmetic: exact in the
    interpreter too, whose bf16 cast truncates)."""
    # one return: Triton's compiler types every return statement of a function alike, constexpr branches or not
    if OUT == 0:
        out = y
    elif OUT == 1:
        out = y.to(tl.float16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
    else:
        b = y.to(tl.uint32, bitcast=True)
        out = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    return out


def _int8_epilogue_kernel(acc_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr):
    # ROUND: `round_out`, built for this mode
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    off = rows[:, None] * N + cols[None, :]
    y = tl.load(acc_ptr + off, mask=inside, other=0).to(tl.float32)
    y = y * tl.load(sx_ptr + rows, mask=rows < M, other=0.0)[:, None]
    y = y * tl.load(sw_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + off, ROUND(y, OUT), mask=inside)


def int8_epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """int32 [M, N] (the int8 GEMM) -> `dtype` [M, N]: acc · sx[m] · sw[n] (+ bias), bitwise `w8a8.int8_epilogue`."""
    m, n = acc.shape
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    if m and n:
        dst = out if dtype == torch.float32 else out.view(torch.int16)
        b = bias.contiguous() if bias is not None else sw
        grid = (triton.cdiv(m, 32), triton.cdiv(n, 128))
        build(_int8_epilogue_kernel, do_not_specialize=["M", "N"])[grid](
            acc.contiguous(), sx.contiguous(), sw.contiguous(), b, dst, m, n, HAS_BIAS=bias is not None,
            OUT=OUT_CODES[dtype], BLOCK_M=32, BLOCK_N=128, ROUND=build(round_out), num_warps=8,
            enable_fp_fusion=False)
    return out
