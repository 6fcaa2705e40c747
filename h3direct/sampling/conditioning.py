"""Task conditioning for H3 (t2va, fl2va + guides, Ref2VA), with the preprocessing of ComfyUI's H3 nodes.

Facts (ComfyUI `nodes_minimax_h3.py`): frame counts snap up to 17k+5 at 24 fps; video latent
T = 2 for ≤5 frames else 5·(n−5)/17 + 2; audio latent length round(frames / 24 · 40);
latents [1,24,T,H/16,W/16] and [1,32,2,Ta]. Reference images are sized 'match' (down only to
the generation's pixel area) or 'max' (down only to a 2048 short edge), rounded to 32 per
axis; reference videos are fitted to the 768-short-edge canvas (never upscaled), cut to the
generation's frame count and then down to 17k+5 frames; Qwen sees them at 2 fps.

Encoding goes through callables supplied by the caller:
- `encode_video(pixels [N, H, W, 3] float in [0,1]) -> latent [1, 24, t, H/16, W/16]`
- `encode_audio(waveform [1, L, C] at 32 kHz) -> latent [1, 32, 2, Ta]` (ComfyUI's VAE.encode layout)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from h3direct.errors import H3Error
from h3direct.sampling.rules import CANVAS_MULTIPLE, align_frame_count, check_canvas

# time: pixel frames per second, audio latent frames per second, audio samples per second
FPS = 24
AUDIO_LATENT_FPS = 40
AUDIO_SAMPLE_RATE = 32000
# space: the generation canvas and reference image sizes, in pixels
BASE_SHORT_EDGE = 768
MAX_PIXELS = BASE_SHORT_EDGE * 1344
REF_IMAGE_SHORT_EDGE = 2048
FRAME_PER_TOKEN = (1, 4, 4, 4, 4)
FRAME_RESCALE = 5.0 / 3.0  # pixel frames → audio latent frames on the shared time axis

EncodeVideo = Callable[[torch.Tensor], torch.Tensor]
EncodeAudio = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Keyframe:
    """One `minimax_keyframes` entry: a pixel frame index and its image and/or audio latent."""

    resolved_frame_index: int
    latent: torch.Tensor | None = None
    audio_latent: torch.Tensor | None = None


@dataclass
class RefBlock:
    """One `minimax_refs` entry; kind ∈ image | video | video_audio | audio."""

    kind: str
    latent: torch.Tensor | None = None
    audio_latent: torch.Tensor | None = None
    latent_t: int | None = None
    latent_h: int | None = None
    latent_w: int | None = None
    ref_audio_t: int | None = None


@dataclass
class PresentationItem:
    """One entry of the text encoder's presentation (order = request order).

    image: `frames` [1,H,W,3]; video: `frames` sampled at 2 fps with `timestamps`; audio: label only.
    """

    kind: str
    frames: torch.Tensor | None = None
    timestamps: list | None = None


@dataclass
class H3Conditioning:
    task: str
    width: int
    height: int
    frame_count: int
    video_shape: tuple
    audio_shape: tuple
    keyframes: list = field(default_factory=list)
    refs: list = field(default_factory=list)
    # ref2va: PresentationItems; t2va/fl2va: the keyframe images as 'image' items ("<Picture i>: ")
    presentation: list = field(default_factory=list)

    def comfy_fields(self) -> dict:
        """The conditioning dict entries ComfyUI's nodes set (`minimax_keyframes`, `minimax_refs`)."""
        out = {}
        if self.keyframes:
            kfs = []
            for k in self.keyframes:
                d = {"resolved_frame_index": k.resolved_frame_index}
                if k.latent is not None:
                    d["latent"] = k.latent
                if k.audio_latent is not None:
                    d["audio_latent"] = k.audio_latent
                kfs.append(d)
            out["minimax_keyframes"] = kfs
        if self.refs:
            blocks = []
            for r in self.refs:
                if r.kind == "image":
                    blocks.append({"kind": "image", "latent_h": r.latent_h, "latent_w": r.latent_w, "latent": r.latent})
                elif r.kind == "audio":
                    blocks.append({"kind": "audio", "ref_audio_t": r.ref_audio_t, "audio_latent": r.audio_latent})
                else:
                    blocks.append({"kind": r.kind, "latent_t": r.latent_t, "latent_h": r.latent_h, "latent_w": r.latent_w,
                                   "ref_audio_t": r.ref_audio_t, "latent": r.latent, "audio_latent": r.audio_latent})
            out["minimax_refs"] = blocks
        return out


# ---- geometry -------------------------------------------------------------------------------

def video_latent_frames(frame_count: int) -> int:
    """Video latent length T for 17k + 5 pixel frames: 2 + 5k (5 frames -> 2, 22 -> 7, 39 -> 12, …)."""
    k = max(0, (frame_count - 5) // 17)
    return 2 + 5 * k


def frames_of_latent(latent_t: int) -> int:
    """Pixel frames covered by `latent_t` video latent frames (tokens cycle 1,4,4,4,4 frames)."""
    return sum(FRAME_PER_TOKEN[k % 5] for k in range(latent_t))


def temporal_shape(length: int) -> tuple:
    """(n, T, T_a) for a requested length: n = the aligned frame count (≥ 5), T its video latent length,
    T_a = round(n / 24 s⁻¹ · 40 s⁻¹) audio latent frames over the same duration."""
    n = align_frame_count(max(5, length))
    return n, video_latent_frames(n), round(n / FPS * AUDIO_LATENT_FPS)  # T_a spans the same n / 24 seconds


def _round32(v: float) -> int:
    """v rounded to the nearest multiple of 32 (ties to even), at least 32."""
    return max(CANVAS_MULTIPLE, CANVAS_MULTIPLE * round(v / CANVAS_MULTIPLE))


def adapt_canvas(width: int, height: int) -> tuple:
    """(W, H) of the generation canvas for a requested size.

    Keep the aspect a = width / height and put the short edge at 768: the long edge is 768·a (landscape)
    or 768/a (portrait). If W·H exceeds 768·1344 pixels, shrink both edges by sqrt(768·1344 / (W·H)).
    Each edge is then rounded to a multiple of 32 on its own (`_round32`).
    """
    a = width / height
    landscape = a >= 1.0
    long_edge = BASE_SHORT_EDGE * a if landscape else BASE_SHORT_EDGE / a
    edges = (long_edge, BASE_SHORT_EDGE) if landscape else (BASE_SHORT_EDGE, long_edge)
    area = edges[0] * edges[1]
    if area > MAX_PIXELS:
        shrink = math.sqrt(MAX_PIXELS / area)
        edges = (edges[0] * shrink, edges[1] * shrink)
    return _round32(edges[0]), _round32(edges[1])


def latent_shapes(width: int, height: int, length: int) -> tuple:
    """(frame_count, video shape [1,24,T,H/16,W/16], audio shape [1,32,2,Ta])."""
    check_canvas(width, height, length)
    frames, t, ta = temporal_shape(length)
    return frames, (1, 24, t, height // 16, width // 16), (1, 32, 2, ta)


# ---- pixels ----------------------------------------------------------------------------------

def _lanczos(images: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """[N,H,W,3] float → [N,height,width,3]: 8-bit quantize, Pillow LANCZOS, back to /255 (as ComfyUI)."""
    from PIL import Image

    out = []
    for img in images:
        u8 = np.clip(255.0 * img.cpu().numpy(), 0, 255).astype(np.uint8)
        res = Image.fromarray(u8).resize((width, height), resample=Image.Resampling.LANCZOS)
        out.append(torch.from_numpy(np.array(res).astype(np.float32) / 255.0))
    return torch.stack(out).to(images.dtype)


def resize_frames(images: torch.Tensor, width: int, height: int, center_crop: bool) -> torch.Tensor:
    """ComfyUI `_resize`: RGB only, optional centered crop to the target aspect, then Lanczos."""
    images = images[..., :3]
    if center_crop:
        h, w = images.shape[1], images.shape[2]
        src, dst = w / h, width / height
        dx = round((w - w * (dst / src)) / 2) if src > dst else 0
        dy = round((h - h * (src / dst)) / 2) if src < dst else 0
        images = images[:, dy : h - dy, dx : w - dx]
    return _lanczos(images, width, height)


# ---- audio -----------------------------------------------------------------------------------

def encode_ref_audio(encode_audio: EncodeAudio, audio: dict) -> tuple:
    """(latent [1,32,2,T], T) of a ComfyUI AUDIO dict; the waveform must already be at 32 kHz."""
    sr = int(audio["sample_rate"])
    if sr != AUDIO_SAMPLE_RATE:
        raise H3Error(f"audio sample_rate={sr}: resample to {AUDIO_SAMPLE_RATE} Hz first (media.load_audio does)")
    wave = audio["waveform"][:1].movedim(1, -1)  # [1, L, C]
    z = encode_audio(wave)
    return z, int(z.shape[-1])


# ---- tasks -----------------------------------------------------------------------------------

def t2va(width: int, height: int, length: int) -> H3Conditioning:
    frames, vs, as_ = latent_shapes(width, height, length)
    return H3Conditioning("t2va", width, height, frames, vs, as_)


def fl2va(width: int, height: int, length: int, encode_video: EncodeVideo,
          first_frame: torch.Tensor | None = None, last_frame: torch.Tensor | None = None) -> H3Conditioning:
    """First frame: stretched to the canvas; last frame: aspect-kept center crop (MiniMaxH3ImageToVideo)."""
    cond = t2va(width, height, length)
    cond.task = "fl2va"
    for image, index, crop in ((first_frame, 0, False), (last_frame, cond.frame_count - 1, True)):
        if image is None:
            continue
        img = resize_frames(image[:1], width, height, center_crop=crop)
        cond.presentation.append(PresentationItem("image", img))
        cond.keyframes.append(Keyframe(index, latent=encode_video(img)))
    return cond


def add_guide(cond: H3Conditioning, frame_idx: int, *, image: torch.Tensor | None = None,
              audio: dict | None = None, encode_video: EncodeVideo | None = None,
              encode_audio: EncodeAudio | None = None) -> H3Conditioning:
    """MiniMaxH3AddGuide: anchor an image / 17k+5-frame clip and/or audio at `frame_idx` (negative = from end)."""
    if image is None and audio is None:
        raise H3Error("add_guide: give an image, an audio clip, or both")
    if image is not None and encode_video is None:
        raise H3Error("add_guide: a guide image is encoded with the video VAE; none was given")
    if audio is not None and encode_audio is None:
        raise H3Error("add_guide: guide audio is encoded with the audio VAE; none was given")
    frames = frames_of_latent(cond.video_shape[2])
    # an image batch of m ≥ 5 frames anchors its first 17k + 5 frames as a clip; fewer anchor one still
    m = 0 if image is None else image.shape[0]
    n = m - (m - 5) % 17 if m >= 5 else 1
    at = frame_idx if frame_idx >= 0 else frames + frame_idx
    if at < 0 or at + n > frames:
        what = "frame_idx" if n == 1 else f"a {n} frame guide clip at frame_idx"
        raise H3Error(f"{what} {frame_idx} does not fit in the video's {frames} frames")
    # pixel frame f sits at 5/3·f on the audio latent axis, so audio anchored there has this many frames left
    audio_room = math.floor(cond.audio_shape[-1] - FRAME_RESCALE * at)
    if audio is not None and audio_room < 1:
        raise H3Error(f"frame_idx {frame_idx}: the audio track ({cond.audio_shape[-1]} latent frames) ends "
                      "before it; anchor the audio earlier")
    kf = Keyframe(at)
    if image is not None:
        kf.latent = encode_video(resize_frames(image[:n], cond.width, cond.height, center_crop=True))
    if audio is not None:
        z, zt = encode_ref_audio(encode_audio, audio)
        kf.audio_latent = z if zt <= audio_room else z[..., :audio_room].clone()
    cond.keyframes.append(kf)
    return cond


def ref_image_size(w: int, h: int, width: int, height: int, sizing: str) -> tuple:
    """Target (w, h) of a reference image: 'match' → generation area, 'max' → 2048 short edge; down only."""
    if sizing == "match":
        k = min(1.0, math.sqrt(width * height / (w * h)))
    elif sizing == "max":
        k = min(1.0, REF_IMAGE_SHORT_EDGE / min(w, h))
    else:
        raise H3Error(f"ref_image_size={sizing!r}: use 'match' or 'max'")
    return _round32(w * k), _round32(h * k)


def ref_video_canvas(w: int, h: int) -> tuple:
    cw, ch = adapt_canvas(w, h)
    if w * h < cw * ch:  # never upscale a reference clip
        cw, ch = _round32(w), _round32(h)
    return cw, ch


def ref2va(width: int, height: int, length: int, encode_video: EncodeVideo, encode_audio: EncodeAudio, *,
           images: Sequence[torch.Tensor] = (), videos: Sequence[torch.Tensor] = (),
           video_audios: Sequence[dict | None] = (), audios: Sequence[dict] = (),
           sizing: str = "match") -> H3Conditioning:
    """MiniMaxH3ReferenceToVideo. `video_audios[k]` is the optional soundtrack of `videos[k]`."""
    if len(video_audios) > len(videos):
        raise H3Error(f"{len(video_audios)} ref video soundtracks for {len(videos)} ref videos")
    cond = t2va(width, height, length)
    cond.task = "ref2va"
    for img in images:
        tw, th = ref_image_size(img.shape[2], img.shape[1], width, height, sizing)
        px = resize_frames(img[:1], tw, th, center_crop=False)
        cond.presentation.append(PresentationItem("image", px))
        cond.refs.append(RefBlock("image", latent=encode_video(px), latent_h=th // 16, latent_w=tw // 16))
    for k, clip in enumerate(videos):
        track = video_audios[k] if k < len(video_audios) else None
        cw, ch = ref_video_canvas(clip.shape[2], clip.shape[1])
        px = resize_frames(clip, cw, ch, center_crop=False)[: cond.frame_count]
        n = px.shape[0]
        if n < 5:
            raise H3Error(f"ref video {k + 1} has {n} frames; H3 reference videos need at least 5 (~0.2 s at 24 fps)")
        px = px[: n - (n - 5) % 17]  # the longest 17k + 5 prefix
        z = encode_video(px)
        soundtrack = None if track is None else encode_ref_audio(encode_audio, track)
        if soundtrack is not None:  # a clip's soundtrack is presented (labelled) just before the clip
            cond.presentation.append(PresentationItem("audio"))
        za, zt = soundtrack or (None, 0)
        picks = list(range(0, px.shape[0], FPS // 2))
        cond.presentation.append(PresentationItem("video", px[picks], [i / 2.0 for i in range(len(picks))]))
        cond.refs.append(RefBlock("video_audio" if zt else "video", latent=z, audio_latent=za, latent_t=int(z.shape[2]),
                                  latent_h=ch // 16, latent_w=cw // 16, ref_audio_t=zt))
    for a in audios:
        za, zt = encode_ref_audio(encode_audio, a)
        cond.presentation.append(PresentationItem("audio"))
        cond.refs.append(RefBlock("audio", audio_latent=za, ref_audio_t=zt))
    return cond
