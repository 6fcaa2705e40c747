"""Sigma schedules for H3's flow sampling (the same float32 numbers as ComfyUI's schedulers).

H3 samples one flow schedule shifted by the *video* shift (12 by default). The audio stream
rides on that schedule, carried ×(shift_video / shift_audio); the DiT derives the audio
stream's own sigma from the video one (`audio_sigma`).

The math. A flow shift s > 0 warps the model's time u ∈ [0, 1] into a noise level

    σ = shift_s(u) = s·u / (1 + (s − 1)·u),        inverse: u = σ / (s − (s − 1)·σ).

The model knows N = 1000 discrete levels σ_k = shift_s(k / N), k = 1..N (`FlowSigmas.table`), and
is called with timestep τ = 1000·σ. A scheduler turns a step count into a descending float32
list of sigmas from σ_N = 1 down, ending in 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from h3direct.sampling.rules import SCHEDULERS  # noqa: F401  (the names a request may ask for)

SHIFT_VIDEO = 12.0
SHIFT_AUDIO = 3.0
TIMESTEPS = 1000  # N, the number of discrete noise levels
MULTIPLIER = 1000.0  # timestep units per unit of sigma

_ZERO_SIGMA = 1e-5  # a lowest level this close to 0 already ends the 'normal' schedule


def shifted(shift: float, t):
    """shift_s(u) = s·u / (1 + (s − 1)·u) for a tensor or float u; s == 1 is the identity."""
    if shift == 1.0:
        return t
    numerator = shift * t
    return numerator / (1 + (shift - 1) * t)


def unshifted(shift: float, sigma):
    """The inverse map u = σ / (s − (s − 1)·σ), for a tensor or float σ."""
    return sigma / (shift - (shift - 1.0) * sigma)


def audio_scale(shift_video: float = SHIFT_VIDEO, shift_audio: float | None = SHIFT_AUDIO) -> float:
    """Factor the sampler carries the audio latent by (1.0 when there is no audio shift)."""
    if shift_audio is None:
        return 1.0
    return shift_video / shift_audio


def audio_sigma(sigma_video, shift_video: float = SHIFT_VIDEO, shift_audio: float = SHIFT_AUDIO):
    """σ_a = shift_{s_a}(u) where u is the common model time behind σ_v = shift_{s_v}(u)."""
    return shifted(shift_audio, unshifted(shift_video, sigma_video))


@dataclass(frozen=True)
class FlowSigmas:
    """The N discrete noise levels of a flow model with shift `shift`, and its σ ↔ timestep maps."""

    shift: float = SHIFT_VIDEO
    levels: int = TIMESTEPS

    def __post_init__(self):
        object.__setattr__(self, "shift", float(self.shift))

    @cached_property
    def table(self) -> torch.Tensor:
        """float32 [N], ascending: σ_k = shift_s(k / N). Each k / N passes through timestep units (×1000,
        then ÷1000 in `to_sigma`) in float32, which is how the oracle's table rounds; keep it that way."""
        in_timestep_units = torch.arange(1, self.levels + 1) / self.levels * MULTIPLIER
        return self.to_sigma(in_timestep_units)

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.table[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.table[-1]

    def to_timestep(self, sigma):
        return sigma * MULTIPLIER

    def to_sigma(self, timestep):
        return shifted(self.shift, timestep / MULTIPLIER)

    def percent_to_sigma(self, percent: float) -> float:
        """σ after a fraction p of sampling, shift_s(1 − p): 1 at or before the start, 0 at or after the end."""
        if percent <= 0.0:
            return 1.0
        return 0.0 if percent >= 1.0 else shifted(self.shift, 1.0 - percent)


def _simple(fs: FlowSigmas, steps: int) -> torch.Tensor:
    """Strided picks from the table, top down: step k takes the level int(k·N/steps) below σ_max."""
    top_down = fs.table.flip(0)
    stride = len(top_down) / steps
    picks = top_down[[int(k * stride) for k in range(steps)]]
    return torch.cat([picks, torch.zeros(1)])


def _uniform_timesteps(fs: FlowSigmas, steps: int, sgm: bool = False) -> torch.Tensor:
    """Evenly spaced in timestep units between τ_max = 1000·σ_max and τ_min = 1000·σ_min, mapped to σ.

    'normal': `steps` points including both ends, then 0. 'sgm_uniform' (sgm=True): steps + 1 points
    with τ_min dropped, then 0. When σ(τ_min) is already ~0, 'normal' takes steps + 1 points instead
    and appends no 0 (it cannot happen for a shifted flow table, whose σ_min is shift_s(1/N) > 0).
    """
    tau_max, tau_min = fs.to_timestep(fs.sigma_max), fs.to_timestep(fs.sigma_min)
    tail = [torch.zeros(1)]
    if sgm:
        taus = torch.linspace(tau_max, tau_min, steps + 1)[:-1]
    elif abs(float(fs.to_sigma(tau_min))) <= _ZERO_SIGMA:
        taus, tail = torch.linspace(tau_max, tau_min, steps + 1), []
    else:
        taus = torch.linspace(tau_max, tau_min, steps)
    return torch.cat([fs.to_sigma(taus), *tail])


def scheduler_sigmas(scheduler: str, steps: int, shift: float = SHIFT_VIDEO) -> torch.Tensor:
    """Full schedule of `steps` steps (steps + 1 float32 sigmas ending in 0), like ComfyUI's schedulers."""
    fs = FlowSigmas(shift)
    build = {"simple": _simple,  # the names of SCHEDULERS (a request checks the name: `app/request.py`)
             "normal": _uniform_timesteps,
             "sgm_uniform": lambda fs_, n: _uniform_timesteps(fs_, n, sgm=True)}[scheduler]
    return build(fs, steps)


def sigmas_for(steps: int, scheduler: str = "simple", denoise: float = 1.0, shift: float = SHIFT_VIDEO) -> torch.Tensor:
    """KSampler's schedule: `steps` steps, or the last `steps` of a longer one when denoise < 1.

    A partial denoise d runs the tail of a schedule of int(steps / d) steps, so it starts from a lower σ
    with the same step density; d ≤ 0 runs nothing (an empty schedule).
    """
    full_run = denoise is None or denoise > 0.9999
    if full_run:
        return scheduler_sigmas(scheduler, steps, shift)
    if denoise <= 0.0:
        return torch.zeros(0, dtype=torch.float32)
    longer = scheduler_sigmas(scheduler, int(steps / denoise), shift)
    return longer[len(longer) - (steps + 1):]
