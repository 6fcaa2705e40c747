"""Load images, video clips and audio into the tensors ComfyUI's nodes take.

IMAGE = [N, H, W, 3] float32 in [0, 1]; AUDIO = {"waveform": [1, C, L] float32, "sample_rate": int}.
Images via Pillow, video and audio via PyAV (`pip install av`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from h3direct.errors import H3Error


def _existing(path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise H3Error("file not found", path=p)
    return p


def load_image(path) -> torch.Tensor:
    """[1, H, W, 3] float32 in [0, 1] (EXIF rotation applied, alpha dropped)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    p = _existing(path)
    try:
        with Image.open(p) as im:
            rgb = ImageOps.exif_transpose(im).convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise H3Error(f"cannot read image ({e.__class__.__name__}); use PNG/JPEG/WebP", path=p) from None
    return torch.from_numpy(np.asarray(rgb).astype(np.float32) / 255.0)[None]


def load_video(path, max_frames: int | None = None) -> torch.Tensor:
    """Decoded frames [N, H, W, 3] float32 in [0, 1] (all frames, in order, as stored)."""
    import av

    p = _existing(path)
    frames = []
    try:
        with av.open(str(p)) as box:
            if not box.streams.video:
                raise H3Error("has no video stream", path=p)
            for fr in box.decode(video=0):
                frames.append(fr.to_ndarray(format="rgb24"))
                if max_frames is not None and len(frames) >= max_frames:
                    break
    except av.error.FFmpegError as e:
        raise H3Error(f"cannot decode video ({e.__class__.__name__})", path=p) from None
    if not frames:
        raise H3Error("video has no frames", path=p)
    return torch.from_numpy(np.stack(frames).astype(np.float32) / 255.0)


def load_audio(path, sample_rate: int | None = 32000, stream: str = "audio") -> dict:
    """AUDIO dict from an audio file or a video's soundtrack; resampled (PyAV/libswresample) to
    `sample_rate` unless None. Mono stays 1 channel; more channels are kept as stored."""
    import av

    p = _existing(path)
    chunks = []
    try:
        with av.open(str(p)) as box:
            if not box.streams.audio:
                raise H3Error("has no audio stream", path=p)
            src = box.streams.audio[0]
            rate = sample_rate or src.rate
            layout = "mono" if src.channels == 1 else "stereo"
            rs = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            for fr in box.decode(src):
                for out in rs.resample(fr):
                    chunks.append(out.to_ndarray())
            for out in rs.resample(None):
                chunks.append(out.to_ndarray())
    except av.error.FFmpegError as e:
        raise H3Error(f"cannot decode audio ({e.__class__.__name__})", path=p) from None
    if not chunks:
        raise H3Error("audio stream is empty", path=p)
    wave = torch.from_numpy(np.concatenate(chunks, axis=1).astype(np.float32))
    return {"waveform": wave[None], "sample_rate": int(rate)}
