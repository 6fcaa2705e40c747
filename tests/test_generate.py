"""`h3direct generate`: the default command's mp4, the JSON summary, Ref2VA from files, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import av  # (the media extra: CI installs it, so its absence fails)
import numpy as np
import pytest
import torch

from h3direct.app import bundled, cli


def _run(argv, capsys):
    rc = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _summary(out: str) -> dict:
    lines = out.splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def _probe(path):
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        n = sum(1 for _ in c.decode(video=0))
        return {"frames": n, "fps": float(v.average_rate), "width": v.width, "height": v.height,
                "channels": a.channels, "rate": a.rate, "audio_seconds": float(a.duration * a.time_base)}


def test_default_command_writes_playable_mp4(cache_env, tmp_path):
    """The README's first command, as a user runs it: no model arguments at all."""
    env = {**os.environ, "H3_CACHE_DIR": str(cache_env), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "h3direct", "generate", "--output", "clip.mp4"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # quiet by default
    s = _summary(p.stdout)
    got = _probe(tmp_path / "clip.mp4")
    want = {"frames": bundled.DEFAULT_FRAMES, "fps": 24.0, "width": bundled.DEFAULT_WIDTH,
            "height": bundled.DEFAULT_HEIGHT, "channels": 2, "rate": 32000}
    assert {k: got[k] for k in want} == want
    assert abs(got["audio_seconds"] - got["frames"] / 24) < 0.1  # the soundtrack spans the clip
    assert (s["frames"], s["fps"], s["width"], s["height"]) == (22, 24, 96, 64)
    assert Path(s["output"]).resolve() == (tmp_path / "clip.mp4").resolve()
    assert s["task"] == "t2va" and s["reused_steps"] == [] and s["peak_memory_bytes"] > 0
    assert {"load", "text_encode", "sample", "decode_video", "decode_audio", "write", "total"} <= set(s["timings"])
    assert [p.name for p in tmp_path.iterdir()] == ["clip.mp4"]  # no temp file left next to it
    with av.open(str(tmp_path / "clip.mp4")) as c:  # the provenance travels with the clip
        assert json.loads(c.metadata["comment"]) == s["provenance"]
    b = bundled.ensure()
    assert s["provenance"]["weights"]["dit"]["file"] == b.dit.name and len(s["provenance"]["weights"]) == 4


def _run_on_a_terminal(argv, cwd, env) -> tuple[int, str]:
    """`h3direct` with stderr on a pseudo-terminal (as a user at a shell sees it): (exit status, what it showed)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns: a real window
    proc = subprocess.Popen([sys.executable, "-m", "h3direct", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=slave)
    os.close(slave)
    chunks = []

    def drain():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the terminal's last writer is gone
                return
            if not data:
                return
            chunks.append(data)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    proc.stdout.read()
    rc = proc.wait(120)
    t.join(10)
    os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


def test_progress_bars_on_a_terminal_by_default_and_none_with_quiet(cache_env, tmp_path):
    env = {**os.environ, "H3_CACHE_DIR": str(cache_env), "OMP_NUM_THREADS": "1"}
    small = ["generate", "--width", "32", "--height", "32", "--frames", "5", "--steps", "2"]
    rc, shown = _run_on_a_terminal([*small, "-o", "a.mp4"], tmp_path, env)
    assert rc == 0, shown
    for bar in ("text encode", "sampling", "2/2", "decode video", "decode audio", "write mp4"):
        assert bar in shown, shown
    rc, shown = _run_on_a_terminal([*small, "-o", "b.mp4", "--quiet"], tmp_path, env)
    assert rc == 0 and shown == "", shown


def test_ref2va_from_image_file_and_frame_snapping(cache_env, tmp_path, capsys):
    from PIL import Image

    img = tmp_path / "ref.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (112, 80, 3), dtype=np.uint8)).save(img)
    out = tmp_path / "sub" / "ref.mp4"
    rc, stdout, err = _run(["--ref-image", str(img), "--prompt", "<Picture 1> waves", "--frames", "6",
                            "--steps", "2", "--output", str(out), "--profile-memory", "--progress"], capsys)
    assert rc == 0, err
    s = _summary(stdout)
    assert s["task"] == "ref2va"
    # ComfyUI's nodes snap the length up to 17k+5: 6 -> 22
    assert s["frames"] == 22 and s["frames_requested"] == 6 and _probe(out)["frames"] == 22
    assert len(s["step_seconds"]) == 2 and set(s["memory"]) >= {"load", "sample", "write"}
    assert "sampling" in err or "step 1/2" in err  # per-step progress went to stderr
    assert "note: --frames 6 snapped up to 22" in err
    for stage in ("text encode", "decode video", "tile", "decode audio", "write mp4"):  # a bar per long stage
        assert stage in err, err


def test_t2va_text_embeds_quiet_and_cache(cache_env, tmp_path, capsys):
    from safetensors.torch import save_file

    emb = tmp_path / "emb.safetensors"
    save_file({"text_states": torch.randn(1, 7, 96, generator=torch.Generator().manual_seed(0)),
               "token_tags": torch.ones(7, dtype=torch.long)}, str(emb))
    rc, stdout, err = _run(["--text-embeds", str(emb), "--frames", "5", "--steps", "6", "--cache-mode",
                            "easycache", "--cache-threshold", "1e9", "--output", str(tmp_path / "a.mp4")], capsys)
    assert rc == 0, err
    s = _summary(stdout)
    assert s["models"]["text_encoder"] is None and s["task"] == "t2va"
    assert s["reused_steps"] and s["cache_mode"] == "easycache"
    rc, stdout, err = _run(["--text-embeds", str(emb), "--frames", "5", "--steps", "1", "--quiet",
                            "--output", str(tmp_path / "b.mp4")], capsys)
    assert rc == 0 and stdout == "" and err == "" and (tmp_path / "b.mp4").is_file()


BAD = [
    (["--frames", "3"], "--frames 3"),
    (["--frames", "4000"], "--frames 4000"),
    (["--width", "100"], "--width 100"),
    (["--height", "0"], "--height 0"),
    (["--steps", "0"], "--steps 0"),
    (["--checkpoint", "nope.safetensors"], "nope.safetensors"),
    (["--ref-image", "missing.png"], "missing.png"),
    (["--text-embeds", "missing.safetensors"], "missing.safetensors"),
    (["--attention", "warp_drive"], "warp_drive"),
    (["--sampler", "ddim"], "ddim"),
    (["--scheduler", "karras"], "karras"),
    (["--cache-mode", "lru"], "lru"),
    (["--cache-start-percent", "0.9", "--cache-end-percent", "0.1", "--cache-mode", "easycache"], "--cache-*: cache start_percent"),
    (["--vae-tile-size", "-1"], "--vae-tile-size -1"),
    (["--vae-dtype", "bf8"], "bf8"),
    (["--ffmpeg-loglevel", "loud"], "loud"),
    (["--mlp-chunks", "0"], "mlp-chunks"),
    (["--vae-config", "tiny"], "--vae"),
    (["--device", "cuda"], "CUDA"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_exit_2_with_one_line(cache_env, tmp_path, capsys, argv, needle):
    if needle == "CUDA" and torch.cuda.is_available():
        pytest.skip("a CUDA device is available here")
    out = tmp_path / "x.mp4"
    rc, stdout, err = _run([*argv, "--output", str(out)], capsys)
    assert rc == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_env_vae_settings(cache_env, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("H3_VAE_DTYPE", "fp16")
    monkeypatch.setenv("H3_VAE_TILE_SIZE", "junk")
    rc, stdout, err = _run(["--frames", "5", "--steps", "1", "--output", str(tmp_path / "x.mp4")], capsys)
    assert rc == 2 and "H3_VAE_TILE_SIZE" in err
    monkeypatch.setenv("H3_VAE_TILE_SIZE", "0")
    rc, stdout, err = _run(["--frames", "5", "--steps", "1", "--output", str(tmp_path / "x.mp4")], capsys)
    assert rc == 0, err
    assert _summary(stdout)["vae_dtype"] == "float16"


def test_vae_settings_flags_over_environment():
    """One reader of H3_VAE_* for generate, serve and decode-latent (`app/env.py`, at startup): a bad variable is one
    ConfigError naming it, an empty one is unset, and a flag wins over it (`cli_generate.parse`)."""
    from h3direct.app import cli_generate, models
    from h3direct.app.env import read_settings
    from h3direct.errors import ConfigError
    from h3direct.vae.config import VAE_DTYPES

    assert VAE_DTYPES == models.VAE_DTYPES
    with pytest.raises(ConfigError, match="H3_VAE_DTYPE='fp64'"):
        read_settings({"H3_VAE_DTYPE": "fp64"})
    with pytest.raises(ConfigError, match="H3_VAE_TILE_SIZE='junk'"):
        read_settings({"H3_VAE_TILE_SIZE": "junk"})
    assert read_settings({"H3_VAE_DTYPE": "", "H3_VAE_TILE_SIZE": "0"}) == {"vae_tile_size": 0}
    env = {"H3_VAE_DTYPE": "fp16", "H3_VAE_TILE_SIZE": "64"}
    args = cli.build_parser("generate").parse_args(["generate", "--vae-dtype", "fp32", "-o", "/tmp/x.mp4"])
    spec = cli_generate.parse(args, env=env).spec
    assert (spec.vae_dtype, spec.vae_tile_size) == ("fp32", 64)


@pytest.mark.parametrize("argv,needle", [(["--frames", "abc"], "abc"), (["--compute-dtype", "fp8"], "fp8")],
                         ids=["frames-not-int", "compute-dtype-choice"])
def test_argparse_errors_are_one_line(capsys, argv, needle):
    rc = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err
