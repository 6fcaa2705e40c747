"""Packed sequence layout of one H3 forward and its float64 rope positions.

Rows, in order: text | fl2va keyframes (video rows, then audio rows, per keyframe) | references (in
`minimax_refs` order) | target audio | target video. Positions are (t, h, w) float64 triples:

- text token i sits at (i, 0, 0);
- a video frame's 2×2-patch rows sit on an area-normalised grid: per axis,
  ((k · ratio/n) + (1 − ratio)/2) · 32 for k < n = dim/2, ratio = dim / sqrt(h·w);
- latent video frames advance t by 5/3 · (1, 4, 4, 4, 4, 1, 4, …) (the first latent frame holds one pixel
  frame, later ones four), starting at the segment's origin;
- stereo audio rows are channel-major; t advances 1 per latent frame, h = 0, and w is pinned to the
  grid's lowest (left channel) / highest (right channel) w coordinate;
- references stack along t after the text: an image takes 1, an audio clip its latent length, a video
  max(audio length, its video span); the targets start after all references;
- a keyframe at pixel frame f sits at target origin + 5/3 · f.

Facts from ComfyUI's `comfy/ldm/minimax/model.py` (PackedLayout); float64 arithmetic is done in the same
order so positions are bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0

VIDEO_KINDS = ("cond", "ref_img", "video")  # rows embedded by video_patch_proj
AUDIO_KINDS = ("cond_audio", "ref_audio", "audio")  # rows embedded by audio_patch_proj
REF_KINDS = ("image", "audio", "video", "video_audio")


@dataclass(frozen=True)
class Segment:
    start: int
    stop: int
    kind: str  # text | cond | cond_audio | ref_img | ref_audio | audio | video

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass
class PackedLayout:
    segments: list[Segment]
    position_ids: torch.Tensor  # [S, 3] float64
    signature: tuple[int, int, int, int, int]  # text_len, latent_t, latent_h (padded), latent_w (padded), audio_t
    meta: dict = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.segments[-1].stop

    def segment(self, kind: str) -> Segment:
        """The (single) segment of a target stream: 'audio' or 'video'."""
        return next(s for s in self.segments if s.kind == kind)

    def has(self, *kinds: str) -> bool:
        return any(s.kind in kinds for s in self.segments)

    def manifest(self) -> list[list]:
        return [[s.start, s.stop, s.kind] for s in self.segments]


def grid_axis(dim: int, sqrt_area: float, patch: int = 2) -> torch.Tensor:
    """Area-normalised coordinates of the `dim // patch` patch centres along one axis, float64."""
    ratio = dim / sqrt_area
    n = dim // patch
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * 32.0


def frame_grid(latent_h: int, latent_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(h/2)·(w/2), 2] (h, w) coordinates of one latent frame's patch rows, and the w axis alone."""
    sqrt_area = math.sqrt(latent_h * latent_w)
    hs, ws = grid_axis(latent_h, sqrt_area), grid_axis(latent_w, sqrt_area)
    hh, ww = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), ws


def video_spans(n_frames: int) -> list[float]:
    return [FRAME_RESCALE * FRAME_PER_TOKEN[k % len(FRAME_PER_TOKEN)] for k in range(n_frames)]


def video_positions(n_frames: int, frame: torch.Tensor, origin: float) -> torch.Tensor:
    """[n_frames · rows_per_frame, 3]: frame k at origin + sum of the spans before it."""
    spans = torch.tensor(video_spans(n_frames), dtype=torch.float64)
    t = float(origin) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    pos = torch.empty(n_frames, frame.shape[0], 3, dtype=torch.float64)
    pos[:, :, 0] = t[:, None]
    pos[:, :, 1:] = frame[None]
    return pos.reshape(-1, 3)


def audio_positions(origin: float, n_frames: int, w_left: float, w_right: float) -> torch.Tensor:
    """[2 · n_frames, 3] channel-major stereo rows."""
    pos = torch.zeros(2 * n_frames, 3, dtype=torch.float64)
    pos[:, 0] = (origin + torch.arange(n_frames, dtype=torch.float64)).repeat(2)
    pos[:n_frames, 2] = w_left
    pos[n_frames:, 2] = w_right
    return pos


def ref_span(ref: dict) -> float:
    """Length along t that a reference block occupies."""
    kind = ref["kind"]
    if kind == "image":
        return 1.0
    if kind == "audio":
        return float(ref["ref_audio_t"])
    if kind in ("video", "video_audio"):
        return max(float(ref["ref_audio_t"]), sum(video_spans(ref["latent_t"])))
    return 0.0


def build_layout(text_len: int, latent_t: int, latent_h: int, latent_w: int, audio_t: int,
                 keyframes: list[dict] | None = None, refs: list[dict] | None = None) -> PackedLayout:
    """Layout for one geometry. latent_h/latent_w are the patch-padded (even) sizes.

    keyframes: [{resolved_frame_index, latent [1,C,t,h,w] | None, audio_latent [1,C,2,t] | None}]
    refs:      [{kind, latent_t, latent_h, latent_w, ref_audio_t}] (tensors not needed here)
    """
    frame, w_axis = frame_grid(latent_h, latent_w)
    rows_per_frame = frame.shape[0]
    target_w = (float(w_axis[0]), float(w_axis[-1]))

    kinds: list[tuple[str, int]] = []
    pos: list[torch.Tensor] = []

    def add(kind: str, p: torch.Tensor):
        kinds.append((kind, p.shape[0]))
        pos.append(p)

    text = torch.zeros(text_len, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(text_len, dtype=torch.float64)
    add("text", text)

    origin = float(text_len)  # the targets' t origin, after every reference
    for ref in refs or ():
        origin += ref_span(ref)

    for kf in keyframes or ():
        t0 = origin + FRAME_RESCALE * kf["resolved_frame_index"]
        if kf.get("latent") is not None:
            add("cond", video_positions(kf["latent"].shape[2], frame, t0))
        if kf.get("audio_latent") is not None:
            add("cond_audio", audio_positions(t0, kf["audio_latent"].shape[-1], *target_w))

    cursor = float(text_len)
    for ref in refs or ():
        kind = ref["kind"]
        if kind not in REF_KINDS:
            continue  # ComfyUI ignores unknown reference kinds (no rows, no span)
        if kind == "image":
            r_frame, _ = frame_grid(ref["latent_h"], ref["latent_w"])
            p = torch.empty(r_frame.shape[0], 3, dtype=torch.float64)
            p[:, 0] = cursor
            p[:, 1:] = r_frame
            add("ref_img", p)
        elif kind == "audio":
            if ref["ref_audio_t"] > 0:
                add("ref_audio", audio_positions(cursor, ref["ref_audio_t"], *target_w))
        else:  # video / video_audio: soundtrack rows first, sharing the block's origin
            r_frame, r_w = frame_grid(ref["latent_h"], ref["latent_w"])
            if ref["ref_audio_t"] > 0:
                add("ref_audio", audio_positions(cursor, ref["ref_audio_t"], float(r_w[0]), float(r_w[-1])))
            add("ref_img", video_positions(ref["latent_t"], r_frame, cursor))
        cursor += ref_span(ref)

    add("audio", audio_positions(cursor, audio_t, *target_w))
    add("video", video_positions(latent_t, frame, cursor))

    segments, start = [], 0
    for kind, n in kinds:
        segments.append(Segment(start, start + n, kind))
        start += n
    assert rows_per_frame * latent_t == segments[-1].rows
    return PackedLayout(segments, torch.cat(pos), (text_len, latent_t, latent_h, latent_w, audio_t))
