"""Token embeddings: video patchify (1×2×2), stereo audio packing, condition rows, the time embedder."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from h3direct.dit.linear import Linear


def patchify_video(latent: torch.Tensor, patch=(1, 2, 2)) -> torch.Tensor:
    """[1, C, T, H, W] -> [T·(H/2)·(W/2), C·1·2·2] rows, frame-major, channel-major within a row."""
    pt, ph, pw = patch
    return rearrange(latent, "b c (t pt) (h ph) (w pw) -> (b t h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)


def unpatchify_video(rows: torch.Tensor, t: int, h: int, w: int, channels: int, patch=(1, 2, 2)) -> torch.Tensor:
    """Inverse of patchify_video: [t·h·w, C·4] -> [1, C, t, 2h, 2w] (h, w in patches)."""
    pt, ph, pw = patch
    return rearrange(rows, "(b t h w) (c pt ph pw) -> b c (t pt) (h ph) (w pw)",
                     t=t, h=h, w=w, c=channels, pt=pt, ph=ph, pw=pw)


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """[1, C, 2, T] -> [2·T, C]: left channel's frames, then the right channel's."""
    return rearrange(latent[0], "c ch t -> (ch t) c")


def unpack_audio(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    """[2·T, C] -> [1, C, 2, T]."""
    return rearrange(rows, "(ch t) c -> c ch t", ch=channels).unsqueeze(0)


def augment_rows(rows: torch.Tensor, keep: float, seed: int) -> torch.Tensor:
    """keep·rows + (1 − keep)·N(0, 1), the noise from a CPU generator seeded afresh (ComfyUI restarts it for
    every condition latent, so equal-shaped conditions get the same noise)."""
    if keep >= 1.0:
        return rows
    gen = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(rows.shape, generator=gen, dtype=torch.float32)
    return keep * rows + (1.0 - keep) * noise.to(rows.device)


def condition_rows(video_latents: list[torch.Tensor], audio_latents: list[torch.Tensor], *, seed: int,
                   visual_keep: float, audio_keep: float, device, patch=(1, 2, 2)):
    """Patchified condition rows in payload order (fp32), or None where a kind is absent.

    Video conditions use generator seed `seed`, audio conditions `seed + 1`.
    """
    v = [augment_rows(patchify_video(z.float(), patch), visual_keep, seed).to(device) for z in video_latents]
    a = [augment_rows(pack_audio(z.float()), audio_keep, seed + 1).to(device) for z in audio_latents]
    return (torch.cat(v) if v else None), (torch.cat(a) if a else None)


def sinusoid_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 [M] -> [M, dim]: (cos(t·ω_0), …, cos(t·ω_{n−1}), sin(t·ω_0), …, sin(t·ω_{n−1})), n = dim / 2.

    The angular frequencies are geometric from 1 down towards 1/10000: ω_j = 10000^(−j/n), computed as
    exp(j · (−ln 10000) / n) in float32, j = 0..n−1.
    """
    n = dim // 2
    j = torch.arange(n, dtype=torch.float32, device=t.device)
    omega = torch.exp(-math.log(10000.0) * j / n)
    phase = torch.outer(t.to(torch.float32), omega)  # [M, n]
    return torch.cat([phase.cos(), phase.sin()], dim=1)


class TimeEmbedder(nn.Module):
    """t ∈ [0, 1] -> proj_out(SiLU(proj_in(sinusoid_features(t)))). Both linears are fp32 in the checkpoint."""

    def __init__(self, freq_dim: int, hidden: int, out: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = Linear(freq_dim, hidden, bias=True, island=True)
        self.proj_out = Linear(hidden, out, bias=True, island=True)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # t: [M] -> [M, out] float32
        hidden = F.silu(self.proj_in(sinusoid_features(t, self.freq_dim)))
        return self.proj_out(hidden)


def curve_embedding(table: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Curve-form time embedding: linear interpolation of `table` [grid, k] at t ∈ [0, 1] (clamped).

    pos = t·(grid − 1); the lower row is floor(pos), capped at grid − 2 so t = 1 blends the last interval.
    """
    pos = t.clamp(0.0, 1.0) * (table.shape[0] - 1)
    i0 = pos.floor().long().clamp(max=table.shape[0] - 2)
    return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))
