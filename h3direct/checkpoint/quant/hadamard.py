"""The random-sign block-Hadamard rotation the 8-bit paths share: R = diag(signs) · blockdiag(H_b, …, H_b), with H_b
the Sylvester Hadamard matrix of entries ±1 and b the largest power of two dividing the dimension (at most
`MAX_BLOCK`); divided by √b it is orthogonal. Rotating both factors of a product by it leaves the product as it is,
(x·R)·(y·R)ᵀ = x·yᵀ·(R·Rᵀ), and spreads each vector's energy over its b channels of a block, so that a scale set by the
largest element (per token, per head) wastes less of the 8-bit grid on outlier channels (QuaRot; FlashAttention-3's
"incoherent processing"). fa3_fp8 rotates q and k (`dit/fp8_attention.py`), the int8 block linears their inputs and
weights (`w8a8.linear_int8`, option `fp8_linear_rotate`).
"""

from __future__ import annotations

import functools

import torch

MAX_BLOCK = 128
SEED = 20240711  # the signs' generator seed (any fixed value: both factors must share them)


def block(d: int) -> int:
    """The size of the Hadamard blocks for dimension d: its largest power-of-two divisor, at most MAX_BLOCK."""
    return min(d & -d, MAX_BLOCK)


@functools.cache
def signed_hadamard(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs [d] of ±1, H_b [b, b] of ±1), fp32 on the CPU."""
    b = block(d)
    h = torch.ones(1, 1)
    while h.shape[0] < b:  # Sylvester: H_2n = [[H, H], [H, −H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(SEED))
    return signs, h


@functools.cache
def operands(d: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`signed_hadamard(d)` on `device` in `dtype`, made once (a copy inside the DiT step would wait for the stream)."""
    signs, h = signed_hadamard(d)
    return signs.to(device, dtype), h.to(device, dtype)


def rotate_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., d] · diag(signs) · blockdiag(H_b) (not divided by √b: the product of two rotated factors is b times
    the plain one), in t's dtype: the ±1 entries are exact there; a low-precision t is rounded once, after the
    block products (accumulated in fp32)."""
    d = t.shape[-1]
    signs, h = operands(d, t.device, t.dtype)
    b = h.shape[0]
    return ((t * signs).reshape(-1, d // b, b) @ h).reshape(t.shape)
