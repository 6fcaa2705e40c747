"""Per-row timesteps and adaLN row selection.

The model is called with the video sigma (ComfyUI passes timestep = 1000·σ). Rows get t = 1 − σ of their
stream: text and video use σ_v, audio σ_a = shift_map(σ_v; 12 → 3); visual condition rows are pinned at
max(t_v, 0.999) and audio condition rows at max(t_a, 1.0). The distinct values, sorted ascending, index
the time embeddings; each adaLN projection emits `3` rows per timestep (one per modality tag:
0 video, 1 text, 2 audio), so a segment's modulation row is t_index · 3 + tag. Text rows take their tag
from the presentation (vision pads carry tag 0), split into runs.

Arithmetic on σ is done in float32 tensors as ComfyUI does, then turned into Python floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3direct.dit.layout import PackedLayout

VISUAL_COND_TIMESTEP = 0.999
AUDIO_COND_TIMESTEP = 1.0
TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2
MODALITIES = 3
SEGMENT_TAG = {"text": TAG_TEXT, "video": TAG_VIDEO, "cond": TAG_VIDEO, "ref_img": TAG_VIDEO,
               "audio": TAG_AUDIO, "cond_audio": TAG_AUDIO, "ref_audio": TAG_AUDIO}


def time_shift_sigma(sigma, from_shift: float, to_shift: float):
    """Map σ between two flow shifts: undo σ = s·b/(1 + (s−1)·b) for `from_shift`, re-apply `to_shift`."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def sigma_from_timestep(timestep: torch.Tensor) -> torch.Tensor:
    """The model's σ_v from ComfyUI's timestep argument (1000·σ), float32, clamped away from 0."""
    return (timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6)


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
    sigma_v: torch.Tensor  # float32 scalar
    sigma_a: torch.Tensor  # float32 scalar


def plan_timesteps(layout: PackedLayout, timestep: torch.Tensor, *, shift_video: float = 12.0,
                   shift_audio: float = 3.0, text_tags: torch.Tensor | None = None,
                   visual_cond_aug: float = VISUAL_COND_TIMESTEP,
                   audio_cond_aug: float = AUDIO_COND_TIMESTEP) -> TimestepPlan:
    sigma_v = sigma_from_timestep(timestep)
    sigma_a = time_shift_sigma(sigma_v, shift_video, shift_audio)
    t_v = float(1.0 - sigma_v)
    t_a = float(1.0 - sigma_a)
    seg_t = {"text": t_v, "video": t_v, "audio": t_a,
             "cond": max(t_v, float(visual_cond_aug)), "ref_img": max(t_v, float(visual_cond_aug)),
             "cond_audio": max(t_a, float(audio_cond_aug)), "ref_audio": max(t_a, float(audio_cond_aug))}
    distinct = {t_v, t_a}
    if layout.has("cond", "ref_img"):
        distinct.add(seg_t["cond"])
    if layout.has("cond_audio", "ref_audio"):
        distinct.add(seg_t["ref_audio"])
    values = sorted(distinct)
    index = {t: i for i, t in enumerate(values)}

    tags = None if text_tags is None else [int(v) for v in text_tags.reshape(-1).tolist()]
    runs: list[ModRun] = []
    for seg in layout.segments:
        base = index[seg_t[seg.kind]] * MODALITIES
        if seg.kind == "text" and tags is not None:
            if len(tags) != seg.rows:
                raise ValueError(f"token tags cover {len(tags)} tokens, text segment has {seg.rows}")
            i = 0
            while i < seg.rows:  # one run per maximal span of equal tags
                j = i
                while j < seg.rows and tags[j] == tags[i]:
                    j += 1
                runs.append(ModRun(seg.start + i, seg.start + j, base + tags[i]))
                i = j
        else:
            runs.append(ModRun(seg.start, seg.stop, base + SEGMENT_TAG[seg.kind]))
    return TimestepPlan(values, runs, index[t_v], index[t_a], sigma_v, sigma_a)
