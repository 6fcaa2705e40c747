"""The NVFP4 storage geometry both the codec (`nvfp4`) and its Triton kernel (`nvfp4_triton`) stand on: 16-value
blocks, cuBLAS' 128x4 block-scale tiles, and the padded shapes they give."""

from __future__ import annotations

BLOCK = 16
# cuBLAS block-scale tile: 128 rows x 4 scale columns, stored as [32 rows][4 row groups][4 columns]
TILE_ROWS, TILE_COLS = 128, 4


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """Logical [N, K] -> the zero-padded shape ComfyUI quantizes ([N16, K16])."""
    n, k = shape
    return roundup(n, BLOCK), roundup(k, BLOCK)


def scale_storage_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """[rows, scale_cols] block scales -> shape of their swizzled storage (a whole number of 128x4 tiles)."""
    return roundup(rows, TILE_ROWS), roundup(scale_cols, TILE_COLS)
