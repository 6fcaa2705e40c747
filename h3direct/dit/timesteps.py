"""Per-row timesteps and adaLN row selection.

The model is called with the video sigma (ComfyUI passes timestep = 1000·σ). Rows get t = 1 − σ of their
stream: text and video use σ_v, audio σ_a = shift_map(σ_v; 12 → 3); visual condition rows are pinned at
max(t_v, 0.999) and audio condition rows at max(t_a, 1.0). The distinct values, sorted ascending, index
the time embeddings; each adaLN projection emits `3` rows per timestep (one per modality tag:
0 video, 1 text, 2 audio), so a segment's modulation row is t_index · 3 + tag. Text rows take their tag
from the presentation (vision pads carry tag 0), split into runs.

Arithmetic on σ is done in float32 tensors (the oracle's precision), then turned into Python floats. A caller that
knows σ on the host (the sampler does) passes `host_stream_times`' result instead: the same floats, computed without
reading the device back.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from h3direct.dit.sequence import PackedLayout
from h3direct.sampling.schedules import audio_sigma

VISUAL_COND_TIMESTEP = 0.999
AUDIO_COND_TIMESTEP = 1.0
TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
MODALITIES = 3
SEGMENT_TAG = {"text": TAG_TEXT, "video": TAG_VIDEO, "cond": TAG_VIDEO, "ref_img": TAG_VIDEO,
               "audio": TAG_AUDIO, "cond_audio": TAG_AUDIO, "ref_audio": TAG_AUDIO}
CONDITION_KINDS = ("cond", "ref_img", "cond_audio", "ref_audio")  # rows that are given, never denoised


def sigma_from_timestep(timestep: torch.Tensor) -> torch.Tensor:
    """The model's σ_v from ComfyUI's timestep argument (1000·σ), float32, clamped away from 0."""
    return (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (ties to even). A +, −, × or ÷ of two float32 values done in double and then
    rounded here is the correctly rounded float32 result (double holds more than 2·24 + 2 bits), i.e. what a float32
    tensor op computes."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _shifted32(shift: float, u: float) -> float:
    """`schedules.shifted` on a float32 tensor, op for op (a Python scalar operand becomes a float32)."""
    if shift == 1.0:
        return u
    numerator = _f32(_f32(shift) * u)
    return _f32(numerator / _f32(1.0 + _f32(_f32(shift - 1.0) * u)))


def _unshifted32(shift: float, sigma: float) -> float:
    """`schedules.unshifted` on a float32 tensor, op for op."""
    return _f32(sigma / _f32(_f32(shift) - _f32(_f32(shift - 1.0) * sigma)))


_RECIPROCAL_1000 = _f32(1.0 / 1000.0)


def host_stream_times(sigma: float, *, shift_video: float, shift_audio: float,
                      device_type: str) -> tuple[float, float] | None:
    """(t_video, t_audio) = (1 − σ_v, 1 − σ_a) as `plan_timesteps` reads them back from a timestep tensor
    1000·σ (float32) on a device of `device_type`, bit for bit, computed on the host.

    The device ops are mirrored one by one in float32: timestep = σ·1000; σ_v = timestep / 1000 clamped at 1e-6,
    where CUDA divides a tensor by a host scalar as a product with the scalar's float32 reciprocal (the CPU divides);
    σ_a = audio_sigma(σ_v). None for a device type whose arithmetic is not mirrored here (the caller then reads
    the device)."""
    if device_type not in ("cpu", "cuda"):
        return None
    timestep = _f32(_f32(sigma) * 1000.0)
    if device_type == "cuda":
        sigma_v = _f32(timestep * _RECIPROCAL_1000)
    else:
        sigma_v = _f32(timestep / 1000.0)
    sigma_v = max(sigma_v, _f32(1e-6))
    sigma_a = _shifted32(shift_audio, _unshifted32(shift_video, sigma_v))
    return _f32(1.0 - sigma_v), _f32(1.0 - sigma_a)


@dataclass(frozen=True)
class ModRun:
    """Rows [start, stop) are modulated by adaLN row `row`."""

    start: int
    stop: int
    row: int


@dataclass
class TimestepPlan:
    values: list[float]  # distinct timesteps, ascending; index = time-embedding row
    runs: list[ModRun]  # covers the packed sequence contiguously
    video_row: int  # timestep index of the target video rows (final layer)
    audio_row: int  # timestep index of the target audio rows (final layer)


def plan_timesteps(layout: PackedLayout, timestep: torch.Tensor, *, shift_video: float = 12.0,
                   shift_audio: float = 3.0, text_tags: torch.Tensor | Sequence[int] | None = None,
                   visual_cond_aug: float = VISUAL_COND_TIMESTEP,
                   audio_cond_aug: float = AUDIO_COND_TIMESTEP,
                   times: tuple[float, float] | None = None) -> TimestepPlan:
    """Which time embedding and which adaLN row modulates each row of `layout`.

    t(kind) = 1 − σ of the kind's stream (σ_v for video and text, σ_a for audio); condition rows take
    max(t, aug) with aug = `visual_cond_aug` / `audio_cond_aug`. The distinct t values, ascending, are the
    rows of the time embedding; a run's adaLN row is index(t) · MODALITIES + tag.

    `times`: (t_video, t_audio) from `host_stream_times`, so that nothing is read back from `timestep`'s device;
    `text_tags` may be a host sequence of ints (read once by the caller) instead of a tensor.
    """
    if times is None:
        sigma_v = sigma_from_timestep(timestep)
        sigma_a = audio_sigma(sigma_v, shift_video, shift_audio)
        t_video, t_audio = float(1.0 - sigma_v), float(1.0 - sigma_a)
    else:
        t_video, t_audio = times
    floor = {TAG_VIDEO: float(visual_cond_aug), TAG_TEXT: None, TAG_AUDIO: float(audio_cond_aug)}

    def t_of(kind: str) -> float:
        tag = SEGMENT_TAG[kind]
        t = t_audio if tag == TAG_AUDIO else t_video
        return max(t, floor[tag]) if kind in CONDITION_KINDS else t

    # the targets are always present, so t_video and t_audio always get a row
    values = sorted({t_video, t_audio} | {t_of(seg.kind) for seg in layout.segments})
    row_of = {t: i for i, t in enumerate(values)}

    tags = host_tags(text_tags)
    runs: list[ModRun] = []
    for seg in layout.segments:
        first_row = row_of[t_of(seg.kind)] * MODALITIES
        if seg.kind != "text" or tags is None:
            runs.append(ModRun(seg.start, seg.stop, first_row + SEGMENT_TAG[seg.kind]))
            continue
        if len(tags) != seg.rows:
            raise ValueError(f"token tags cover {len(tags)} tokens, text segment has {seg.rows}")
        at = seg.start
        for tag, same in groupby(tags):  # vision pads inside the prompt carry the video tag
            width = sum(1 for _ in same)
            runs.append(ModRun(at, at + width, first_row + tag))
            at += width
    return TimestepPlan(values, runs, row_of[t_video], row_of[t_audio])


def host_tags(text_tags: torch.Tensor | Sequence[int] | None) -> list[int] | None:
    """The per-token modality tags as host ints (a tensor is read back: a synchronization on a GPU)."""
    if text_tags is None:
        return None
    if isinstance(text_tags, torch.Tensor):
        return [int(v) for v in text_tags.reshape(-1).tolist()]
    return [int(v) for v in text_tags]
