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

The positions are facts of the checkpoint (ComfyUI's `PackedLayout` is the oracle); the float64 sums and
products below are evaluated in an order that reproduces the oracle's positions bit for bit, which the parity
gate checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import cycle, islice

import torch

FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0

VIDEO_KINDS = ("cond", "ref_img", "video")  # rows embedded by video_patch_proj
AUDIO_KINDS = ("cond_audio", "ref_audio", "audio")  # rows embedded by audio_patch_proj
REF_KINDS = ("image", "audio", "video", "video_audio")


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the packed sequence, all of one kind.

    Kinds: "text" (prompt tokens), "cond"/"cond_audio" (keyframe latents), "ref_img"/"ref_audio" (reference
    latents; a reference video's frames are "ref_img" rows too) and the two denoised targets "audio", "video".
    """

    start: int
    stop: int
    kind: str

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

    def manifest(self) -> list[list]:
        return [[s.start, s.stop, s.kind] for s in self.segments]


def grid_axis(dim: int, sqrt_area: float, patch: int = 2) -> torch.Tensor:
    """float64 [dim // patch] coordinates of one spatial axis.

    The axis is measured in units of the frame's geometric-mean side sqrt(h·w): it covers a window of width
    r = dim / sqrt(h·w) centred on 1/2, i.e. [(1 − r)/2, (1 + r)/2), sampled at its n = dim/patch left edges
    (step r/n), and scaled by 32. A square frame thus spans [0, 32) on both axes whatever its size.
    """
    width = dim / sqrt_area
    count = dim // patch
    left_edge = (1.0 - width) / 2.0
    return (torch.arange(count, dtype=torch.float64) * (width / count) + left_edge) * 32.0


def frame_grid(latent_h: int, latent_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(h/2)·(w/2), 2] (h, w) coordinates of one latent frame's patch rows, and the w axis alone."""
    sqrt_area = math.sqrt(latent_h * latent_w)
    hs, ws = grid_axis(latent_h, sqrt_area), grid_axis(latent_w, sqrt_area)
    hh, ww = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), ws


def video_spans(n_frames: int) -> list[float]:
    """t extent of each of `n_frames` latent frames: 5/3 per pixel frame it holds (1, 4, 4, 4, 4, 1, 4, …)."""
    return [FRAME_RESCALE * pixel_frames for pixel_frames in islice(cycle(FRAME_PER_TOKEN), n_frames)]


def video_positions(n_frames: int, frame: torch.Tensor, origin: float) -> torch.Tensor:
    """float64 [n_frames · P, 3] for a clip whose frames each have the P (h, w) rows of `frame` [P, 2].

    Latent frame k starts at t_k = origin + Σ_{j<k} span_j (an exclusive prefix sum of `video_spans`).
    """
    starts = torch.zeros(n_frames, dtype=torch.float64)
    starts[1:] = torch.tensor(video_spans(n_frames)[:-1], dtype=torch.float64).cumsum(0)
    starts = float(origin) + starts
    per_frame = frame.shape[0]
    t_col = starts.repeat_interleave(per_frame)[:, None]
    return torch.cat([t_col, frame.repeat(n_frames, 1)], dim=1)


def audio_positions(origin: float, n_frames: int, w_left: float, w_right: float) -> torch.Tensor:
    """float64 [2·T, 3] for T stereo latent frames, left channel's T rows first.

    Row (c, j) sits at t = origin + j, h = 0, w = w_left for c = 0 and w_right for c = 1.
    """
    t_col = (origin + torch.arange(n_frames, dtype=torch.float64)).repeat(2)
    w_col = torch.tensor([w_left, w_right], dtype=torch.float64).repeat_interleave(n_frames)
    return torch.stack([t_col, torch.zeros_like(t_col), w_col], dim=1)


def ref_span(ref: dict) -> float:
    """t extent L of one reference block, which shifts everything packed after it.

    L = 1 for an image; for an audio clip of T_a latent frames L = T_a; for a video (with or without its
    soundtrack) L = max(T_a, Σ video_spans); a kind outside REF_KINDS takes no room.
    """
    kind = ref["kind"]
    if kind not in REF_KINDS:
        return 0.0
    if kind == "image":
        return 1.0
    soundtrack = float(ref["ref_audio_t"])
    picture = 0.0 if kind == "audio" else sum(video_spans(ref["latent_t"]))
    return max(soundtrack, picture)


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
