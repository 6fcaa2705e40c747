"""8-bit W8A8 linears (the opt-in approximate path): per-output-channel weight scales, per-token activation
scales; e4m3 (FP8) through `torch._scaled_mm` with rowwise scaling on Hopper-class GPUs, or int8 through
`torch._int_mm` (option `fp8_linear_format`); an emulation of the same math elsewhere.

Quantization (both operands, same rule along the reduced dimension K):

    s[r] = amax_k |t[r, k]| / 448          (fp32; s = 1 where that is not a normal fp32 number: a row of zeros,
                                            or one whose amax < 448 · 2^-126; their codes are all 0)
    q[r, k] = e4m3( clamp(t[r, k] · (1 / s[r]), -448, 448) )      round to nearest, ties to even
    y[m, n] ≈ s_x[m] · s_w[n] · Σ_k q_x[m, k] · q_w[n, k]   (+ bias)

so every element keeps 3 mantissa bits (relative rounding error ≤ 2^-4) unless it falls into e4m3's subnormal range
(|t| < 2^-6 · s, i.e. more than 2^15 below its row's largest element). The codes take the row's reciprocal 1 / s
(one IEEE division per row) times each element (one rounded product): the kernels that write e4m3 are bound by
their arithmetic, and a product per element costs a fraction of an IEEE division. That product is within two fp32
roundings (2^-23, relative) of the quotient t / s, far below e4m3's 2^-4.

int8 follows the same pattern with a uniform grid instead of a floating one: s[r] = amax_k |t[r, k]| / 127 and
q[r, k] = round(clamp(t[r, k] · (1 / s[r]), -127, 127)) (nearest, ties to even), so every element's rounding error is
at most s[r] / 2 (its variance s[r]² / 12: uniform rounding noise), which against e4m3's 2^-4 relative error is far
smaller for the bulk of a row and larger only for its smallest elements. The products accumulate exactly in int32
(|q| ≤ 127: no overflow below K = 2^31 / 127² ≈ 133,000), then one fp32 epilogue per element: acc (rounded to
fp32) · s_x[m] · s_w[n] (+ bias), rounded to the output dtype. The emulation accumulates in float64 (exact: every
partial sum is an integer below 2^53) and runs the same epilogue, so the GPU and every CPU give the same bits.

Weights come as bf16/fp32 (quantized once, :func:`quantize_rows`) or as NVFP4; for NVFP4 the per-channel scale is
taken once from the fp32-decoded rows (:func:`nvfp4_channel_scales`) and the e4m3 weight is either made once
(resident) or on every call by :func:`nvfp4_to_e4m3` (a Triton kernel on CUDA: one pass over the packed bytes).

Activations come as a tensor (quantized here, per row) or already quantized, as :class:`E4M3Rows`: the fused kernels
that produce the block linears' inputs (`h3direct.dit.fused`) write e4m3 codes and per-row scales directly, by the
same rule and bit for bit what quantizing their rounded output gives.

Where the GEMM runs (`linear_w8a8`), counted per call in the caller's scoped collector (`h3direct.counts`):

- ``scaled_mm``: CUDA, bf16 activations, compute capability >= 8.9, K and N multiples of 16, Triton importable:
  Triton per-row activation quantization, then `torch._scaled_mm(x8, w8ᵀ, scale_a=s_x[M,1], scale_b=s_w[1,N],
  out_dtype=bf16, use_fast_accum=accum == "fast")` (bias added after the GEMM); ``scaled_mm, e4m3 input``: the same
  GEMM on an :class:`E4M3Rows`. ``accum`` (the option ``fp8_accum``): "fast" accumulates in the tensor cores' own
  accumulator over the whole K (cuBLAS fast accumulation, the default of FBGEMM's f8f8bf16_rowwise), "fp32" promotes the
  partial sums to fp32 registers; either way the error it adds is far below the operands' e4m3 rounding, which the
  gate's rule for FP8 linears bounds;
- ``int8_gemm``: an int8 weight on a GPU of compute capability >= 9.0 (K a multiple of 16) where one of the kernel's
  tile shapes fits the GPU's shared memory per block (`int8_gemm.fitting`): Triton per-row int8 quantization, then
  one Triton kernel for the GEMM and its epilogue (`int8_gemm`: exact int32 accumulation on the tensor cores, the
  scales and bias applied to the accumulator);
- ``int_mm (int8_gemm: <why not>)``: an int8 weight on other CUDA GPUs (compute capability >= 8.0, M > 16, K and N
  multiples of 8, Triton importable): Triton per-row int8 quantization, `torch._int_mm(x8, w8ᵀ)` (int32), the Triton
  epilogue (`w8a8_triton`);
- ``emulated (<reason>)``: anything else: the same quantization in torch, then the product of the dequantized
  operands in fp32 (the GPU accumulates in fp32 as well; only the summation order differs; int8: the exact product
  in float64 and the GPU's epilogue, so the same bits). On the CPU this is the path by design; on CUDA it is a
  fallback with its reason, and ``strict`` (the option ``fp8_strict``) turns it into an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import einops
import torch

from h3direct.checkpoint.quant.nvfp4 import BLOCK, e2m1_table, unswizzle_block_scales
from h3direct.counts import count_fp8_linear
from h3direct.errors import ConfigError
from h3direct.triton_build import interpreting

E4M3_MAX = 448.0
INT8_MAX = 127.0
ALIGN = 16  # _scaled_mm: K and N multiples of 16
_ROW_CHUNK = 4096  # rows per step when quantizing a whole weight (bounds the fp32 temporaries)

# ---------------------------------------------------------------- torch quantization (the reference math)

MIN_SCALE = 2.0 ** -126  # the smallest normal fp32 number: a smaller row scale would make 1 / s overflow


def row_scales(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> fp32 [R]: amax of each row / 448; 1 where that is below MIN_SCALE (an all-zero row included)."""
    amax = t.abs().amax(dim=-1).to(torch.float32)
    s = amax / E4M3_MAX
    return torch.where(s >= MIN_SCALE, s, torch.ones_like(s))


def encode_rows(t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, K] and fp32 [R] scales -> float8_e4m3fn [R, K]: t · (1 / s) in fp32 (the reciprocal rounded once, then
    the product), clamped to ±448, rounded to nearest even."""
    inverse = 1.0 / scales.to(torch.float32)
    q = t.to(torch.float32) * inverse[:, None]
    return q.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _quantize_rows(t: torch.Tensor, dtype: torch.dtype, scale_rows, encode) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] (any float dtype) -> (codes [R, K] of `dtype`, fp32 scales [R]) by `scale_rows` and `encode`; rows in
    chunks to bound memory."""
    if t.dim() != 2:
        raise ValueError(f"row quantization takes a 2D tensor, got shape {list(t.shape)}")
    q = torch.empty(t.shape, dtype=dtype, device=t.device)
    s = torch.empty(t.shape[0], dtype=torch.float32, device=t.device)
    for r in range(0, t.shape[0], _ROW_CHUNK):
        part = t[r : r + _ROW_CHUNK]
        s[r : r + _ROW_CHUNK] = scale_rows(part)
        q[r : r + _ROW_CHUNK] = encode(part, s[r : r + _ROW_CHUNK])
    return q, s


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] (any float dtype) -> (float8_e4m3fn [R, K], fp32 scales [R])."""
    return _quantize_rows(t, torch.float8_e4m3fn, row_scales, encode_rows)


def int8_row_scales(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> fp32 [R]: amax of each row / 127; 1 where that is below MIN_SCALE (an all-zero row included)."""
    amax = t.abs().amax(dim=-1).to(torch.float32)
    s = amax / INT8_MAX
    return torch.where(s >= MIN_SCALE, s, torch.ones_like(s))


def encode_rows_int8(t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R, K] and fp32 [R] scales -> int8 [R, K]: t · (1 / s) in fp32 (as `encode_rows`), clamped to ±127, rounded
    to nearest even."""
    inverse = 1.0 / scales.to(torch.float32)
    q = t.to(torch.float32) * inverse[:, None]
    return torch.round(q.clamp_(-INT8_MAX, INT8_MAX)).to(torch.int8)


def rotated_int8_codes_reference(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] and fp32 row scales [N] -> int8 [N, K]: the rows rotated (`hadamard.rotate_rows`: rounded once to
    bf16), then encoded under the scales (`encode_rows_int8`). What the Triton kernel must equal."""
    from h3direct.checkpoint.quant import hadamard

    return encode_rows_int8(hadamard.rotate_rows(w.contiguous()), scales)


def rotated_int8_codes(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`rotated_int8_codes_reference` in one Triton pass on CUDA (or under TRITON_INTERPRET=1) where the Hadamard
    block is at least 16 (a tensor-core product); else torch. The kernel accumulates each block's products in fp32 in
    its own order: where a block's sum is exact in fp32 (its products share a quantum and stay under 2^24 of it, as
    an NVFP4 weight's do unless its block scales span many binades) the codes are the reference's bit for bit;
    elsewhere one may differ by 1 (one bf16 ulp of the rotated value moves the rounding)."""
    operands = _rotating_kernel_operands(w)
    if operands is None:
        return rotated_int8_codes_reference(w, scales)
    from h3direct.checkpoint.quant import w8a8_triton

    return w8a8_triton.rotate_encode_int8(w if w.stride(1) == 1 else w.contiguous(), *operands,
                                          scales.to(torch.float32))


def quantize_rotated_int8(x2d: torch.Tensor) -> Int8Rows:
    """[M, K] activations -> the int8 rows of x·R (`hadamard.rotate_rows`, rounded to x's dtype) under per-row scales:
    `quantize_rows_int8(rotate_rows(x))`. On CUDA (or under TRITON_INTERPRET=1), for bf16 and a Hadamard block of
    at least 16, one Triton kernel that never stores the rotated rows (`w8a8_triton.rotate_quantize_rows_int8`),
    under `rotated_int8_codes`' rule: the same bits where a block's fp32 sum is exact, else a code within one."""
    operands = _rotating_kernel_operands(x2d)
    if operands is None:
        from h3direct.checkpoint.quant import hadamard

        q, s = quantize_rows_int8(hadamard.rotate_rows(x2d.contiguous()))
    else:
        from h3direct.checkpoint.quant import w8a8_triton

        q, s = w8a8_triton.rotate_quantize_rows_int8(x2d if x2d.stride(1) == 1 else x2d.contiguous(), *operands)
    return Int8Rows(q, s, x2d.dtype)


def _rotating_kernel_operands(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotating kernels' bf16 signs [K] and Hadamard block (`hadamard.operands`) for rows t [R, K], where one
    Triton pass takes them: on CUDA (or under TRITON_INTERPRET=1), bf16, a block of at least 16 (a tensor-core
    product). None: the torch path."""
    from h3direct.checkpoint.quant import hadamard

    return hadamard.operands(t.shape[-1], t.device, torch.bfloat16) if rotates_in_triton(t) else None


def rotates_in_triton(t: torch.Tensor) -> bool:
    """The rotating Triton kernels take rows t [R, K] (else the torch path rotates them): on CUDA (or under
    TRITON_INTERPRET=1), bf16, a Hadamard block of at least 16 (a tensor-core product)."""
    from h3direct.checkpoint.quant import hadamard

    return _triton_ok(t) and t.dtype == torch.bfloat16 and hadamard.block(t.shape[-1]) >= 16


def quantize_rows_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] (any float dtype) -> (int8 [R, K], fp32 scales [R])."""
    return _quantize_rows(t, torch.int8, int8_row_scales, encode_rows_int8)


def format_functions(fmt: str) -> tuple:
    """(rows' quantizer, their scales, their encoder) of format `fmt` (the option fp8_linear_format's choices),
    looked up when called (a test's patch of one of them reaches every caller)."""
    return {"e4m3": (quantize_rows, row_scales, encode_rows),
            "int8": (quantize_rows_int8, int8_row_scales, encode_rows_int8)}[fmt]


@dataclass(frozen=True)
class QuantizedRows:
    """An activation already quantized by this module's rule: codes [M, K] (unit column stride) of the class's
    `CODES` dtype, fp32 per-row scales [M], and the dtype of the activation they stand for (the linear's output
    dtype)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    CODES: ClassVar[torch.dtype]

    def __post_init__(self):
        m, _ = self.data.shape
        if self.data.dtype != self.CODES or self.scale.shape != (m,) or self.scale.dtype != torch.float32:
            raise ValueError(f"{type(self).__name__}: codes {self.data.dtype} {list(self.data.shape)}, scales "
                             f"{self.scale.dtype} {list(self.scale.shape)}")


class E4M3Rows(QuantizedRows):
    """e4m3 rows, for an e4m3 linear (the fused producer kernels write them)."""

    CODES = torch.float8_e4m3fn


class Int8Rows(QuantizedRows):
    """int8 rows, for an int8 linear (`quantize_rotated_int8`: its rows rotated first)."""

    CODES = torch.int8


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [R, K] and fp32 [R] -> fp32 [R, K] (exact: e4m3 values times the scale, one rounding)."""
    return q.to(torch.float32) * scales.to(torch.float32)[:, None]


# ---------------------------------------------------------------- NVFP4 -> e4m3 (torch reference)

def _decode_rows(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [R, K/2] + row-major e4m3 block scales [R, K/16] -> fp32 [R, K]."""
    total = global_scale.to(torch.float32) * scales.to(torch.float32)  # [R, K/16]
    lut = e2m1_table(torch.float32, packed.device)
    values = torch.stack([lut[(packed >> 4).long()], lut[(packed & 0x0F).long()]], dim=-1)  # [R, K/2, 2]
    blocks = einops.rearrange(values, "n (b h) two -> n b (h two)", h=BLOCK // 2) * total[..., None]
    return einops.rearrange(blocks, "n b k -> n (b k)")


def decode_nvfp4_fp32(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 storage -> fp32 [N16, K16]: e2m1 value · (global · block scale), both products in fp32 (torch, any
    device; the decode the per-channel scales and the conversion kernel are defined on)."""
    rows, half = packed.shape
    return _decode_rows(packed, unswizzle_block_scales(block_scale, rows, 2 * half // BLOCK), global_scale)


def nvfp4_channel_scales(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                         fmt: str = "e4m3") -> torch.Tensor:
    """Per-row scales (of format `fmt`) of an NVFP4 weight ([N16] fp32), from its fp32 decode, rows in chunks."""
    rows, half = packed.shape
    scales = unswizzle_block_scales(block_scale, rows, 2 * half // BLOCK)
    scale_rows = format_functions(fmt)[1]
    out = torch.empty(rows, dtype=torch.float32, device=packed.device)
    for r in range(0, rows, _ROW_CHUNK):
        sl = slice(r, r + _ROW_CHUNK)
        out[sl] = scale_rows(_decode_rows(packed[sl], scales[sl], global_scale))
    return out


def nvfp4_to_codes_reference(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                             scales: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """NVFP4 storage and per-row scales -> codes of format `fmt` [N16, K16] (float8_e4m3fn or int8; torch, what the
    Triton kernel must equal)."""
    return format_functions(fmt)[2](decode_nvfp4_fp32(packed, block_scale, global_scale), scales)


def nvfp4_to_codes(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                   scales: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """The 8-bit weight of an NVFP4 layer: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), else torch."""
    if _triton_ok(packed):
        from h3direct.checkpoint.quant import nvfp4_triton

        return nvfp4_triton.nvfp4_to_codes_triton(packed, block_scale, global_scale, scales, fmt=fmt)
    return nvfp4_to_codes_reference(packed, block_scale, global_scale, scales, fmt)


nvfp4_to_e4m3_reference, nvfp4_to_e4m3 = nvfp4_to_codes_reference, nvfp4_to_codes  # the default format's names


def _triton_ok(t: torch.Tensor) -> bool:
    if not (t.is_cuda or interpreting()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_activation(x2d: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (codes of `fmt` [M, K], fp32 scales [M]): the Triton kernel on CUDA, else torch."""
    if _triton_ok(x2d):
        from h3direct.checkpoint.quant import w8a8_triton

        return w8a8_triton.quantize_rows(x2d, fmt)
    return format_functions(fmt)[0](x2d)


def int8_epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """The int8 GEMM's epilogue in torch: (acc in fp32) · s_x[m] · s_w[n] (+ bias in fp32), rounded to `dtype` once;
    acc int32 or float64 holding integers (the emulation's exact product). The Triton epilogue equals it bitwise."""
    y = acc.to(torch.float32) * sx.to(torch.float32)[:, None]
    y = y * sw.to(torch.float32)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)[None, :]
    return y.to(dtype)


# ---------------------------------------------------------------- the linear

def _gpu_reason(x: torch.Tensor, dtype: torch.dtype, k: int, n: int) -> str | None:
    """Why `torch._scaled_mm` cannot run on x (the activation, or its e4m3 codes, of `dtype`); None: it can."""
    if not x.is_cuda:
        return "cpu"
    if dtype != torch.bfloat16:
        return f"activation dtype {str(dtype).replace('torch.', '')} (rowwise _scaled_mm writes bf16)"
    if k % ALIGN or n % ALIGN:
        return f"K={k}, N={n} not multiples of {ALIGN}"
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return "compute capability < 8.9 (no fp8 tensor cores)"
    if not hasattr(torch, "_scaled_mm"):
        return "torch has no _scaled_mm"
    if not _triton_ok(x):
        return "triton not importable"
    return None


def _int8_gpu_reason(x: torch.Tensor, n: int) -> str | None:
    """Why `torch._int_mm` cannot run on x [M, K] against an int8 weight [n, K]; None: it can."""
    if not x.is_cuda:
        return "cpu"
    m, k = x.shape
    if m <= 16 or k % 8 or n % 8:
        return f"M={m}, K={k}, N={n}: _int_mm needs M > 16 and K, N multiples of 8"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "compute capability < 8.0"
    if not _triton_ok(x):
        return "triton not importable"
    return None


def gemm_reason(fmt: str, device) -> str | None:
    """Why the 8-bit GEMM of `fmt` (e4m3 | int8) would be emulated on `device` for the DiT's linears (bf16
    activations, K and N multiples of 16); None: it runs on the tensor cores there."""
    route, why = _dit_route(fmt, device)
    return why if route == "emulated" else None


def gemm_path(fmt: str, device) -> str:
    """The path an 8-bit linear of `fmt` (e4m3 | int8) takes on `device` for the DiT's linears (bf16 activations, K
    and N multiples of 16), as its calls are counted: scaled_mm, int8_gemm, int_mm (int8_gemm: <why not>) or
    emulated (<why>)."""
    return _route_label(*_dit_route(fmt, device))


def _dit_route(fmt: str, device) -> tuple[str, str | None]:
    """(route, why) of an 8-bit linear of `fmt` at the DiT's shapes on `device` (`_int8_route`; e4m3: scaled_mm or
    emulated)."""
    x = torch.empty(32, 64, device=device, dtype=torch.bfloat16)
    if fmt == "int8":
        codes = torch.empty(32, 64, device=device, dtype=torch.int8)
        return _int8_route(x, codes, codes, x.dtype, None)
    reason = _gpu_reason(x, x.dtype, 64, 64)
    return ("scaled_mm", None) if reason is None else ("emulated", reason)


def _route_label(route: str, why: str | None) -> str:
    """A route as its calls are counted: the route, with why where it is not the first choice."""
    if route == "int_mm":
        return f"int_mm (int8_gemm: {why})"
    return f"emulated ({why})" if route == "emulated" else route


def _int8_route(x2: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, out_dtype: torch.dtype,
                bias: torch.Tensor | None) -> tuple[str, str | None]:
    """Where the int8 GEMM of activations x2 [M, K] (codes x8) and weight w8 [N, K] runs: ("int8_gemm", None),
    h3direct's kernel where it takes them (Hopper on; any M); else ("int_mm", why h3direct's kernel did not),
    cuBLASLt's within its own limits; else ("emulated", why cuBLASLt's did not either)."""
    not_kernel = _triton_gemm_reason(x2, x8, w8, out_dtype, bias)
    if not_kernel is None:
        return "int8_gemm", None
    reason = _int8_gpu_reason(x2, w8.shape[0])
    return ("int_mm", not_kernel) if reason is None else ("emulated", reason)


def linear_int8(x: torch.Tensor | Int8Rows, w8: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, strict: bool = False) -> torch.Tensor:
    """y = x Wᵀ + b with W ≈ w8 · w_scale[:, None] (int8 [N, K], fp32 [N]) and x quantized per row to int8 here
    (module docstring), or already (`Int8Rows`). Output in x's dtype, x's leading dims kept. `strict`: on CUDA, an
    emulated GEMM is an error."""
    pre = isinstance(x, Int8Rows)
    codes = x.data if pre else x
    lead, k = codes.shape[:-1], codes.shape[-1]
    n = w8.shape[0]
    if w8.shape[1] != k:
        raise ValueError(f"input has {k} features, the int8 weight holds {w8.shape[1]}")
    x2 = codes.reshape(-1, k)
    x8, sx = (x.data, x.scale) if pre else quantize_activation(x2, "int8")
    route, why = _int8_route(x2, x8, w8, x.dtype, bias)
    if route == "emulated" and x2.is_cuda and strict:
        raise ConfigError(f"int8 linear [{k} -> {n}] has no int8 GEMM here: {why} (fp8_strict is on)")
    if route == "int8_gemm":
        from h3direct.checkpoint.quant import int8_gemm

        y = int8_gemm.int8_linear(x8, w8, sx, w_scale, bias, x.dtype)
    elif route == "int_mm":
        from h3direct.checkpoint.quant import w8a8_triton

        y = w8a8_triton.int8_epilogue(torch._int_mm(x8, w8.t()), sx, w_scale, bias, x.dtype)
    else:
        y = int8_epilogue(x8.double() @ w8.double().T, sx, w_scale, bias, x.dtype)
    count_fp8_linear(_route_label(route, why))
    return y.reshape(*lead, n)


def _triton_gemm_reason(x2: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, out_dtype: torch.dtype,
                        bias: torch.Tensor | None) -> str | None:
    """Why the fused Triton int8 GEMM (`int8_gemm`: the scales in its epilogue) does not take these operands here
    (activations x2, their codes x8) into `out_dtype`, or None: it does (on CUDA, Triton importable, a tile shape
    that fits the GPU)."""
    if not x2.is_cuda:
        return "cpu"
    if not _triton_ok(x2):
        return "triton not importable"
    from h3direct.checkpoint.quant import int8_gemm

    return int8_gemm.reason(x8, w8, out_dtype, bias)


def linear_w8a8(x: torch.Tensor | E4M3Rows | Int8Rows, w8: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, strict: bool = False, accum: str = "fast") -> torch.Tensor:
    """y = x Wᵀ + b with W ≈ w8 · w_scale[:, None] (float8_e4m3fn [N, K], fp32 [N]) and x quantized per row (here, or
    already: `E4M3Rows`). Output in x's dtype, x's leading dims kept. `strict`: on CUDA, an emulated GEMM is an
    error. `accum`: the GEMM's accumulation on CUDA ("fast" / "fp32", module docstring); the emulation is fp32."""
    # x [..., K] -> [..., N]
    if w8.dtype == torch.int8:
        if isinstance(x, E4M3Rows):
            raise TypeError("an int8 linear takes its input unquantized or as int8 rows, not as e4m3 rows")
        return linear_int8(x, w8, w_scale, bias, strict=strict)
    if isinstance(x, Int8Rows):
        raise TypeError("an e4m3 linear takes its input unquantized or as e4m3 rows, not as int8 rows")
    pre = isinstance(x, E4M3Rows)
    codes = x.data if pre else x
    lead, k = codes.shape[:-1], codes.shape[-1]
    n = w8.shape[0]
    if w8.shape[1] != k:
        raise ValueError(f"input has {k} features, the fp8 weight holds {w8.shape[1]}")
    x2 = codes.reshape(-1, k)
    reason = _gpu_reason(x2, x.dtype, k, n)
    if reason is not None and x2.is_cuda and strict:
        raise ConfigError(f"fp8 linear [{k} -> {n}] cannot use torch._scaled_mm: {reason} (fp8_strict is on)")
    path = "scaled_mm" if reason is None else f"emulated ({reason})"
    count_fp8_linear(f"{path}, e4m3 input" if pre else path)
    # the Triton quantizer makes a column-strided x contiguous itself
    x8, sx = (x.data, x.scale) if pre else quantize_activation(x2)
    if reason is None:
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx[:, None], scale_b=w_scale[None, :].contiguous(),
                             out_dtype=torch.bfloat16, use_fast_accum=accum == "fast")
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*lead, n)
    y = dequantize_rows(x8, sx) @ dequantize_rows(w8, w_scale).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, n)
