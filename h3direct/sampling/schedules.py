"""Sigma schedules for H3's flow sampling, numerically the same as ComfyUI's.

H3 samples one flow schedule shifted by the *video* shift (12 by default). The audio stream
rides on that schedule, carried ×(shift_video / shift_audio); the DiT derives the audio
stream's own sigma from the video one (`audio_sigma`).

A flow model's sigma table has `timesteps` entries: sigma(t) = s·t / (1 + (s − 1)·t) on
t = k / timesteps, k = 1..timesteps (float32). Schedulers pick from / interpolate that table.
"""

from __future__ import annotations

import math

import torch

from h3direct.errors import H3Error

SHIFT_VIDEO = 12.0
SHIFT_AUDIO = 3.0
TIMESTEPS = 1000
MULTIPLIER = 1000.0

SCHEDULERS = ("simple", "normal", "sgm_uniform")


def shifted(shift: float, t):
    """Flow time shift s·t / (1 + (s − 1)·t); identity for s == 1 (t: tensor or float)."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def audio_scale(shift_video: float = SHIFT_VIDEO, shift_audio: float | None = SHIFT_AUDIO) -> float:
    """Factor the sampler carries the audio latent by (1.0 when there is no audio shift)."""
    if shift_audio is None:
        return 1.0
    return shift_video / shift_audio


def audio_sigma(sigma_video, shift_video: float = SHIFT_VIDEO, shift_audio: float = SHIFT_AUDIO):
    """The audio stream's sigma for a video sigma: back to the unshifted grid, then the audio shift."""
    base = sigma_video / (shift_video + sigma_video * (1.0 - shift_video))
    return shift_audio * base / (1.0 + (shift_audio - 1.0) * base)


class FlowSigmas:
    """The discrete sigma table of a shifted flow model (float32 [timesteps], ascending)."""

    def __init__(self, shift: float = SHIFT_VIDEO, timesteps: int = TIMESTEPS, multiplier: float = MULTIPLIER):
        self.shift = float(shift)
        self.multiplier = multiplier
        grid = torch.arange(1, timesteps + 1, 1) / timesteps * multiplier  # float32 timesteps
        self.table = self.sigma(grid)

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.table[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.table[-1]

    def timestep(self, sigma):
        return sigma * self.multiplier

    def sigma(self, timestep):
        return shifted(self.shift, timestep / self.multiplier)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return shifted(self.shift, 1.0 - percent)


def _simple(fs: FlowSigmas, steps: int) -> torch.Tensor:
    n = len(fs.table)
    stride = n / steps
    picks = [float(fs.table[n - 1 - int(k * stride)]) for k in range(steps)]
    return torch.tensor(picks + [0.0], dtype=torch.float32)


def _normal(fs: FlowSigmas, steps: int, sgm: bool = False) -> torch.Tensor:
    t_hi, t_lo = fs.timestep(fs.sigma_max), fs.timestep(fs.sigma_min)
    end_with_zero = True
    if sgm:
        ts = torch.linspace(t_hi, t_lo, steps + 1)[:-1]
    else:
        if math.isclose(float(fs.sigma(t_lo)), 0, abs_tol=1e-5):
            steps, end_with_zero = steps + 1, False
        ts = torch.linspace(t_hi, t_lo, steps)
    vals = [float(fs.sigma(t)) for t in ts]
    if end_with_zero:
        vals.append(0.0)
    return torch.tensor(vals, dtype=torch.float32)


def scheduler_sigmas(scheduler: str, steps: int, shift: float = SHIFT_VIDEO) -> torch.Tensor:
    """Full schedule of `steps` steps (steps + 1 float32 sigmas ending in 0), like ComfyUI's schedulers."""
    fs = FlowSigmas(shift)
    if scheduler == "simple":
        return _simple(fs, steps)
    if scheduler == "normal":
        return _normal(fs, steps)
    if scheduler == "sgm_uniform":
        return _normal(fs, steps, sgm=True)
    raise H3Error(f"scheduler {scheduler!r} is not supported; use one of {', '.join(SCHEDULERS)}")


def sigmas_for(steps: int, scheduler: str = "simple", denoise: float = 1.0, shift: float = SHIFT_VIDEO) -> torch.Tensor:
    """KSampler's schedule: `steps` steps, or the last `steps` of a longer one when denoise < 1."""
    if steps < 1:
        raise H3Error(f"steps={steps}: need at least 1 sampling step")
    if denoise is None or denoise > 0.9999:
        return scheduler_sigmas(scheduler, steps, shift)
    if denoise <= 0.0:
        return torch.zeros(0, dtype=torch.float32)
    full = scheduler_sigmas(scheduler, int(steps / denoise), shift)
    return full[-(steps + 1):]
