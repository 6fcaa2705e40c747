"""NVFP4 (E2M1 values, E4M3 block scales per 16 values, fp32 global scale) as ComfyUI stores and runs it.

Storage (ComfyUI mixed-precision layer, `comfy_quant` = ``{"format": "nvfp4"}``), logical weight [N, K]:

- ``weight``          uint8 [N16, K16/2]: two E2M1 codes per byte, the even column in the HIGH nibble;
- ``weight_scale``    float8_e4m3fn [roundup(N16, 128), roundup(K16/16, 4)]: per-16-block decode scales in
  cuBLAS' 128x4 swizzled tile layout (zero in the padding);
- ``weight_scale_2``  float32 scalar: the per-tensor ("global") scale.

N16/K16 are N/K rounded up to 16 (ComfyUI pads odd shapes with zeros before quantizing).
Decoded value = e2m1(code) * (global * block_scale), where the scale product and the multiplication are
done in the output dtype (comfy-kitchen's `dequantize_nvfp4`, which ComfyUI calls via
`QuantizedTensor.dequantize`): the results here are bitwise equal to its CPU path (the oracle's traces) for fp32,
bf16 and fp16. On CUDA the decode runs in our Triton kernel (`nvfp4_triton`, same bits as the torch path) unless
the option ``nvfp4_dequant`` says otherwise; comfy-kitchen 0.2.40's CUDA kernel rounds some of the bf16 values of a
quantized weight one ulp away from both, which is why it is not the default.

Which linear mode runs where (ComfyUI snapshot 0f1fa67a, `comfy/ops.py` `mixed_precision_ops` +
`comfy.model_management.supports_nvfp4_compute`):

- **W4A16** (:func:`linear_w4a16`): the weight is dequantized to the compute dtype on every call and a plain
  `F.linear` runs with unquantized activations. ComfyUI does this wherever ``supports_nvfp4_compute`` is
  False — NVIDIA GPUs with compute capability < 10 (e.g. H100/H200) **and the CPU** (not an NVIDIA device:
  "nvfp4" goes into the disabled formats, the layer gets ``_full_precision_mm``). The shared NVFP4 oracle
  traces were recorded on this path: `blocks.0.attn.qkv_proj` etc. of `trace_nvfp4_*_fp32` are
  bit-identical to ``F.linear(x, dequantize_nvfp4(..., fp32))`` (`tests/test_quant_nvfp4.py`).
- **W4A4** (:func:`linear_w4a4`): on FP4-capable NVIDIA GPUs (compute capability >= 10: Blackwell,
  DGX Spark), ComfyUI quantizes the activation (reshaped to 2D) to NVFP4 with a dynamic per-tensor scale
  ``amax(|x|) / (448 * 6)`` computed in the activation's dtype, pads rows/cols to 16, and runs
  comfy-kitchen's `scaled_mm_nvfp4` (cuBLAS block-scaled FP4 GEMM, alpha = global_x * global_w, bias in the
  epilogue, output in the activation dtype, sliced back to [M, N]). comfy-kitchen's *eager* (CPU)
  `scaled_mm_nvfp4` cannot run on torch 2.13's CPU (`torch.nn.functional.scaled_mm` raises
  "CPU does not support swizzle"), so ComfyUI never takes this path on the CPU. :func:`linear_w4a4` is a
  pure-PyTorch emulation of the GPU semantics (fp32 accumulation of block-scaled products); it is not
  bitwise equal to the GPU kernel (accumulation order differs).
"""

from __future__ import annotations

from typing import NamedTuple

import einops
import torch
import torch.nn.functional as F

from h3direct.checkpoint.quant.kitchen import kitchen_op
from h3direct.checkpoint.quant.nvfp4_layout import BLOCK, TILE_COLS, padded_shape, scale_storage_shape
from h3direct.errors import CheckpointError

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# the 8 non-negative E2M1 magnitudes, indexed by the 3 low bits of a code; bit 3 is the sign
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# round-to-nearest-even boundaries between consecutive magnitudes: (boundary, tie goes up?)
# ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0
_E2M1_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                    (5.0, False))


class NVFP4Tensor(NamedTuple):
    """The three stored tensors of one NVFP4 weight (checkpoint suffixes in comments)."""

    packed: torch.Tensor  # .weight         uint8 [N16, K16/2]
    block_scale: torch.Tensor  # .weight_scale   float8_e4m3fn [roundup(N16,128), roundup(K16/16,4)]
    global_scale: torch.Tensor  # .weight_scale_2 float32 []


# the stored dtypes of an NVFP4 layer, keyed by checkpoint suffix (the `comfy_quant` marker is uint8 bytes too)
STORAGE_DTYPES = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32}


def storage_shapes(shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
    """Stored shapes of an NVFP4 weight of logical shape [N, K], keyed by checkpoint suffix."""
    n16, k16 = padded_shape(shape)
    return {
        "weight": (n16, k16 // 2),
        "weight_scale": scale_storage_shape(n16, k16 // BLOCK),
        "weight_scale_2": (),
    }


# ---------------------------------------------------------------- block-scale swizzle (cuBLAS 128x4 tiles)

def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """[R, C] row-major block scales -> [roundup(R,128), roundup(C,4)] cuBLAS tiled layout (zero padded).

    Inside a 128x4 tile, element (r, c) lives at flat offset (r % 32) * 16 + (r // 32) * 4 + c; tiles are
    stored row-tile major. The returned 2D shape is just a view of that flat order.
    """
    rows, cols = scales.shape
    rp, cp = scale_storage_shape(rows, cols)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 and scales.is_floating_point() else scales
    grid = raw.new_zeros((rp, cp))
    grid[:rows, :cols] = raw
    flat = einops.rearrange(grid, "(rb rhi rlo) (cb c) -> (rb cb rlo rhi c)", rhi=4, rlo=32, c=TILE_COLS)
    out = flat.reshape(rp, cp)
    return out.view(scales.dtype) if raw is not scales else out


def unswizzle_block_scales(stored: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_block_scales`: tiled storage -> the [rows, cols] row-major block scales."""
    rp, cp = scale_storage_shape(rows, cols)
    if stored.numel() != rp * cp:
        raise CheckpointError(f"block-scale tensor has {stored.numel()} elements, expected {rp}x{cp} "
                              f"(tiled layout of {rows}x{cols} scales)")
    is_byte_float = stored.element_size() == 1 and stored.is_floating_point()
    raw = stored.view(torch.uint8) if is_byte_float else stored
    grid = einops.rearrange(raw.reshape(-1), "(rb cb rlo rhi c) -> (rb rhi rlo) (cb c)",
                            cb=cp // TILE_COLS, rhi=4, rlo=32, c=TILE_COLS)
    grid = grid[:rows, :cols].contiguous()
    return grid.view(stored.dtype) if is_byte_float else grid


# ---------------------------------------------------------------- E2M1 codes

def e2m1_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """16 code values (codes 8..15 are the negatives of 0..7, code 8 is -0.0) in `dtype`."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device=device, dtype=dtype)


_PAIR_TABLES: dict[tuple, torch.Tensor] = {}


def _pair_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 2]: the (high nibble, low nibble) E2M1 values of every byte, cached per dtype and device."""
    key = (dtype, str(device))
    t = _PAIR_TABLES.get(key)
    if t is None:
        lut = e2m1_table(torch.float32)
        byte = torch.arange(256)
        t = torch.stack([lut[byte >> 4], lut[byte & 0x0F]], dim=-1).to(device=device, dtype=dtype)
        _PAIR_TABLES[key] = t
    return t




def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (high nibble = even column)."""
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    pairs = torch.stack([packed >> 4, packed & 0x0F], dim=-1)
    return einops.rearrange(pairs, "... k two -> ... (k two)")


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K/2], even column in the high nibble."""
    pairs = einops.rearrange(codes, "... (k two) -> ... k two", two=2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already in [-6, 6] -> uint8 E2M1 codes, round to nearest, ties to even; sign bit kept
    (so -0.0 and tiny negatives give code 8, as comfy-kitchen's bit-level conversion does)."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for boundary, tie_up in _E2M1_BOUNDARIES:
        code += (mag >= boundary if tie_up else mag > boundary).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


# ---------------------------------------------------------------- decode

DEQUANT_BACKENDS = ("triton", "kitchen", "torch")


def dequant_backend(device: torch.device | str, want: str = "auto") -> str:
    """The implementation `dequantize_nvfp4` runs for tensors on `device`. The CPU always takes the torch path
    (what the shared CPU traces were recorded with). On CUDA, `want` (the option `nvfp4_dequant`) = triton | kitchen |
    torch picks one; auto is our Triton kernel (`nvfp4_triton`: the torch path's bits in one pass) when Triton is
    importable, else comfy-kitchen's CUDA kernel when it loads, else the torch path. Triton and torch give the same
    bits; comfy-kitchen 0.2.40's kernel rounds some values one ulp away (see the module docstring)."""
    if torch.device(device).type != "cuda":
        return "torch"
    if want not in ("auto", *DEQUANT_BACKENDS):
        raise ValueError(f"nvfp4_dequant {want!r}: expected auto or one of {', '.join(DEQUANT_BACKENDS)}")
    want = "" if want == "auto" else want
    if want in ("", "triton"):
        from h3direct.checkpoint.quant import nvfp4_triton

        if nvfp4_triton.triton is not None:
            return "triton"
        if want:
            raise RuntimeError("nvfp4_dequant triton: Triton is not importable here")
    if want in ("", "kitchen"):
        if kitchen_op("dequantize_nvfp4") is not None:
            return "kitchen"
        if want:
            raise RuntimeError("nvfp4_dequant kitchen: comfy-kitchen is not installed or does not load here")
    return "torch"


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16, shape: tuple[int, int] | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """NVFP4 weight -> dense [N, K] in `out_dtype`, bitwise equal to comfy-kitchen's `dequantize_nvfp4` on the CPU.

    `shape` is the logical (unpadded) [N, K]; without it the padded [N16, K16] is returned, as comfy-kitchen
    does. The scale product global*block and the value*scale product are both rounded to `out_dtype`.
    `backend` (one of DEQUANT_BACKENDS) overrides :func:`dequant_backend`'s choice.
    """
    # [N16, K16/2] uint8 -> [N16, K16] out_dtype
    rows, half = packed.shape
    cols = 2 * half
    if cols % BLOCK:
        raise CheckpointError(f"NVFP4 packed weight [{rows}, {half}] holds {cols} columns, not a multiple of 16")
    nblocks = cols // BLOCK
    backend = backend or dequant_backend(packed.device)
    if backend == "triton":  # our one-pass kernel, bandwidth-bound
        from h3direct.checkpoint.quant.nvfp4_triton import dequantize_nvfp4_triton

        out = dequantize_nvfp4_triton(packed, block_scale, global_scale, out_dtype)
    elif backend == "kitchen":
        # comfy-kitchen's CUDA kernel (the one ComfyUI calls on GPUs): one pass, its own rounding of the scale product
        op = kitchen_op("dequantize_nvfp4")
        if op is None:
            raise RuntimeError("NVFP4 dequantization backend 'kitchen': comfy-kitchen is not installed or won't load")
        out = op(packed, global_scale, block_scale, out_dtype)
    elif backend != "torch":
        raise ValueError(f"unknown NVFP4 dequantization backend {backend!r}: expected one of {DEQUANT_BACKENDS}")
    else:
        scales = unswizzle_block_scales(block_scale, rows, nblocks)  # [N16, K16/16] e4m3
        total = global_scale.to(out_dtype) * scales.to(out_dtype)
        # one lookup per byte: both nibbles' values at once (high nibble = even column)
        values = _pair_table(out_dtype, packed.device)[packed.int()]  # [N16, K16/2, 2]
        blocks = einops.rearrange(values, "n (b h) two -> n b (h two)", h=BLOCK // 2) * total[..., None]
        out = einops.rearrange(blocks, "n b k -> n (b k)")
    if shape is not None:
        n, k = shape
        if n > rows or k > cols or padded_shape((n, k)) != (rows, cols):
            raise CheckpointError(f"NVFP4 logical shape {list(shape)} does not fit packed storage [{rows}, {half}]")
        out = out[:n, :k]
    return out


# ---------------------------------------------------------------- encode

def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's per-tensor scale amax(|x|) / (448 * 6), computed in x's dtype, returned as fp32 scalar."""
    return (torch.amax(x.abs()) / (E4M3_MAX * E2M1_MAX)).to(torch.float32)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """2D tensor [N, K] -> NVFP4 storage, byte-identical to ComfyUI's `TensorCoreNVFP4Layout.quantize`
    (comfy-kitchen `quantize_nvfp4` with ``pad_16x`` when N or K is not a multiple of 16).

    The global scale defaults to :func:`nvfp4_global_scale` (in w's dtype: the shared NVFP4 files were made
    from bf16 weights, so their `weight_scale_2` is a bf16 quotient).
    """
    if w.dim() != 2:
        raise ValueError(f"NVFP4 quantizes 2D tensors, got shape {list(w.shape)}")
    g = nvfp4_global_scale(w) if global_scale is None else global_scale.to(device=w.device, dtype=torch.float32)
    if not (torch.isfinite(g) and g > 0):
        # ComfyUI would divide 0 by 0 here and store NaN block scales (e.g. for an all-zero tensor)
        raise ValueError(f"NVFP4 global scale must be finite and > 0, got {g.item()}")
    n, k = w.shape
    n16, k16 = padded_shape((n, k))
    if (n16, k16) != (n, k):
        w = F.pad(w, (0, k16 - k, 0, n16 - n))
    # rows are independent given g: quantize in row chunks to bound the fp32 temporaries of large weights
    parts = [_quantize_rows(w[r : r + _ROW_CHUNK], g) for r in range(0, n16, _ROW_CHUNK)]
    packed = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    scales = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    return NVFP4Tensor(packed, swizzle_block_scales(scales), g)


_ROW_CHUNK = 4096


def _quantize_rows(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K16] rows and the global scale -> (packed uint8 [R, K16/2], row-major E4M3 block scales [R, K16/16])."""
    blocks = einops.rearrange(w, "n (b k) -> n b k", k=BLOCK)
    block_amax = torch.amax(blocks.abs(), dim=-1).to(torch.float32)
    # decode scale of each block relative to the global scale, saturated to E4M3's range, then rounded to E4M3
    rel = torch.clamp(block_amax / E2M1_MAX / g, max=E4M3_MAX)
    scale_e4m3 = rel.to(torch.float8_e4m3fn)
    total = g * scale_e4m3.to(torch.float32)
    zero = total == 0
    scaled = blocks.to(torch.float32) / torch.where(zero, torch.ones_like(total), total)[..., None]
    scaled = torch.where(zero[..., None], torch.zeros_like(scaled), scaled).clamp(-E2M1_MAX, E2M1_MAX)
    codes = encode_e2m1(einops.rearrange(scaled, "n b k -> n (b k)"))
    return pack_codes(codes), scale_e4m3


# ---------------------------------------------------------------- linears

def _out_features(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int | None) -> int:
    # storage rows are N rounded up to 16; the logical N comes from the caller or the bias
    if out_features is not None:
        return out_features
    return packed.shape[0] if bias is None else bias.shape[0]


def linear_w4a16(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 out_features: int | None = None, dequant: str = "auto") -> torch.Tensor:
    """ComfyUI's NVFP4 Linear where FP4 compute is off (CPU, compute capability < 10): dequantize the weight
    to `compute_dtype`, then `F.linear` in that dtype (bias cast to it). Any leading dims of x are kept.
    `out_features` (default: the bias length, else the stored rows) drops the rows ComfyUI padded to 16;
    `dequant`: the dequantization path (`dequant_backend`)."""
    # x [..., K] -> [..., N] compute_dtype
    k = x.shape[-1]
    n = _out_features(packed, bias, out_features)
    if k > 2 * packed.shape[1]:
        raise ValueError(f"input has {k} features, NVFP4 weight holds {2 * packed.shape[1]}")
    w = dequantize_nvfp4(packed, block_scale, global_scale, compute_dtype,
                         backend=dequant_backend(packed.device, dequant))
    if w.shape != (n, k):
        w = w[:n, :k]
    b = None if bias is None else bias.to(compute_dtype)
    return F.linear(x.to(compute_dtype), w, b)


def _decode_block_scaled(q: NVFP4Tensor) -> torch.Tensor:
    """Packed codes times their fp32 block scales, without the global scale: [R16, K16] fp32."""
    rows, half = q.packed.shape
    scales = unswizzle_block_scales(q.block_scale, rows, 2 * half // BLOCK).to(torch.float32)
    values = e2m1_table(torch.float32, q.packed.device)[unpack_codes(q.packed).long()]
    return einops.rearrange(einops.rearrange(values, "r (b k) -> r b k", k=BLOCK) * scales[..., None],
                            "r b k -> r (b k)")


def quantize_activation_nvfp4(x2d: torch.Tensor) -> NVFP4Tensor:
    """ComfyUI's dynamic activation quantization for W4A4 (`QuantizedTensor.from_float(x, "TensorCoreNVFP4Layout")`
    with no input_scale): per-tensor scale from amax in x's dtype, zero padding to 16x16."""
    return quantize_nvfp4(x2d)


def w4a4_gemm(device) -> str:
    """How `linear_w4a4` computes the FP4 GEMM on `device` (W4A4 is `--nvfp4-mode auto`'s choice from compute capability
    10 on, the DGX Spark included): on every device an emulation, the product of the decoded operands in fp32;
    comfy-kitchen's `scaled_mm_nvfp4`, which ComfyUI calls on those GPUs, is not wired in."""
    return "emulated (the decoded NVFP4 operands multiplied in fp32; comfy-kitchen's scaled_mm_nvfp4 is not called)"


def linear_w4a4(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, out_features: int | None = None) -> torch.Tensor:
    """Emulation of ComfyUI's NVFP4 Linear with FP4 compute on (W4A4): x reshaped to 2D, quantized to NVFP4
    with a dynamic per-tensor scale, block-scaled product accumulated in fp32, times global_x * global_w,
    plus bias, cast to `out_dtype`, sliced to [M, N] and reshaped back to x's leading dims."""
    # x [..., K] -> [..., N] out_dtype
    lead, k = x.shape[:-1], x.shape[-1]
    n = _out_features(packed, bias, out_features)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    qx = quantize_activation_nvfp4(x2)
    a = _decode_block_scaled(qx)
    w = _decode_block_scaled(NVFP4Tensor(packed, block_scale, global_scale))
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"activation padded to {a.shape[1]} features, NVFP4 weight holds {w.shape[1]}")
    y = (a @ w.T) * (qx.global_scale * global_scale.to(torch.float32))
    if bias is not None:
        y = y[:, : bias.shape[0]] + bias.to(torch.float32)
    return y[:m, :n].to(out_dtype).reshape(*lead, n)
