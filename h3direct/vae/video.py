"""H3 video VAE modules: 3D causal CNN encoder, ViT3D decoder, and the VAE that holds both.

Module paths are the checkpoint's key paths (`encoder.down.5.block.0.conv1`, `decoder.transformer_blocks.3.attn.to_qkv`,
`post_quant_conv`, ...), so a ComfyUI-format state dict loads with no remapping. This file has single-shot
forwards only (one tile, one temporal clip); tiling, temporal chunking and latent normalisation live in
`video_tiling.py` / `api.py`.

Dtype: the whole module runs in one compute dtype (fp32 or fp16). Small derived constants (rope
frequencies, pixel mean/std) are rounded through that dtype, because ComfyUI keeps them as buffers that
`VAE(dtype=fp16)` casts with the weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from h3direct.vae.config import VIDEO_LATENTS_MEAN, VIDEO_LATENTS_STD, VideoVAEConfig

GROUPS = 32
GROUP_NORM_EPS = 1e-6

# --------------------------------------------------------------------------------------------- encoder


class CausalConv3d(nn.Module):
    """y = conv3d(pad(x)): space padded by reflection (p_h, p_w on both sides), time by 2·p_t zero frames
    in front only, so output frame i depends on input frames ≤ i.

    With T = 1 the kernel's first k_t − 1 temporal taps would only ever meet the zero frames, so the
    convolution runs with the last tap alone and no time padding (the same sum without the zero terms).
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride=(1, 1, 1), pad=(0, 0, 0)):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, kernel, kernel, kernel))
        self.bias = nn.Parameter(torch.empty(cout))
        self.stride = tuple(stride)
        self.pad_t, self.pad_h, self.pad_w = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, Cin, T, H, W] -> [B, Cout, T', H', W']
        if self.pad_h or self.pad_w:
            x = F.pad(x, (self.pad_w, self.pad_w, self.pad_h, self.pad_h, 0, 0), mode="reflect")
        if self.pad_t == 0:
            return F.conv3d(x, self.weight, self.bias, self.stride)
        if x.shape[2] == 1:
            return F.conv3d(x, self.weight[:, :, -1:], self.bias, self.stride)
        history = x.new_zeros(x.shape[0], x.shape[1], 2 * self.pad_t, *x.shape[3:])
        return F.conv3d(torch.cat([history, x], dim=2), self.weight, self.bias, self.stride)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm(32) of each frame on its own: mean and variance over (a group's channels, H, W) of one
    frame, never across frames."""

    def __init__(self, channels: int):
        super().__init__(GROUPS, channels, eps=GROUP_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, C, T, H, W] -> same
        t = x.shape[2]
        y = F.group_norm(rearrange(x, "b c t h w -> (b t) c h w"), GROUPS, self.weight, self.bias, self.eps)
        return rearrange(y, "(b t) c h w -> b c t h w", t=t)


class ResnetBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = FrameGroupNorm(cin)
        self.conv1 = CausalConv3d(cin, cout, 3, pad=(1, 1, 1))
        self.norm2 = FrameGroupNorm(cout)
        self.conv2 = CausalConv3d(cout, cout, 3, pad=(1, 1, 1))
        self.nin_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, Cin, T, H, W] -> [B, Cout, T, H, W]
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return h + skip


class Downsample3D(nn.Module):
    def __init__(self, channels: int, time_stride: int, space_stride: int):
        super().__init__()
        self.space_stride = space_stride
        self.conv = CausalConv3d(channels, channels, 3, stride=(time_stride, space_stride, space_stride),
                                 pad=(1, 0, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, C, T, H, W] -> [B, C, T/ts, H/ss, W/ss]; a stride-2 3-tap conv over H needs one extra
        # (reflected) row and column at the far edge to produce exactly H/2 × W/2 outputs
        extra = 1 if self.space_stride == 2 else 0
        return self.conv(F.pad(x, (0, extra, 0, extra, 0, 0), mode="reflect") if extra else x)


class EncoderLevel(nn.Module):
    """`encoder.down.{i}`: residual blocks, then an optional strided downsample."""

    def __init__(self, cin: int, cout: int, num_blocks: int, time_stride: int, space_stride: int):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock3D(cin if i == 0 else cout, cout) for i in range(num_blocks))
        self.downsample = Downsample3D(cout, time_stride, space_stride) if time_stride * space_stride > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.block:
            x = blk(x)
        return x if self.downsample is None else self.downsample(x)


class Encoder3D(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = CausalConv3d(cfg.in_channels, widths[0], 3, pad=(1, 1, 1))
        self.down = nn.ModuleList(
            EncoderLevel(widths[max(i - 1, 0)], widths[i], cfg.num_res_blocks, cfg.time_down[i], cfg.space_down[i])
            for i in range(len(widths))
        )
        self.norm_out = FrameGroupNorm(widths[-1])
        self.conv_out = CausalConv3d(widths[-1], 2 * cfg.z_channels, 3, pad=(1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, 3, T, H, W] normalised pixels -> [B, 2·z, T_lat, H/16, W/16]
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# --------------------------------------------------------------------------------------------- decoder


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] ×3 -> [B, S, H·D]; full (non-causal) softmax attention, NaN rows zeroed."""
    out = F.scaled_dot_product_attention(q, k, v)
    return rearrange(out, "b h s d -> b s (h d)").nan_to_num(0.0)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half rotation of the first 2·P dims of x [B, S, H, D]; cos/sin [B, S, 1, P] (their dtype computes)."""
    p = cos.shape[-1]
    x1, x2 = x[..., :p].to(cos.dtype), x[..., p : 2 * p].to(cos.dtype)
    rotated = torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * p :]], dim=-1)


class RMSNormWeight(nn.Module):
    """RMSNorm with a learned scale (only the weight is a parameter)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class DecoderAttention(nn.Module):
    def __init__(self, heads: int, dim_head: int, bias: bool, eps: float):
        super().__init__()
        self.heads, self.dim_head, self.eps = heads, dim_head, eps
        inner = heads * dim_head
        self.to_qkv = nn.Linear(inner, 3 * inner, bias=bias)
        self.to_out = nn.Linear(inner, inner, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # [B, S, dim] -> [B, S, dim]; the qkv features are laid out per head as (q, k, v)
        q, k, v = rearrange(self.to_qkv(x), "b s (h three d) -> three b s h d", three=3, d=self.dim_head)
        q = rope_rotate(F.rms_norm(q, (self.dim_head,), eps=self.eps), cos, sin)
        k = rope_rotate(F.rms_norm(k, (self.dim_head,), eps=self.eps), cos, sin)
        to_heads = lambda t: rearrange(t, "b s h d -> b h s d")  # noqa: E731
        return self.to_out(attention(to_heads(q), to_heads(k), to_heads(v)))


class GatedFeedForward(nn.Module):
    def __init__(self, dim: int, mult: int, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * mult * dim, bias=bias)
        self.w2 = nn.Linear(mult * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, S, dim] -> [B, S, dim]; w1's first half gates the second
        gate, value = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * value)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim = cfg.dim
        self.norm1 = RMSNormWeight(dim, cfg.eps)
        self.attn = DecoderAttention(cfg.heads, cfg.dim_head, cfg.bias, cfg.eps)
        self.scale1 = nn.Parameter(torch.empty(dim))
        self.norm2 = RMSNormWeight(dim, cfg.eps)
        self.ff = GatedFeedForward(dim, cfg.ff_mult, cfg.bias)
        self.scale2 = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # [B, S, dim] -> [B, S, dim]; layer-scaled pre-norm residuals
        x = torch.addcmul(x, self.attn(self.norm1(x), cos, sin), self.scale1.to(x.dtype))
        return torch.addcmul(x, self.ff(self.norm2(x)), self.scale2.to(x.dtype))


def cell_centres(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Centres of n equal cells of [-1, 1], computed in `dtype`: 2·(i + ½)/n − 1."""
    return torch.arange(0.5, n, dtype=dtype, device=device) / n * 2.0 - 1.0


class ViT3DDecoder(nn.Module):
    """Latent cells -> tokens -> transformer with 3-axis rope + register tokens -> pixel patches.

    Rope positions are the cell centres of the latent *tile* normalised to [-1, 1], so a token's
    position depends on the tile it sits in (see `api.py` on tile geometry).
    """

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.dim
        self.x_embedder = nn.Linear(cfg.z_channels, dim)
        self.register_tokens = nn.Parameter(torch.empty(1, cfg.num_register_tokens, dim))
        self.register_buffer("mask_token", torch.empty(1, 1, dim))  # training-only; kept for strict loading
        self.transformer_blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=cfg.eps)
        patch = cfg.out_ch * cfg.vae_ratio_t * cfg.vae_ratio**2
        self.proj_out = nn.Linear(dim, patch)

    def rope_tables(self, grid: tuple[int, int, int], batch: int, n_suffix: int, dtype, device):
        """cos, sin [B, S, 1, 3·P] for grid tokens then `n_suffix` tokens at position 0, in `dtype`."""
        cfg = self.cfg
        n_freq = cfg.rope_pairs_per_axis
        rope_dim = int(cfg.dim_head * cfg.rope_dim_ratio)
        exps = (torch.arange(n_freq, dtype=torch.float64) * (6 / rope_dim)).to(torch.float32)
        inv_freq = (1.0 / torch.pow(cfg.rope_theta, exps)).to(dtype).float().to(device)  # a buffer cast with the model
        axes = torch.meshgrid(*(cell_centres(n, dtype, device) for n in grid), indexing="ij")
        pos = torch.stack([a.reshape(-1) for a in axes], dim=-1)  # [t·h·w, 3]
        pos = torch.cat([pos, pos.new_zeros(n_suffix, 3)])
        angles = (2.0 * math.pi * pos.float()[:, :, None]) * inv_freq  # [S, 3, P]
        angles = rearrange(angles, "s a p -> s (a p)")[None, :, None, :].expand(batch, -1, -1, -1)
        return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        # [B, z, t, h, w] (post_quant_conv output) -> [B, 3, t·4, h·16, w·16] raw (ImageNet-normalised) pixels
        b, _, t, h, w = z.shape
        tokens = self.x_embedder(rearrange(z, "b c t h w -> b (t h w) c"))
        n = tokens.shape[1]
        suffix = [self.register_tokens.to(tokens.dtype).expand(b, -1, -1), tokens.new_zeros(b, 1, tokens.shape[-1])]
        x = torch.cat([tokens, *suffix], dim=1)
        cos, sin = self.rope_tables((t, h, w), b, x.shape[1] - n, tokens.dtype, tokens.device)
        for block in self.transformer_blocks:
            x = block(x, cos, sin)
        patches = self.proj_out(self.norm_out(x))[:, :n]
        cfg = self.cfg
        return rearrange(patches, "b (t h w) (c pt ph pw) -> b c (t pt) (h ph) (w pw)", t=t, h=h, w=w,
                         c=cfg.out_ch, pt=cfg.vae_ratio_t, ph=cfg.vae_ratio, pw=cfg.vae_ratio)


# --------------------------------------------------------------------------------------------- VAE


class VideoVAE(nn.Module):
    """The H3 video VAE: `encoder` + `quant_conv` (pixels -> moments), `post_quant_conv` + `decoder` (latent -> px)."""

    def __init__(self, cfg: VideoVAEConfig | None = None):
        super().__init__()
        cfg = self.cfg = cfg or VideoVAEConfig()
        self.encoder = Encoder3D(cfg)
        self.quant_conv = nn.Conv3d(2 * cfg.z_channels, 2 * cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv3d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = ViT3DDecoder(cfg)
        known = cfg.embed_dim == len(VIDEO_LATENTS_MEAN)
        self.register_buffer("latents_mean", torch.tensor(VIDEO_LATENTS_MEAN) if known else torch.zeros(cfg.embed_dim))
        self.register_buffer("latents_std", torch.tensor(VIDEO_LATENTS_STD) if known else torch.ones(cfg.embed_dim))

    # kept in float32 whatever the compute dtype; rounded through it where used (as ComfyUI's cast buffers are)
    FP32_KEYS = ("latents_mean", "latents_std")

    def set_compute_dtype(self, dtype: torch.dtype) -> VideoVAE:
        """Cast weights in place (fp16 <-> fp32); the latent statistics stay float32."""
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if name not in self.FP32_KEYS:
                t.data = t.data.to(dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, T, H, W] normalised pixels (one tile, one clip) -> [B, 2·embed, T_lat, H/16, W/16]."""
        return self.quant_conv(self.encoder(x))

    def decode_pixels(self, z: torch.Tensor) -> torch.Tensor:
        """[B, embed, t, h, w] de-normalised latent (one tile, one chunk) -> raw pixels [B, 3, 4t, 16h, 16w]."""
        return self.decoder(self.post_quant_conv(z))
