"""H3 sampling loop in ComfyUI's sampler space, step for step the same arithmetic as ComfyUI.

Sampler space: the (video, audio) pair is packed into one flat float32 tensor [B, 1, Nv + Na]
(each stream flattened per batch row, video first). The clean latent is carried with its
audio part ×audio_scale (= shift_video / shift_audio, 4 for H3) when it is not all zeros; the
noise is not. x_T = σ0·noise + (1 − σ0)·latent. After the last step x / (1 − σ_last), then the
audio part ×(1 / audio_scale).

The model is a user callable `denoise(x_video, x_audio, sigma) -> (x0_video, x0_audio)` in that
space (audio carried), sigma a float32 tensor [B]; i.e. ComfyUI's `calculate_denoised` output.

The loop reads nothing back from the device: the sigmas are copied to the host once, control flow and callbacks use
those copies, and each σ tensor handed to the model carries its host value (`host_sigma.tag`), so a model that plans
on the host (`h3direct.dit.denoiser.Denoiser`) need not wait for the GPU either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h3direct.errors import H3Error
from h3direct.sampling import host_sigma

DenoiseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


@dataclass
class StepInfo:
    """What a per-step callback sees (sampler space, audio carried)."""

    index: int
    total: int
    sigma: float
    x_video: torch.Tensor
    x_audio: torch.Tensor
    x0_video: torch.Tensor
    x0_audio: torch.Tensor


@dataclass
class SampleOutput:
    video: torch.Tensor  # [B, 24, T, H, W] float32, model latent space (audio un-carried)
    audio: torch.Tensor  # [B, 32, 2, Ta] float32


class AVPack:
    """Packs (video, audio) into [B, 1, N] and back, like ComfyUI's pack_latents."""

    def __init__(self, video_shape, audio_shape):
        self.video_shape = tuple(video_shape)
        self.audio_shape = tuple(audio_shape)
        self.n_video = math.prod(self.video_shape[1:])

    def pack(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        b = video.shape[0]
        return torch.cat([video.reshape(b, 1, -1), audio.reshape(audio.shape[0], 1, -1)], dim=-1)

    def unpack(self, flat: torch.Tensor) -> tuple:
        b = flat.shape[0]
        video = flat[:, :, : self.n_video].reshape((b,) + self.video_shape[1:])
        audio = flat[:, :, self.n_video :].reshape((b,) + self.audio_shape[1:])
        return video, audio

    def scale_audio(self, flat: torch.Tensor, factor: float) -> torch.Tensor:
        if factor == 1.0:
            return flat
        flat = flat.clone()
        flat[..., self.n_video :] *= factor
        return flat


def _full_mask(mask: torch.Tensor | None, shape, name: str) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.float32)
    mask = mask.to(torch.float32)
    if mask.ndim != len(shape) or mask.shape[2:] != tuple(shape[2:]) or mask.shape[1] not in (1, shape[1]):
        raise H3Error(f"{name} has shape {tuple(mask.shape)}; expected [B, 1 or {shape[1]}, {', '.join(map(str, shape[2:]))}]")
    return mask.expand((shape[0], shape[1]) + tuple(shape[2:])).contiguous()


def _flow_noise_scaling(sigma: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    sigma = sigma.reshape(()) if sigma.numel() == 1 else sigma.reshape((-1,) + (1,) * (noise.ndim - 1))
    return sigma * (1.0 * noise) + (1.0 - sigma) * latent


def _derivative(x: torch.Tensor, sigma: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The probability-flow slope dx/dσ = (x − x0) / σ, σ broadcast over x's trailing dims."""
    return (x - x0) / sigma[(...,) + (None,) * (x.ndim - sigma.ndim)]


def _batch_sigma(s: torch.Tensor, ones: torch.Tensor, host: float) -> torch.Tensor:
    """σ for every batch row (s · ones), tagged with its host value."""
    return host_sigma.tag(s * ones, host)


def _euler(model, x, sigmas, on_step, host):
    """First order: x ← x + (dx/dσ)·(σ_next − σ)."""
    ones = x.new_ones([x.shape[0]])
    for i, (s, s_next) in enumerate(zip(sigmas[:-1], sigmas[1:], strict=True)):
        x0 = model(x, _batch_sigma(s, ones, host[i]))
        on_step(i, x, x0)
        x = x + _derivative(x, s, x0) * (s_next - s)
    return x


def _heun(model, x, sigmas, on_step, host):
    """Second order (trapezoid): an Euler predictor x̃ = x + d·Δσ, then x ← x + (d + d̃)/2·Δσ with d̃ the slope
    at (x̃, σ_next). The step to σ = 0 keeps the Euler predictor (the slope is undefined at σ = 0)."""
    ones = x.new_ones([x.shape[0]])
    for i, (s, s_next) in enumerate(zip(sigmas[:-1], sigmas[1:], strict=True)):
        x0 = model(x, _batch_sigma(s, ones, host[i]))
        on_step(i, x, x0)
        slope, dt = _derivative(x, s, x0), s_next - s
        predicted = x + slope * dt
        if host[i + 1] == 0:
            x = predicted
            continue
        slope_end = _derivative(predicted, s_next, model(predicted, _batch_sigma(s_next, ones, host[i + 1])))
        x = x + (slope + slope_end) / 2 * dt
    return x


def _dpmpp_2m(model, x, sigmas, on_step, host):
    """DPM-Solver++(2M): second-order multistep in λ = −log σ.

    With h = λ_next − λ: x ← (e^(−λ_next) / e^(−λ))·x − (e^(−h) − 1)·D. D is the model's x0 on the first step
    and on the step to σ = 0; otherwise the linear extrapolation D = (1 + 1/(2r))·x0 − 1/(2r)·x0_prev through
    the previous step's x0, with r = h_prev / h.
    """
    ones = x.new_ones([x.shape[0]])

    def lam(i: int) -> torch.Tensor:
        return sigmas[i].log().neg()

    x0_prev = None
    for i in range(len(sigmas) - 1):
        x0 = model(x, _batch_sigma(sigmas[i], ones, host[i]))
        on_step(i, x, x0)
        lam_now, lam_next = lam(i), lam(i + 1)
        h = lam_next - lam_now
        target = x0
        if x0_prev is not None and host[i + 1] != 0:
            w = 1 / (2 * ((lam_now - lam(i - 1)) / h))  # 1 / (2r)
            target = (1 + w) * x0 - w * x0_prev
        x = (lam_next.neg().exp() / lam_now.neg().exp()) * x - (-h).expm1() * target
        x0_prev = x0
    return x


_SAMPLER_FNS = {"euler": _euler, "heun": _heun, "dpmpp_2m": _dpmpp_2m}


def sample(
    denoise: DenoiseFn,
    noise_video: torch.Tensor,
    noise_audio: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    latent_video: torch.Tensor | None = None,
    latent_audio: torch.Tensor | None = None,
    sampler: str = "euler",
    audio_scale: float = 4.0,
    cfg: float = 1.0,
    denoise_negative: DenoiseFn | None = None,
    mask_video: torch.Tensor | None = None,
    mask_audio: torch.Tensor | None = None,
    callback: Callable[[StepInfo], None] | None = None,
) -> SampleOutput:
    """Run `sampler` over `sigmas` (float32 [steps+1]); returns the final (video, audio) latents.

    latent_*: the starting clean latent (zeros when omitted; ComfyUI skips the audio carry for an
    all-zero latent). mask_*: denoise masks (1 = generate, 0 = keep latent), [B, 1|C, ...] per stream.
    cfg != 1 needs `denoise_negative`; x0 = neg + (pos − neg)·cfg.
    """
    use_cfg = not math.isclose(cfg, 1.0)
    if use_cfg and denoise_negative is None:
        raise H3Error(f"cfg={cfg} needs a negative prompt conditioning (cfg 1 runs without one)")
    sigmas = sigmas.to(torch.float32)
    host = sigmas.detach().cpu().tolist()  # the one read-back of the loop
    pk = AVPack(noise_video.shape, noise_audio.shape)
    noise = pk.pack(noise_video.to(torch.float32), noise_audio.to(torch.float32))
    if latent_video is None:
        latent_video = torch.zeros(pk.video_shape)
    if latent_audio is None:
        latent_audio = torch.zeros(pk.audio_shape)
    latent = pk.pack(latent_video.to(torch.float32), latent_audio.to(torch.float32))
    if len(sigmas) == 0:
        return SampleOutput(latent_video, latent_audio)
    if torch.count_nonzero(latent) > 0:
        latent = pk.scale_audio(latent, audio_scale)

    mask = None
    if mask_video is not None or mask_audio is not None:
        mask = pk.pack(_full_mask(mask_video, pk.video_shape, "mask_video"), _full_mask(mask_audio, pk.audio_shape, "mask_audio"))

    def guided(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        xv, xa = pk.unpack(x)
        pos = pk.pack(*denoise(xv, xa, sigma))
        if not use_cfg:
            return pos
        neg = pk.pack(*denoise_negative(xv, xa, sigma))
        return neg + (pos - neg) * cfg

    def model(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        if mask is None:
            return guided(x, sigma)
        keep = 1.0 - mask
        x = x * mask + _flow_noise_scaling(sigma, noise, latent) * keep
        return guided(x, sigma) * mask + latent * keep

    def on_step(i: int, x: torch.Tensor, x0: torch.Tensor) -> None:
        if callback is None:
            return
        xv, xa = pk.unpack(x)
        x0v, x0a = pk.unpack(x0)
        callback(StepInfo(i, len(sigmas) - 1, host[i], xv, xa, x0v, x0a))

    x = _flow_noise_scaling(sigmas[0], noise, latent)
    x = _SAMPLER_FNS[sampler](model, x, sigmas, on_step, host)
    last = sigmas[-1]
    x = x / (1.0 - last)
    x = pk.scale_audio(x.to(torch.float32), 1.0 / audio_scale)
    video, audio = pk.unpack(x)
    return SampleOutput(video, audio)
