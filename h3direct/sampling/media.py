"""Load images, video clips and audio into the tensors ComfyUI's nodes take.

IMAGE = [N, H, W, 3] float32 in [0, 1]; AUDIO = {"waveform": [1, C, L] float32, "sample_rate": int}.
Images via Pillow, video and audio via PyAV (`pip install av`); audio resampling in torch (`resample`).
"""

from __future__ import annotations

import math
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


def sinc_resample_kernel(orig: int, new: int, lowpass_filter_width: int = 6, rolloff: float = 0.99,
                         dtype: torch.dtype = torch.float32) -> tuple:
    """Polyphase windowed-sinc kernel of torchaudio's `resample` (sinc_interp_hann) for orig→new (already
    divided by their gcd): ([new, 1, 2·width + orig] in `dtype`, width).

    Phase j (output sample j of each period) weighs input offsets i ∈ [−width, width + orig) with
    s·sinc(π·u)·cos²(π·u / (2·lpw)), u = clamp(base·(i/orig − j/new), ±lpw), base = min(orig, new)·rolloff,
    s = base/orig, width = ceil(lpw·orig/base). Evaluated in `dtype` (torchaudio uses the waveform's dtype)."""
    base = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base)
    offsets = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig
    u = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new + offsets
    u = (u * base).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(u * math.pi / lowpass_filter_width / 2) ** 2
    u = u * math.pi
    sinc = torch.where(u == 0, torch.ones((), dtype=dtype), u.sin() / u)
    return sinc * (window * (base / orig)), width


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """[..., L] at orig_freq → [..., ceil(L·new/orig)] at new_freq, as `torchaudio.functional.resample` with its
    defaults (ComfyUI's H3 nodes call it to bring reference audio to 32 kHz)."""
    if orig_freq <= 0 or new_freq <= 0:
        raise H3Error(f"sample rates must be positive, got {orig_freq} -> {new_freq}")
    if orig_freq == new_freq:
        return waveform
    g = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // g, int(new_freq) // g
    kernel, width = sinc_resample_kernel(orig, new, dtype=waveform.dtype)
    lead, length = waveform.shape[:-1], waveform.shape[-1]
    x = torch.nn.functional.pad(waveform.reshape(-1, 1, length), (width, width + orig))
    y = torch.nn.functional.conv1d(x, kernel.to(waveform.device), stride=orig)  # [B, new, periods]
    y = y.transpose(1, 2).reshape(y.shape[0], -1)[:, : math.ceil(new * length / orig)]
    return y.reshape(*lead, -1)


def load_audio(path, sample_rate: int | None = 32000, stream: str = "audio") -> dict:
    """AUDIO dict from an audio file or a video's soundtrack, decoded at its own rate (channels as stored)
    and resampled to `sample_rate` (unless None) with :func:`resample` — ComfyUI's torchaudio resampling."""
    import av

    p = _existing(path)
    chunks = []
    try:
        with av.open(str(p)) as box:
            if not box.streams.audio:
                raise H3Error("has no audio stream", path=p)
            src = box.streams.audio[0]
            rate = src.rate
            # planar float at the stored rate and layout: a format conversion only, no resampling
            conv = av.AudioResampler(format="fltp", layout=src.layout.name, rate=rate)
            for fr in box.decode(src):
                for out in conv.resample(fr):
                    chunks.append(out.to_ndarray())
            for out in conv.resample(None):
                chunks.append(out.to_ndarray())
    except av.error.FFmpegError as e:
        raise H3Error(f"cannot decode audio ({e.__class__.__name__})", path=p) from None
    if not chunks:
        raise H3Error("audio stream is empty", path=p)
    wave = torch.from_numpy(np.concatenate(chunks, axis=1).astype(np.float32))
    if sample_rate is not None and sample_rate != rate:
        wave, rate = resample(wave, rate, sample_rate), sample_rate
    return {"waveform": wave[None], "sample_rate": int(rate)}
