"""Write an mp4 (H.264 video + optional AAC stereo audio) with PyAV, atomically (temp file + rename)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from h3direct.errors import H3Error

AUDIO_BLOCK = 1024  # samples per audio frame handed to the encoder (AAC frame size)
# libx264 options besides the CRF. Macroblock-tree rate control is off: with B-frames, x264's AVX-512 code for it
# depends on memory it has not written (its output changes with what the heap held before), so on CPUs with AVX-512
# the same frames could encode to different bits from one call to the next. Without it a clip is a function of its
# frames (bframes=0 or x264 without AVX-512 would do too).
X264_OPTIONS = {"mbtree": "0"}


def write_mp4(path: str | Path, frames_uint8: np.ndarray, fps: int, audio_f32: np.ndarray | None = None,
              sample_rate: int = 32000, *, crf: int = 18, loglevel: str | None = None,
              metadata: dict[str, str] | None = None) -> Path:
    """frames [T, H, W, 3] uint8 RGB, audio [L, 2] float32 in [-1, 1] (or None) -> `path` (.mp4).

    H and W must be even (yuv420p). `loglevel`: FFmpeg log level name (quiet, error, warning, info, debug).
    `metadata`: container tags (the mp4 muxer keeps the standard ones: title, comment, description, ...).
    """
    try:
        import av
    except ImportError:
        raise H3Error("writing mp4 needs PyAV: pip install av") from None
    frames = np.asarray(frames_uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise H3Error(f"video frames must be uint8 [T>0, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    h, w = frames.shape[1:3]
    if h % 2 or w % 2:
        raise H3Error(f"H.264 (yuv420p) needs even frame sizes, got {w}x{h}")
    if audio_f32 is not None:
        audio_f32 = np.asarray(audio_f32, dtype=np.float32)
        if audio_f32.ndim != 2 or audio_f32.shape[1] != 2:
            raise H3Error(f"audio must be float32 [samples, 2], got {list(audio_f32.shape)}")
    _set_loglevel(av, loglevel)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".mp4", dir=path.parent)
    os.close(fd)
    try:
        with av.open(tmp, mode="w", format="mp4") as container:
            for k, v in (metadata or {}).items():
                container.metadata[k] = v
            vs = container.add_stream("libx264", rate=fps)
            vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
            vs.options = {"crf": str(crf), **X264_OPTIONS}
            aus = None
            if audio_f32 is not None:
                aus = container.add_stream("aac", rate=sample_rate, layout="stereo")
            for img in frames:
                container.mux(vs.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")))
            container.mux(vs.encode())
            if aus is not None:
                planar = np.ascontiguousarray(np.clip(audio_f32, -1.0, 1.0).T)  # [2, L] fltp
                for start in range(0, planar.shape[1], AUDIO_BLOCK):
                    block = np.ascontiguousarray(planar[:, start : start + AUDIO_BLOCK])
                    af = av.AudioFrame.from_ndarray(block, format="fltp", layout="stereo")
                    af.sample_rate = sample_rate
                    af.pts = start
                    container.mux(aus.encode(af))
                container.mux(aus.encode())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _set_loglevel(av, name: str | None) -> None:
    if name is None:
        return
    levels = {"quiet": av.logging.PANIC, "panic": av.logging.PANIC, "fatal": av.logging.FATAL,
              "error": av.logging.ERROR, "warning": av.logging.WARNING, "info": av.logging.INFO,
              "verbose": av.logging.VERBOSE, "debug": av.logging.DEBUG}
    if name not in levels:
        raise H3Error(f"unknown FFmpeg log level {name!r}; known: {', '.join(levels)}")
    av.logging.set_level(levels[name])


def pixels_to_uint8(pixels) -> np.ndarray:
    """float [T, H, W, 3] in [0, 1] (torch or numpy) -> uint8, rounded."""
    arr = pixels.detach().cpu().float().numpy() if hasattr(pixels, "detach") else np.asarray(pixels, np.float32)
    return (np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
