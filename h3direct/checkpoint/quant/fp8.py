"""ComfyUI float8 weights: per-tensor scaled (``float8_e4m3fn`` / ``float8_e5m2``) and ``mxfp8``.

- Scaled fp8: ``.weight`` fp8 [N, K], ``.weight_scale`` fp32 scalar; decode = fp8 -> out dtype, times the
  scale cast to the out dtype (comfy-kitchen `dequantize_per_tensor_fp8`: the product is in the out dtype).
- MXFP8: ``.weight`` float8_e4m3fn [N32, K32] (padded to 32), ``.weight_scale`` E8M0 block scales (one per
  32 values, stored as uint8 or float8_e8m0fnu) in the same cuBLAS 128x4 tiled layout as NVFP4's; decode =
  fp32 value times 2^(e - 127) (e = 0 decodes to 0, as comfy-kitchen does), product in fp32, then cast.
"""

from __future__ import annotations

import einops
import torch

from h3direct.checkpoint.quant.nvfp4 import unswizzle_block_scales
from h3direct.errors import CheckpointError

MX_BLOCK = 32


def dequantize_fp8_scaled(q: torch.Tensor, scale: torch.Tensor,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 weight and fp32 per-tensor scale -> dense weight in `out_dtype` (multiplied in `out_dtype`)."""
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"scaled fp8 weight must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    return q.to(out_dtype) * scale.to(out_dtype)


def e8m0_to_float32(e: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> 2^(e - 127) in fp32, with e = 0 mapped to 0."""
    bits = e.to(torch.int32) << 23
    return torch.where(e == 0, torch.zeros_like(bits), bits).view(torch.float32)


def dequantize_mxfp8(q: torch.Tensor, block_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     shape: tuple[int, int] | None = None) -> torch.Tensor:
    """MXFP8 weight [R, C] (C a multiple of 32) + tiled E8M0 scales -> dense [R, C] (or `shape`) in `out_dtype`."""
    # [R, C] fp8 -> [R, C] out_dtype
    rows, cols = q.shape
    if cols % MX_BLOCK:
        raise CheckpointError(f"MXFP8 weight has {cols} columns, not a multiple of {MX_BLOCK}")
    raw = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    scales = e8m0_to_float32(unswizzle_block_scales(raw, rows, cols // MX_BLOCK))
    blocks = einops.rearrange(q.to(torch.float32), "r (b k) -> r b k", k=MX_BLOCK) * scales[..., None]
    out = einops.rearrange(blocks, "r b k -> r (b k)").to(out_dtype)
    if shape is not None:
        out = out[: shape[0], : shape[1]]
    return out
