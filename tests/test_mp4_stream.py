"""The mp4 written while the video decodes (`h3direct.vae.mp4.Mp4Stream`): the same bytes as the one-shot writer
for the same frames and audio however the frames arrive, the x264 options the file itself records, an encoder that
fails surfacing as one line (never a wait), an abandoned stream leaving no file, the pipeline handing each decoded
chunk to the encoder before the audio decode starts, and the uint8 rounding done on the tensor's device equal to
the host's numpy rounding."""

from __future__ import annotations

import re
import threading
import time
import types

import av  # (the media extra: CI installs it, so its absence fails)
import numpy as np
import pytest
import torch

from h3direct.errors import H3Error
from h3direct.vae import mp4  # noqa: E402  (after the PyAV check)


def _clip(n: int = 39, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Blocky noise that changes every frame (what random models decode to) and a noisy stereo soundtrack."""
    rng = np.random.default_rng(seed)
    blocks = rng.normal(size=(n, 8, 12, 3))
    frames = np.clip(128 + 60 * blocks.repeat(8, axis=1).repeat(8, axis=2), 0, 255).astype(np.uint8)
    audio = (0.3 * rng.standard_normal((n * 32000 // 24, 2))).astype(np.float32)
    return frames, audio


def _temp_files(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _in_thread(fn, seconds: float = 60.0):
    """fn() in a thread; the test fails (instead of hanging) when it has not returned after `seconds`."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: the stream waits on a dead encoder"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize("with_audio", [True, False], ids=["audio", "video-only"])
@pytest.mark.parametrize("chunks", [(1, 16, 22), (17, 17, 5)], ids=["uneven", "decoder-chunks"])  # (one chunk: write_mp4)
def test_streamed_mp4_has_the_bytes_of_the_one_shot_mp4(tmp_path, chunks, with_audio):
    frames, audio = _clip()
    audio = audio if with_audio else None
    meta = {"comment": '{"seed":1}', "encoder": "h3direct test"}
    one_shot = mp4.write_mp4(tmp_path / "one.mp4", frames, 24, audio, 32000, metadata=meta).read_bytes()
    with mp4.Mp4Stream(tmp_path / "streamed.mp4", 24, sample_rate=32000 if with_audio else None,
                       metadata=meta) as stream:
        start = 0
        for n in chunks:  # frames arriving as a decoder makes them, with time between the chunks
            stream.add(frames[start : start + n])
            start += n
            time.sleep(0.02)
        path = stream.finish(audio)
    assert path.read_bytes() == one_shot
    assert stream.frames == 39 and stream.busy_s > 0
    assert _temp_files(tmp_path) == []


def test_the_file_records_the_x264_options(tmp_path):
    """x264 writes its settings into the stream (an SEI): CRF 18, macroblock-tree rate control off, a fixed number
    of frame threads, YUV 4:2:0 at the frames' size."""
    frames, audio = _clip(22)
    path = mp4.write_mp4(tmp_path / "a.mp4", frames, 24, audio)
    settings = re.search(rb"x264 - core \d+ .*? options: ([^\x00]*)", path.read_bytes())
    assert settings is not None
    options = dict(kv.split("=", 1) for kv in settings.group(1).decode().split())
    assert options["crf"] == "18.0" and options["mbtree"] == "0"
    # frame threads, a fixed count: the bits do not depend on the machine's cores
    assert options["threads"] == str(mp4.X264_THREADS) and options["sliced_threads"] == "0"
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        assert (v.width, v.height, v.codec_context.pix_fmt, c.streams.audio[0].rate) == (96, 64, "yuv420p", 32000)
        assert sum(1 for _ in c.decode(video=0)) == 22


class _FailingEncoder:
    """A stand-in for PyAV's output container whose video encoder fails at frame `fail_at` (None: at the flush)."""

    def __init__(self, path, fail_at):
        self.path, self.fail_at, self.seen, self.metadata = path, fail_at, 0, {}

    def add_stream(self, codec, rate=None, layout=None):
        outer = self

        class Stream:
            codec_context = types.SimpleNamespace()

            def encode(self, frame=None):
                if frame is None and outer.fail_at is None:
                    raise RuntimeError("x264 exploded\nwhile flushing")
                if frame is not None:
                    outer.seen += 1
                    if outer.seen == outer.fail_at:
                        raise RuntimeError("x264 exploded")
                return []

        return Stream()

    def mux(self, packets):
        pass

    def close(self):
        open(self.path, "ab").close()


@pytest.mark.parametrize("fail_at", [3, None], ids=["mid-clip", "at-flush"])
def test_an_encoder_failure_is_one_line_and_never_a_wait(tmp_path, monkeypatch, fail_at):
    monkeypatch.setattr(av, "open", lambda path, mode, format: _FailingEncoder(path, fail_at))
    frames, audio = _clip(20)
    out = tmp_path / "x.mp4"

    def stream_it():
        with mp4.Mp4Stream(out, 24, sample_rate=32000) as stream:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the decoder keeps going: the failure comes back on an add
                stream.add(frames[:5])
                if fail_at is None:
                    break
                time.sleep(0.01)
            stream.finish(audio)

    with pytest.raises(H3Error) as e:
        _in_thread(stream_it)
    msg = str(e.value)
    assert msg == f"{out}: the mp4 encoder failed: RuntimeError: x264 exploded" and "\n" not in msg
    assert not out.exists() and _temp_files(tmp_path) == []


def test_an_abandoned_stream_leaves_no_file(tmp_path):
    frames, _ = _clip(20)
    out = tmp_path / "x.mp4"
    with pytest.raises(KeyError), mp4.Mp4Stream(out, 24, sample_rate=32000) as stream:
        stream.add(frames[:10])
        raise KeyError("the decoder failed")
    assert not out.exists() and _temp_files(tmp_path) == []


@pytest.mark.parametrize("feed, needle", [
    (lambda s, f: s.add(f[:, :63]), "even frame sizes"),
    (lambda s, f: (s.add(f), s.add(f[:, :32])), "video frames of 96x32 after frames of 96x64"),
    (lambda s, f: s.finish(None), "for 32000 Hz audio, but none came"),
    (lambda s, f: s.finish(np.zeros((10, 2), np.float32)), "no video frames were written"),
])
def test_misuse_is_one_line(tmp_path, feed, needle):
    frames, _ = _clip(4)
    with pytest.raises(H3Error, match=needle), mp4.Mp4Stream(tmp_path / "x.mp4", 24, sample_rate=32000) as s:
        feed(s, frames)
    assert not (tmp_path / "x.mp4").exists() and _temp_files(tmp_path) == []


def test_generation_hands_each_decoded_chunk_to_the_encoder_before_the_audio_decode(cache_env, tmp_path, monkeypatch):
    """`app.generate.clip` on the bundled models (22 frames: two decoder chunks): the encoder gets each chunk while the
    video decodes, the file holds every frame, and the encoder's own time is in the timings."""
    from h3direct.app.generate import clip
    from h3direct.app.pipeline import H3Pipeline
    from h3direct.app.request import GenerateRequest
    from h3direct.dit.options import Options

    events = []
    add = mp4.Mp4Stream.add
    monkeypatch.setattr(mp4.Mp4Stream, "add", lambda self, f: (events.append(("add", len(f))), add(self, f))[1])
    pipe = H3Pipeline.bundled(device="cpu")
    req = GenerateRequest(prompt="a lighthouse", steps=1, output=str(tmp_path / "c.mp4"))
    res, out, write_s = clip(pipe, req, Options(), on_stage=lambda name: events.append(("stage", name)))
    stages = [e for e in events if e[0] == "stage" and not e[1].endswith(":tile")]
    adds = [i for i, e in enumerate(events) if e[0] == "add"]
    assert [n for _, n in (events[i] for i in adds)] == [17, 5]
    assert events.index(("stage", "decode_video")) < adds[0] and adds[-1] < events.index(("stage", "decode_audio"))
    assert stages[-2:] == [("stage", "write"), ("stage", "done")]
    with av.open(str(out)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 22 == res.frames.shape[0]
    assert res.timings["write_busy"] > 0 and write_s >= 0
    assert _temp_files(tmp_path) == []


def _rounding_cases() -> np.ndarray:
    """Values at and around every rounding boundary (k + 0.5) / 255 and every level k / 255, out of range, random."""
    k = np.arange(256, dtype=np.float64)
    edges = np.concatenate([k / 255, (k + 0.5) / 255]).astype(np.float32)
    near = [np.nextafter(edges, np.float32(-1)), edges, np.nextafter(edges, np.float32(2))]
    rng = np.random.default_rng(0)
    extra = np.array([-1.0, -1e-7, 0.0, 1.0, 1.0 + 1e-7, 2.0], np.float32)
    values = np.concatenate([*near, extra, rng.random(4096, dtype=np.float32)])
    return values[: len(values) // 3 * 3].reshape(-1, 1, 1, 3)


def test_uint8_rounding_of_a_tensor_equals_numpy_rounding():
    x = _rounding_cases()
    assert np.array_equal(mp4.pixels_to_uint8(torch.from_numpy(x)), mp4.pixels_to_uint8(x))


@pytest.mark.gpu
def test_uint8_rounding_on_the_gpu_equals_numpy_rounding():
    x = _rounding_cases()
    assert np.array_equal(mp4.pixels_to_uint8(torch.from_numpy(x).cuda()), mp4.pixels_to_uint8(x))
