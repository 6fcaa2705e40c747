"""The sampler-facing side of the DiT, as ComfyUI's `MiniMaxH3Model.forward` + `BaseModel._apply_model`.

Sampler space: ComfyUI samples the packed (video, audio) latent on the *video* schedule and carries the
audio stream scaled by audio_scale = shift_video / shift_audio (12 / 3 = 4). The model call:

1. x is cast to the compute dtype; timestep = 1000·σ (float32);
2. the carried audio is brought back to its own σ_a: audio · (σ_a / σ_v);
3. the inner forward returns (−v_video, −v_audio);
4. the audio output is mapped back to the carried variable:
   out_a ← (1 − scale)·audio_own + (1 + (scale − 1)·σ_a)·out_a;
5. x0 = x − out·σ (float32), per stream.

A Denoiser keeps what its calls share (`model.StepInvariants`: layout, rope table, condition rows, text tags) and
plans each step from σ's host value (`sampling.host_sigma`: the sampler tags the σ tensors it passes; an untagged σ
is read back once and remembered), so a call after the first queues its GPU work without waiting for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3direct.dit.model import Conditioning, H3DiT, StepInvariants
from h3direct.dit.options import DEFAULT_OPTIONS, Options
from h3direct.dit.timesteps import host_stream_times, sigma_from_timestep
from h3direct.sampling import host_sigma
from h3direct.sampling.schedules import audio_sigma


def audio_scale_of(model: H3DiT) -> float:
    return model.config.sigma_shift_video / model.config.sigma_shift_audio


@dataclass(frozen=True)
class AudioCarry:
    """How the sampler's audio variable y relates to the audio stream's own latent a at one step.

    With σ_a the audio stream's own sigma for the step's video sigma σ_v (`audio_sigma`), the model sees
    a = r·y, r = σ_a / σ_v (cast to the latent's dtype). Its output u (the negated velocity of a) is handed
    back to the sampler as u_y = (1 − k)·a + (1 + (k − 1)·σ_a)·u, with k = audio_scale; this map is a fact of
    the oracle's H3 model wrapper, reproduced in the same float order.
    """

    ratio: torch.Tensor
    sigma_a: torch.Tensor
    scale: float

    @classmethod
    def at(cls, model: H3DiT, timestep: torch.Tensor, scale: float, dtype: torch.dtype) -> AudioCarry:
        c = model.config
        sigma_v = sigma_from_timestep(timestep)
        sigma_a = audio_sigma(sigma_v, c.sigma_shift_video, c.sigma_shift_audio)
        return cls((sigma_a / sigma_v).to(dtype), sigma_a, scale)

    def own(self, carried: torch.Tensor) -> torch.Tensor:
        return carried * self.ratio

    def output_for_sampler(self, own: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        latent_weight = 1.0 - self.scale
        output_weight = (1.0 + (self.scale - 1.0) * self.sigma_a).to(out.dtype)
        return latent_weight * own + output_weight * out


def model_forward(model: H3DiT, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor,
                  context: torch.Tensor, cond: Conditioning, *, audio_scale: float,
                  options: Options = DEFAULT_OPTIONS, layout=None,
                  invariants: StepInvariants | None = None, times: tuple[float, float] | None = None):
    """One model call on sampler-space (carried) audio: audio in and out are the sampler's variable y.
    `invariants`, `times`: see `H3DiT.forward_inner`."""
    carry = AudioCarry.at(model, timestep, audio_scale, audio.dtype) if audio_scale != 1.0 else None
    own_audio = audio if carry is None else carry.own(audio)
    for name, tensor in (("video", video), ("audio", own_audio), ("timestep", timestep), ("context", context)):
        model._record(f"dit_inner.in.{name}", tensor)
    out_v, out_a = model.forward_inner(video, own_audio, timestep, context, cond, options=options, layout=layout,
                                       invariants=invariants, times=times)
    model._record("dit_inner.out.video", out_v)
    model._record("dit_inner.out.audio", out_a)
    if carry is not None:
        out_a = carry.output_for_sampler(own_audio, out_a)
    return out_v, out_a


@dataclass
class Denoiser:
    """x0 prediction of one model call, in the sampler's space: `denoiser(x_video, x_audio, sigma)`."""

    model: H3DiT
    context: torch.Tensor  # [1, L, hidden] refined text (preprocess_text output), compute dtype
    cond: Conditioning
    audio_scale: float
    options: Options = DEFAULT_OPTIONS  # the generation's attention and kernel options

    def __post_init__(self):
        self._invariants = StepInvariants()

    @property
    def _layout(self):
        """The packed layout of the last call (None before the first)."""
        return self._invariants.layout

    def __call__(self, x_video: torch.Tensor, x_audio: torch.Tensor, sigma: torch.Tensor):
        m, c = self.model, self.model.config
        dtype = m.compute_dtype
        times = host_stream_times(host_sigma.read(sigma), shift_video=c.sigma_shift_video,
                                  shift_audio=c.sigma_shift_audio, device_type=sigma.device.type)
        sigma = sigma.reshape(-1)[:1].float()
        timestep = (sigma * 1000.0).float()
        v_in, a_in = x_video.to(dtype), x_audio.to(dtype)
        m._record("dit_forward.in.video", v_in)
        m._record("dit_forward.in.audio", a_in)
        m._record("dit_forward.in.timestep", timestep)
        with torch.no_grad():
            out_v, out_a = model_forward(m, v_in, a_in, timestep, self.context, self.cond,
                                         audio_scale=self.audio_scale, options=self.options,
                                         invariants=self._invariants, times=times)
        m._record("dit_forward.out.video", out_v)
        m._record("dit_forward.out.audio", out_a)
        s = sigma.reshape(1, *([1] * (x_video.ndim - 1)))
        x0_v = x_video - out_v.float() * s
        x0_a = x_audio - out_a.float() * sigma.reshape(1, *([1] * (x_audio.ndim - 1)))
        return x0_v, x0_a

