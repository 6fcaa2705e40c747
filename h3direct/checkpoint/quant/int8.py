"""ComfyUI ``int8_tensorwise`` weights: int8 ``.weight`` times a float32 ``.weight_scale``.

The scale is a scalar (tensor-wise) or [N, 1] (per output row, which the ConvRot variant always uses).
With ConvRot (`comfy_quant` ``{"convrot": true, "convrot_groupsize": G}``) the stored weight was rotated by a
block-diagonal normalized regular Hadamard matrix over groups of G input features before quantizing; decoding
rotates it back (the matrix is symmetric and orthogonal, so the same rotation undoes it).

Bitwise equal to comfy-kitchen's `dequantize_int8_simple_dtype` / `dequantize_int8_convrot_weight_dtype`
(what `TensorWiseINT8Layout.dequantize` calls): product in fp32, rotation in fp32, then cast.
"""

from __future__ import annotations

import math

import einops
import torch

from h3direct.errors import CheckpointError

# the 4x4 regular Hadamard seed; sizes 4^n are its Kronecker powers
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


def regular_hadamard(size: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalized regular Hadamard matrix of `size` = 4^n (H @ H = I)."""
    n = round(math.log(size, 4)) if size >= 4 else 0
    if size < 4 or 4**n != size:
        raise CheckpointError(f"convrot_groupsize must be a power of 4 (>= 4), got {size}")
    h4 = torch.tensor(_H4, dtype=dtype, device=device)
    h = h4
    for _ in range(n - 1):
        h = torch.kron(h, h4)
    return h / (size**0.5)


def rotate_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] -> W with every group of `group_size` input features multiplied by the Hadamard matrix."""
    n, k = w.shape
    if k % group_size:
        raise CheckpointError(f"in_features {k} is not divisible by convrot_groupsize {group_size}")
    h = regular_hadamard(group_size, w.dtype, w.device)
    grouped = einops.rearrange(w, "n (g s) -> n g s", s=group_size)
    return einops.rearrange(torch.matmul(grouped, h.T), "n g s -> n (g s)")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                    convrot_groupsize: int | None = None) -> torch.Tensor:
    """int8 weight [N, K] and fp32 scale ([] or [N, 1]) -> dense [N, K] in `out_dtype`."""
    if q.dtype != torch.int8:
        raise CheckpointError(f"int8_tensorwise weight must be int8, got {q.dtype}")
    w = q.to(torch.float32) * scale
    if convrot_groupsize:
        w = rotate_groups(w, convrot_groupsize)
    return w.to(out_dtype)
