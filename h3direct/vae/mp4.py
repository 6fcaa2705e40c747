"""Write an mp4 (H.264 video + optional AAC stereo audio) with PyAV, atomically (temp file + rename).

`Mp4Stream` encodes while the frames are being made: `add(frames)` hands a chunk of frames to an encoder thread
(the video decoder's temporal chunks, as they come), `finish(audio)` muxes the audio after the last frame and puts
the file in place. `write_mp4` is the same stream fed the whole clip at once. The bytes depend only on the frames,
the audio and the options, not on how the frames were chunked or how fast they came: the encoder sees the same
frames in the same order and the muxer gets the same packets in the same order.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from h3direct.errors import H3Error

AUDIO_BLOCK = 1024  # samples per audio frame handed to the encoder (AAC frame size)
# libx264 options besides the CRF. Macroblock-tree rate control is off: with B-frames, x264's AVX-512 code for it
# depends on memory it has not written (its output changes with what the heap held before), so on CPUs with AVX-512
# the same frames could encode to different bits from one call to the next. Without it a clip is a function of its
# frames (bframes=0 or x264 without AVX-512 would do too). Threads: x264's frame threads, a fixed number of them
# (its output is deterministic for a given thread count, and with a fixed count it does not depend on the machine's
# cores); frame threads keep up with the video decode where sliced threads (PyAV's default) do not.
X264_OPTIONS = {"mbtree": "0"}
X264_THREADS = 8
_STOP = object()  # the worker's sign to stop without writing more


def _check_frames(frames_uint8) -> np.ndarray:
    frames = np.asarray(frames_uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise H3Error(f"video frames must be uint8 [T>0, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    h, w = frames.shape[1:3]
    if h % 2 or w % 2:
        raise H3Error(f"H.264 (yuv420p) needs even frame sizes, got {w}x{h}")
    return frames


def _check_audio(audio_f32) -> np.ndarray | None:
    if audio_f32 is None:
        return None
    audio = np.asarray(audio_f32, dtype=np.float32)
    if audio.ndim != 2 or audio.shape[1] != 2:
        raise H3Error(f"audio must be float32 [samples, 2], got {list(audio.shape)}")
    return audio


def _import_av():
    try:
        import av
    except ImportError:
        raise H3Error("writing mp4 needs PyAV: pip install av") from None
    return av


class Mp4Stream:
    """An mp4 written while its frames are made (H.264 at `fps`, `crf`; AAC stereo at `sample_rate`, None: no audio).

    `add(frames)` (uint8 [n, H, W, 3], every chunk the same size; the stream keeps a reference, so don't change the
    array afterwards) queues a chunk for the encoder thread and returns at once; `finish(audio)` (float32 [L, 2], or
    None when `sample_rate` is None) waits for the encoder, muxes the audio and renames the temporary file to `path`.
    `abort()`, or leaving a `with` block without `finish`, stops the encoder and removes the temporary file. A
    failure of the encoder is raised by the next `add` or by `finish` as one line (H3Error), never waited on.
    `busy_s`: the seconds the encoder thread spent encoding and muxing (most of them while the caller decoded)."""

    def __init__(self, path: str | Path, fps: int, *, sample_rate: int | None = None, crf: int = 18,
                 loglevel: str | None = None, metadata: dict[str, str] | None = None):
        self._av = _import_av()
        _set_loglevel(self._av, loglevel)
        self.path, self.fps, self.sample_rate, self.crf = Path(path), fps, sample_rate, crf
        self.metadata = dict(metadata or {})
        self.busy_s, self.frames = 0.0, 0
        self._size: tuple[int, int] | None = None
        self._failure: BaseException | None = None
        self._aborted = threading.Event()
        self._done = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".mp4", dir=self.path.parent)
        except OSError as exc:
            raise H3Error(f"cannot write the mp4 there ({exc.strerror})", path=self.path) from None
        os.close(fd)
        self._tmp = Path(tmp)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # unbounded: `add` never waits for the encoder
        self._thread = threading.Thread(target=self._encode, name="h3direct-mp4", daemon=True)
        self._thread.start()

    # ---- the caller's side ----
    def add(self, frames_uint8) -> None:
        """Queue frames [n, H, W, 3] uint8 for the encoder (a one-line H3Error if the encoder has failed)."""
        self._check_open()
        frames = _check_frames(frames_uint8)
        size = (frames.shape[2], frames.shape[1])
        if self._size is not None and size != self._size:
            raise H3Error(f"video frames of {size[0]}x{size[1]} after frames of {self._size[0]}x{self._size[1]}")
        self._size = size
        self.frames += frames.shape[0]
        self._queue.put(frames)

    def finish(self, audio_f32=None) -> Path:
        """Wait for the encoder, mux `audio_f32`, put the file in place; returns `path`."""
        self._check_open()
        audio = _check_audio(audio_f32)
        if (audio is None) != (self.sample_rate is None):
            raise H3Error("the mp4 stream was opened " + ("without audio, but audio was given" if audio is not None
                                                           else f"for {self.sample_rate} Hz audio, but none came"))
        if self.frames == 0:
            raise H3Error("no video frames were written", path=self.path)
        self._queue.put(("finish", audio))
        self._thread.join()
        self._done = True
        if self._failure is not None:
            self._tmp.unlink(missing_ok=True)
            raise self._error()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)  # mkstemp makes 0600
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Stop the encoder (after the frame it is on) and remove the temporary file; nothing is written."""
        self._aborted.set()
        self._queue.put(_STOP)
        self._thread.join()
        self._done = True
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> Mp4Stream:
        return self

    def __exit__(self, *exc) -> bool:
        if not self._done:
            self.abort()
        return False

    def _check_open(self) -> None:
        if self._done:
            raise H3Error("the mp4 stream is closed", path=self.path)
        if self._failure is not None:
            raise self._error()

    def _error(self) -> H3Error:
        exc = self._failure
        text = (str(exc).strip().splitlines() or [""])[0]
        return H3Error(f"the mp4 encoder failed: {type(exc).__name__}" + (f": {text}" if text else ""),
                       path=self.path)

    # ---- the encoder thread ----
    def _encode(self) -> None:
        container = video = audio = None
        try:
            while True:
                item = self._queue.get()
                if item is _STOP or self._aborted.is_set():
                    return
                t0 = time.perf_counter()
                if isinstance(item, np.ndarray):
                    if container is None:
                        container, video, audio = self._open(item.shape[2], item.shape[1])
                    for img in item:
                        if self._aborted.is_set():
                            return
                        frame = self._av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                        container.mux(video.encode(frame))
                else:
                    container.mux(video.encode())
                    if audio is not None:
                        _mux_audio(self._av, container, audio, item[1], self.sample_rate)
                    container, closing = None, container
                    closing.close()
                    self.busy_s += time.perf_counter() - t0
                    return
                self.busy_s += time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's next add / finish
            self._failure = exc
        finally:
            if container is not None:
                with contextlib.suppress(Exception):
                    container.close()

    def _open(self, width: int, height: int):
        """The container with its streams (video; audio when `sample_rate`): one definition for every mp4."""
        container = self._av.open(str(self._tmp), mode="w", format="mp4")
        for k, v in self.metadata.items():
            container.metadata[k] = v
        video = container.add_stream("libx264", rate=self.fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"crf": str(self.crf), **X264_OPTIONS}
        video.codec_context.thread_type, video.codec_context.thread_count = "FRAME", X264_THREADS
        audio = None
        if self.sample_rate is not None:
            audio = container.add_stream("aac", rate=self.sample_rate, layout="stereo")
        return container, video, audio


def _mux_audio(av, container, stream, audio: np.ndarray, sample_rate: int) -> None:
    planar = np.ascontiguousarray(np.clip(audio, -1.0, 1.0).T)  # [2, L] fltp
    for start in range(0, planar.shape[1], AUDIO_BLOCK):
        block = np.ascontiguousarray(planar[:, start : start + AUDIO_BLOCK])
        af = av.AudioFrame.from_ndarray(block, format="fltp", layout="stereo")
        af.sample_rate = sample_rate
        af.pts = start
        container.mux(stream.encode(af))
    container.mux(stream.encode())


def write_mp4(path: str | Path, frames_uint8: np.ndarray, fps: int, audio_f32: np.ndarray | None = None,
              sample_rate: int = 32000, *, crf: int = 18, loglevel: str | None = None,
              metadata: dict[str, str] | None = None) -> Path:
    """frames [T, H, W, 3] uint8 RGB, audio [L, 2] float32 in [-1, 1] (or None) -> `path` (.mp4), in one go.

    H and W must be even (yuv420p). `loglevel`: FFmpeg log level name (quiet, error, warning, info, debug).
    `metadata`: container tags (the mp4 muxer keeps the standard ones: title, comment, description, ...).
    """
    _import_av()
    frames = _check_frames(frames_uint8)
    audio = _check_audio(audio_f32)
    with Mp4Stream(path, fps, sample_rate=None if audio is None else sample_rate, crf=crf, loglevel=loglevel,
                   metadata=metadata) as stream:
        stream.add(frames)
        return stream.finish(audio)


# FFmpeg's log levels by name (`--ffmpeg-loglevel`), each as PyAV's constant ("quiet" is PANIC, as ffmpeg's -v quiet)
FFMPEG_LOGLEVELS = {"quiet": "PANIC", "panic": "PANIC", "fatal": "FATAL", "error": "ERROR", "warning": "WARNING",
                    "info": "INFO", "verbose": "VERBOSE", "debug": "DEBUG"}


def _set_loglevel(av, name: str | None) -> None:
    if name is None:
        return
    if name not in FFMPEG_LOGLEVELS:
        raise H3Error(f"unknown FFmpeg log level {name!r}; known: {', '.join(FFMPEG_LOGLEVELS)}")
    av.logging.set_level(getattr(av.logging, FFMPEG_LOGLEVELS[name]))


def pixels_to_uint8(pixels) -> np.ndarray:
    """float [T, H, W, 3] in [0, 1] (torch or numpy) -> uint8: clipped, x255 + 0.5, truncated, in float32. A tensor
    is converted on its own device (the same float32 arithmetic) and only its bytes come to the host."""
    if hasattr(pixels, "detach"):
        import torch

        x = pixels.detach().float()
        return (x.clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8).cpu().numpy()
    arr = np.asarray(pixels, np.float32)
    return (np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
