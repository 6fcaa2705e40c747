"""Building blocks of the H3 audio VAE: snake activations, anti-aliased (kaiser-sinc) activation, the DAC-style
waveform encoder and the BigVGAN decoder. Weight norm is already folded into plain conv weights in the checkpoint.

Module paths follow the checkpoint (`encoder.block.1.block.0.block.1.weight`, `decoder.resblocks.4.convs1.2.bias`,
`decoder.ups.3.0.weight`, `...activations.5.upsample.filter`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------- activations


def snake(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x + sin²(αx) / (β + 1e-9)."""
    s = torch.sin(alpha * x)
    return (s * s) * torch.reciprocal(beta + 1e-9) + x


class Snake1d(nn.Module):
    """Encoder snake: one per-channel α [1, C, 1] (β = α)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha, self.alpha)


class SnakeBeta(nn.Module):
    """Decoder snake: α, β [C] stored as logarithms."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(channels))
        self.beta = nn.Parameter(torch.empty(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha.exp()[None, :, None], self.beta.exp()[None, :, None])


def _kaiser_beta(attenuation_db: float) -> float:
    """Kaiser's empirical window shape β for a stop-band attenuation A (dB):
    0.1102·(A − 8.7) above 50 dB, 0.5842·(A − 21)^0.4 + 0.07886·(A − 21) from 21 to 50 dB, else 0."""
    if attenuation_db > 50.0:
        return 0.1102 * (attenuation_db - 8.7)
    if attenuation_db < 21.0:
        return 0.0
    excess = attenuation_db - 21
    return 0.5842 * excess ** 0.4 + 0.07886 * excess


@functools.lru_cache(maxsize=64)
def _kaiser_sinc_filter_cached(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Low-pass FIR [1, 1, K] with unit DC gain.

    h[n] ∝ w[n] · 2f_c · sinc(2f_c · τ_n), with w a Kaiser window whose β follows from Kaiser's length
    estimate A = 2.285 · (K/2 − 1) · π · Δ + 7.95 for a transition width Δ = 4 · half_width; the taps sit at
    τ_n = n − K/2 + 1/2 for even K (symmetric about the centre gap) and τ_n = n − ⌊K/2⌋ for odd K.
    """
    half = kernel_size // 2
    window = torch.kaiser_window(kernel_size, periodic=False,
                                 beta=_kaiser_beta(2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95))
    offsets = torch.arange(-half, half) + 0.5 if kernel_size % 2 == 0 else torch.arange(kernel_size) - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * offsets)
    return (taps / taps.sum()).view(1, 1, kernel_size)


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Low-pass FIR [1, 1, K] (computed once per (cutoff, half_width, size), returned as a fresh copy)."""
    with torch.device("cpu"):
        return _kaiser_sinc_filter_cached(float(cutoff), float(half_width), int(kernel_size)).clone()


def _depthwise(filt: torch.Tensor, channels: int, like: torch.Tensor) -> torch.Tensor:
    return filt.to(like.dtype).expand(channels, -1, -1)


class UpSample1d(nn.Module):
    """×ratio upsampling by zero-stuffing + kaiser-sinc low-pass (a depthwise transposed conv), replicate edges."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.ratio = ratio
        self.pad = kernel_size // ratio - 1
        self.crop_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.register_buffer("filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, C, L] -> [B, C, ratio·L]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        y = F.conv_transpose1d(x, _depthwise(self.filter, x.shape[1], x), stride=self.ratio, groups=x.shape[1])
        y = y * self.ratio
        return y[..., self.crop_left : y.shape[-1] - self.crop_right]


class LowPassFilter1d(nn.Module):
    def __init__(self, cutoff: float, half_width: float, stride: int, kernel_size: int):
        super().__init__()
        self.pad_left = kernel_size // 2 - (1 if kernel_size % 2 == 0 else 0)
        self.pad_right = kernel_size // 2
        self.stride = stride
        self.register_buffer("filter", kaiser_sinc_filter(cutoff, half_width, kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, C, L] -> [B, C, L / stride]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, _depthwise(self.filter, x.shape[1], x), stride=self.stride, groups=x.shape[1])


class DownSample1d(nn.Module):
    def __init__(self, ratio: int = 2, kernel_size: int = 12):
        super().__init__()
        self.lowpass = LowPassFilter1d(0.5 / ratio, 0.6 / ratio, ratio, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class Activation1d(nn.Module):
    """Anti-aliased activation: upsample ×2, snake, downsample ×2."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act
        self.upsample = UpSample1d()
        self.downsample = DownSample1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


# --------------------------------------------------------------------------------------------- encoder


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation),
            Snake1d(dim),
            nn.Conv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        trim = (x.shape[-1] - y.shape[-1]) // 2
        if trim > 0:
            x = x[..., trim:-trim]
        return y + x


class EncoderBlock(nn.Module):
    """Three dilated residual units at dim/2 channels, then a strided conv to dim channels."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1),
            ResidualUnit(half, 3),
            ResidualUnit(half, 9),
            Snake1d(half),
            nn.Conv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class WaveEncoder(nn.Module):
    """`encoder.block`: conv(1 -> d), EncoderBlocks doubling the width, snake, conv(-> latent_dim)."""

    def __init__(self, d_model: int, strides: tuple[int, ...], d_latent: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv1d(1, d_model, 7, padding=3)]
        for s in strides:
            d_model *= 2
            layers.append(EncoderBlock(d_model, s))
        layers += [Snake1d(d_model), nn.Conv1d(d_model, d_latent, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, 1, L] -> [N, latent_dim, L / hop]
        return self.block(x)


# --------------------------------------------------------------------------------------------- decoder


class AMPBlock1(nn.Module):
    """BigVGAN residual block: per dilation, act -> dilated conv -> act -> conv, added to the input."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        same = lambda d: d * (kernel_size - 1) // 2  # noqa: E731
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=same(d)) for d in dilations)
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=same(1)) for _ in dilations)
        self.activations = nn.ModuleList(Activation1d(SnakeBeta(channels)) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, (c1, c2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            y = c2(self.activations[2 * k + 1](c1(self.activations[2 * k](x))))
            x = y + x
        return x


class BigVGAN(nn.Module):
    def __init__(self, num_mels: int, initial_channels: int, rates: tuple[int, ...], kernels: tuple[int, ...],
                 res_kernels: tuple[int, ...], res_dilations: tuple[tuple[int, ...], ...]):
        super().__init__()
        self.num_kernels = len(res_kernels)
        self.conv_pre = nn.Conv1d(num_mels, initial_channels, 7, padding=3)
        ch = initial_channels
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for u, k in zip(rates, kernels, strict=True):
            self.ups.append(nn.ModuleList([nn.ConvTranspose1d(ch, ch // 2, k, u, padding=(k - u) // 2)]))
            ch //= 2
            for rk, rd in zip(res_kernels, res_dilations, strict=True):
                self.resblocks.append(AMPBlock1(ch, rk, tuple(rd)))
        self.activation_post = Activation1d(SnakeBeta(ch))
        self.conv_post = nn.Conv1d(ch, 1, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, num_mels, t] -> [N, 1, t·prod(rates)] clamped to [-1, 1]
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            for layer in up:
                x = layer(x)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            acc = blocks[0](x)
            for blk in blocks[1:]:
                acc = acc + blk(x)
            x = acc / self.num_kernels
        return self.conv_post(self.activation_post(x)).clamp(-1.0, 1.0)
