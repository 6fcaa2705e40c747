"""The H3 stereo audio VAE (32 kHz, 800 samples = one latent frame, 40 latent frames/s), fp32 only.

Encoder: DAC-style waveform encoder -> attention projection (`pre_block`) -> `mean_proj` (the posterior mean;
`logs_proj` is in the checkpoint but unused). Decoder: `dec_in_proj` -> BigVGAN. Left and right channels are
independent mono signals run as one batch. Latents [B, 32, 2, t] are normalised with the checkpoint's
`latents_mean` / `latents_std`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from h3direct.vae.audio_blocks import BigVGAN, WaveEncoder
from h3direct.vae.config import AudioVAEConfig


class GeGluMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class CausalAttention(nn.Module):
    """Causal self-attention whose head-averaged output is average-pooled from head_dim to `out_dim` features."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.empty(in_dim))
        self.v_bias = nn.Parameter(torch.empty(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, T, in_dim] -> [N, T, out_dim]
        bias = torch.cat([self.q_bias, self.zero_k_bias, self.v_bias])
        q, k, v = rearrange(F.linear(x, self.qkv.weight, bias), "n t (three h d) -> three n h t d", three=3,
                            h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).mean(dim=1)  # [N, T, head_dim]
        return self.proj(F.adaptive_avg_pool1d(y, self.out_dim))


class AttnProjection(nn.Module):
    """`pre_block`: latent_dim -> 32 features per frame (linear skip + causal attention, then a GeGLU MLP)."""

    def __init__(self, in_dim: int, out_dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        # skip path: proj(norm3(x)); attention path: attn(norm1(x)); then the MLP on norm2 of their sum
        self.proj, self.norm3 = nn.Linear(in_dim, out_dim), nn.LayerNorm(in_dim)
        self.attn, self.norm1 = CausalAttention(in_dim, out_dim, heads), nn.LayerNorm(in_dim)
        self.mlp, self.norm2 = GeGluMlp(out_dim, int(out_dim * mlp_ratio)), nn.LayerNorm(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, T, in_dim] -> [N, T, out_dim]
        x = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AudioVAE(nn.Module):
    def __init__(self, cfg: AudioVAEConfig | None = None):
        super().__init__()
        cfg = self.cfg = cfg or AudioVAEConfig()
        c = cfg.vae_latent_channels
        self.encoder = WaveEncoder(cfg.encoder_dim, cfg.encoder_rates, cfg.latent_dim)
        self.pre_block = AttnProjection(cfg.latent_dim, c, cfg.attn_heads, cfg.mlp_ratio)
        self.mean_proj = nn.Conv1d(c, c, 1)
        self.logs_proj = nn.Conv1d(c, c, 1)  # posterior log-scale: unused at inference
        self.dec_in_proj = nn.Conv1d(c, cfg.latent_dim, 1)
        self.decoder = BigVGAN(cfg.latent_dim, cfg.decoder_dim, cfg.upsample_rates, cfg.upsample_kernel_sizes,
                               cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        self.register_buffer("latents_mean", torch.zeros(c))
        self.register_buffer("latents_std", torch.ones(c))

    @property
    def device(self) -> torch.device:
        return self.dec_in_proj.weight.device

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latent [B, C, 2, t] -> waveform [B, 2, hop·t] in [-1, 1]."""
        b = z.shape[0]
        z = rearrange(z, "b c s t -> (b s) c t")
        z = z * self.latents_std.view(1, -1, 1) + self.latents_mean.view(1, -1, 1)
        wave = self.decoder(self.dec_in_proj(z))  # [(b s), 1, L]
        return rearrange(wave, "(b s) 1 l -> b s l", b=b)

    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """Waveform [B, 2, L] -> normalised latent [B, C, 2, ceil(L / hop)] (L right-padded with zeros)."""
        b, _, length = wave.shape
        hop = self.cfg.hop_length
        wave = F.pad(wave, (0, math.ceil(length / hop) * hop - length))
        h = self.encoder(rearrange(wave, "b s l -> (b s) 1 l"))  # [(b s), latent_dim, t]
        h = self.pre_block(h.transpose(1, 2)).transpose(1, 2)  # [(b s), C, t]
        z = self.mean_proj(h)
        z = (z - self.latents_mean.view(1, -1, 1)) / self.latents_std.view(1, -1, 1)
        return rearrange(z, "(b s) c t -> b c s t", b=b)
