"""Synthetic q, k, v at the packed positions of a Ref2VA workload, for measuring attention backends.

- `structured_qkv`: what a video DiT's attention looks like: per-head shared directions plus a smooth random field
  over the packed sequence's real (t, h, w) positions, then per-head RMSNorm and H3's 3-axis rope (96 of 128 dims),
  so scores fall off with distance in time and space;
- `random_qkv`: i.i.d. normal q, k, v (no locality: pessimistic for quantized and meaningless for sparse methods).
Both are [1, H, S, D] bf16 and deterministic for a seed (drawn on the CPU).
"""

from __future__ import annotations

import math

import torch

from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table
from h3direct.dit.sequence import build_layout
from h3direct.sampling.conditioning import latent_shapes


def positions(seq: int | None = None, *, width: int = 960, height: int = 544, frames: int = 124,
              text_len: int = 256) -> tuple[torch.Tensor, int]:
    """([S, 3] float64 rope positions, rows before the target video) of the Ref2VA packed sequence with one
    reference image at the canvas (the benchmark workload by default), cut to its first `seq` rows if given."""
    _, (_, _, t, h, w), (*_, audio_t) = latent_shapes(width, height, frames)
    ref = {"kind": "image", "latent_t": 1, "latent_h": h + h % 2, "latent_w": w + w % 2}
    layout = build_layout(text_len, t, h + h % 2, w + w % 2, audio_t, refs=[ref])
    pos, prefix = layout.position_ids, layout.segment("video").start
    if seq is not None and seq < pos.shape[0]:
        pos, prefix = pos[:seq], min(prefix, seq)
    return pos, prefix


def structured_qkv(pos: torch.Tensor, heads: int, dim: int, device, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v [1, heads, S, dim] bf16 whose attention is local in (t, h, w); `dim` >= 96 (the rotated dims)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    s = pos.shape[0]
    p = pos.to(torch.float32)

    def field(scale):  # smooth random field over positions: 16 random plane waves per (head, channel group)
        freqs = torch.randn(16, 3, generator=g) * torch.tensor([0.15, 0.3, 0.3])
        phase = torch.rand(16, generator=g) * 2 * math.pi
        waves = torch.cos(p @ freqs.T + phase)  # [S, 16]
        mix = torch.randn(16, heads * dim, generator=g) / 4.0
        return (waves @ mix).reshape(s, heads, dim) * scale

    def one(shared_scale, field_scale, noise_scale):
        base = torch.randn(1, heads, dim, generator=g) * shared_scale
        return base + field(field_scale) + torch.randn(s, heads, dim, generator=g) * noise_scale

    q, k, v = one(1.0, 1.0, 0.3), one(1.0, 1.0, 0.3), one(0.5, 1.0, 0.5)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(16, dtype=torch.float32) / 16))
    table = rotation_table(rope_angles(pos, inv_freq), torch.float32)
    ones = torch.ones(dim)
    q = rms_norm_rope(q[None], ones, table, 1e-6)[0]
    k = rms_norm_rope(k[None], ones, table, 1e-6)[0]
    return [x.transpose(0, 1)[None].to(device=device, dtype=torch.bfloat16) for x in (q, k, v)]


def random_qkv(seq: int, heads: int, dim: int, device, seed: int = 1) -> list[torch.Tensor]:
    """i.i.d. normal q, k, v [1, heads, seq, dim] bf16."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(1, heads, seq, dim, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(3)]
