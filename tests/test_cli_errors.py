"""Bad command lines: each is one stderr line and exit 2, no traceback, no output file, and no model loaded (the
loaders are replaced by tripwires). A few run through a real interpreter; the rest in-process (fast). Also:
--version, choices and defaults in --help, notes for a snapped frame count and a defaulted size, SIGTERM during
the mp4 write."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from h3direct.app import cli, cli_generate, models
from h3direct.errors import RequestError

PY = os.environ.get("H3_PYTHON", sys.executable)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "file.png").write_bytes(b"not a png")
    (tmp_path / "garbage.png").write_bytes(b"\x00garbage" * 16)
    (tmp_path / "adir.mp4").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.mp4").write_bytes(b"an earlier clip")
    (tmp_path / "out" / "kept.safetensors").write_bytes(b"earlier latents")
    return tmp_path


@pytest.fixture
def no_models(monkeypatch):
    """Any model load fails the test: the bad command line must be refused before it."""
    from h3direct.app import pipeline
    from h3direct.dit import loader as dit_loader
    from h3direct.vae import loader as vae_loader

    def tripwire(*a, **k):
        raise AssertionError("a model was loaded for a bad command line")

    monkeypatch.setattr(models, "load_pipeline", tripwire)
    monkeypatch.setattr(pipeline.H3Pipeline, "from_files", tripwire)
    for mod, name in ((dit_loader, "load_dit"), (vae_loader, "load_video_vae"), (vae_loader, "load_audio_vae")):
        monkeypatch.setattr(mod, name, tripwire)


O = "out/x.mp4"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BAD = [  # (argv, words the one line must contain); paths relative to the `files` folder
    (["generate", "-o", "/proc/x.mp4"], "cannot write"),
    (["generate", "-o", "file.png/x.mp4"], "not a folder"),
    (["generate", "-o", "x.avi"], ".mp4"),
    (["generate", "-o", "adir.mp4"], "folder"),
    (["generate", "--output", "nosuchroot/../file.png/y.mp4"], "not a folder"),
    (["make-checkpoint", "--out", "/proc/x.safetensors"], "cannot write"),
    (["inspect", "garbage.png", "--out", "file.png"], "not a folder"),
    (["trace-vae", "--weights", "garbage.png", "--inputs", "garbage.png", "--out", "x.safetensors"],
     "not a readable safetensors"),
    (["trace", "--checkpoint", "garbage.png", "--inputs", "garbage.png", "--out", "/proc/t.safetensors"],
     "not a readable safetensors"),
    (["make-checkpoint", "-o", "out/x.txt"], ".safetensors"),
    (["generate", "--prompt", "caf\udcc3\udca9 \udcff", "-o", O], "UTF-8"),
    (["generate", "--negative-prompt", "\udcff", "-o", O], "UTF-8"),
    (["generate", "--prompt", "x" * 100_000, "-o", O], "--max-prompt-chars"),
    (["generate", "--text-embeds", "garbage.png", "-o", O], "safetensors"),
    (["generate", "--text-embeds", "missing.safetensors", "-o", O], "not found"),
    (["generate", "--ref-image", "garbage.png", "-o", O], "not a readable image"),
    (["generate", "--ref-video", "garbage.png", "-o", O], "not a readable video"),
    (["generate", "--ref-audio", "garbage.png", "-o", O], "audio"),
    (["generate", *["--ref-video", "garbage.png"] * 4, "-o", O], "--ref-videos: 4 files; H3 takes at most 3"),
    (["generate", "--first-frame", "missing.png", "-o", O], "not found"),
    (["generate", "--cfg", "nan", "-o", O], "--cfg nan is not a finite number"),
    (["generate", "--cfg", "inf", "-o", O], "--cfg inf is not a finite number"),
    (["generate", "--cache-threshold=-inf", "-o", O], "not a finite number"),
    (["generate", "--steps", "1000000000", "-o", O], "--max-steps"),
    (["generate", "--frames", "100000", "-o", O], "--frames 100000"),
    (["generate", "--frames", "600", "-o", O], "--max-frames"),
    (["generate", "--width", "16384", "--height", "16384", "--frames", "124", "-o", O], "--max-pixel-frames"),
    (["generate", "--width", "100", "-o", O], "--width 100"),
    (["generate", "--seed", "-1", "-o", O], "--seed -1"),
    (["generate", "--sampler", "ddim", "-o", O], "ddim"),
    (["generate", "--scheduler", "karras", "-o", O], "karras"),
    (["generate", "--cache-mode", "lru", "-o", O], "lru"),
    (["generate", "--vae-dtype", "bf8", "-o", O], "bf8"),
    (["generate", "--attention", "warp_drive", "-o", O], "warp_drive"),
    (["generate", "--max-steps", "0", "-o", O], "--max-steps 0"),
    (["generate", "--no-overwrite", "-o", "out/kept.mp4"], "--output 'out/kept.mp4' exists already"),
    (["generate", "--sol-tau", "2", "-o", O], "--sol-tau: an option of sol_attn, which attention sdpa does not run"),
    (["generate", "--fp8-linear-layers", "fc1", "-o", O], "--fp8-linear-layers: an option of the 8-bit block linears"),
    (["trace", "--checkpoint", str(FIXTURES / "h3_fx_bf16.safetensors"), "--inputs",
      str(FIXTURES / "inputs_fx_t2va.safetensors"), "--out", "t.safetensors", "--head-slice-size", "4"],
     "--head-slice-size: an option of kj_head_sliced"),
    (["generate", "--no-overwrite", "--save-latent", "out/kept.safetensors", "-o", O],
     "--save-latent 'out/kept.safetensors' exists already"),
    (["decode-latent", "garbage.png", "--vae", "garbage.png", "--out", O], "not a readable safetensors"),
    (["decode-latent", "missing.safetensors", "--vae", "garbage.png", "-o", O], "not found"),
    (["decode-latent", "garbage.png", "--vae", "garbage.png", "--ffmpeg-loglevel", "loud", "-o", O], "'loud'"),
    (["serve", "--port", "99999"], "99999"),
    (["serve", "--port", "http"], "http"),
    (["serve", "--output-root", "file.png/out"], "not a folder"),
    (["serve", "--input-root", "missing"], "folder not found"),
    (["serve", "--queue-size", "-1"], "--queue-size"),
    (["serve", "--job-timeout", "0"], "--job-timeout"),
    (["serve", "--checkpoint", "missing.safetensors"], "not found"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_command_line_is_one_line_exit_2_before_any_compute(files, no_models, monkeypatch, capsys, argv,
                                                                needle):
    monkeypatch.chdir(files)
    before = sorted(p.name for p in files.rglob("*"))
    t = time.perf_counter()
    rc = cli.main(argv)
    elapsed = time.perf_counter() - t
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and needle in lines[0], err
    assert lines[0].startswith(f"h3direct {argv[0]}: error: "), lines[0]
    assert out == ""
    assert sorted(p.name for p in files.rglob("*")) == before  # no output, no temp file, no folder made
    assert elapsed < 5, f"{elapsed:.1f} s to refuse"


@pytest.mark.parametrize("argv,needle", [
    ([b"generate", b"--prompt", b"caf\xc3\xa9 \xff", b"-o", b"x.mp4"], b"UTF-8"),
    ([b"serve", b"--port", b"99999"], b"99999"),
    ([b"generate", b"-o", b"/proc/x.mp4"], b"cannot write"),
    ([b"decode-latent", b"garbage.png", b"--vae", b"garbage.png", b"--out", b"x.mp4"], b"safetensors"),
], ids=["non-utf8-prompt", "port", "proc-output", "garbage-latent"])
def test_real_process(files, argv, needle):
    """Through a real interpreter (argv as raw bytes): exit 2, one line, no traceback, nothing written."""
    before = sorted(p.name for p in files.rglob("*"))
    r = subprocess.run([PY, "-m", "h3direct", *argv], cwd=files, capture_output=True, timeout=60,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r
    assert len(r.stderr.splitlines()) == 1 and needle in r.stderr and b"Traceback" not in r.stderr, r.stderr
    assert r.stdout == b""
    assert sorted(p.name for p in files.rglob("*")) == before


def test_version(capsys):
    from h3direct import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"h3direct {__version__}"


def test_help_shows_choices_and_defaults(capsys):
    from h3direct.dit.options import BACKENDS
    from h3direct.sampling.rules import CACHE_MODES, SAMPLERS, SCHEDULERS

    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, choices, default in (("--sampler", SAMPLERS, "euler"),
                                   ("--scheduler", SCHEDULERS, "simple"),
                                   ("--cache-mode", CACHE_MODES, "off"),
                                   ("--vae-dtype", models.VAE_DTYPES, "fp16 on CUDA, fp32 on CPU"),
                                   ("--attention", BACKENDS, "sdpa")):
        assert f"{flag} {{{','.join(choices)}}}" in text, flag
        assert f"default: {default})" in text
    for flag in ("--seed", "--cache-threshold", "--cache-start-percent", "--max-steps", "--output FILE.mp4, -o"):
        assert flag in text
    assert "(default: 0)" in text and "(default: 100)" in text and "(default: clip.mp4)" in text
    assert "(default: None)" not in text and "(default: [])" not in text


def test_generate_replaces_its_own_output_unless_no_overwrite(cache_env, files, capsys):
    """The command line replaces an existing --output / --save-latent as it always has (its user names the path on
    their own machine); --no-overwrite refuses one before anything loads (the service's default: `overwrite`)."""
    argv = ["generate", "-o", str(files / "out" / "kept.mp4"), "--save-latent", str(files / "out" / "kept.safetensors")]
    parse = cli.build_parser("generate").parse_args
    assert cli_generate.parse(parse(argv)).request.overwrite is True
    assert cli_generate.parse(parse([*argv, "--overwrite"])).request.overwrite is True
    with pytest.raises(RequestError) as e:
        cli_generate.parse(parse([*argv, "--no-overwrite"]))
    assert (e.value.field, e.value.kind) == ("output", "conflict"), e.value
    assert cli.main(["generate", "--help"]) == 0
    assert "--overwrite, --no-overwrite" in " ".join(capsys.readouterr().out.split())


def test_choices_match_the_runtime():
    """The CLI names its choices without importing torch; they must be the runtime's own tables (the sampler's
    functions, the schedulers, the registered backends, the NVFP4 modes, the VAE dtypes, the cache defaults)."""
    from h3direct.app import cli_flags, cli_footprint, footprint, residency
    from h3direct.app.request import GenerateRequest
    from h3direct.dit.attention import backends
    from h3direct.dit.linear import NVFP4_MODES
    from h3direct.dit.options import BACKENDS
    from h3direct.sampling import sampler, schedules
    from h3direct.sampling.rules import SAMPLERS, SCHEDULERS, CacheSettings
    from h3direct.vae.api import VIDEO_DTYPES

    assert set(sampler._SAMPLER_FNS) == set(SAMPLERS)
    for name in SCHEDULERS:  # every name the request admits has a schedule
        assert len(schedules.scheduler_sigmas(name, 3)) == 4
    assert tuple(backends()) == BACKENDS and models.NVFP4_MODES == NVFP4_MODES
    assert set(models.VAE_DTYPES) <= set(VIDEO_DTYPES)
    assert models.TEXT_ENCODER_POLICIES == residency.POLICIES and cli_footprint.WEIGHTS == footprint.WEIGHTS
    from h3direct.vae import mp4

    assert cli_flags.FFMPEG_LOGLEVELS == tuple(mp4.FFMPEG_LOGLEVELS)
    defaults, request = CacheSettings(), GenerateRequest()
    for k in ("threshold", "start_percent", "end_percent", "subsample_factor"):
        assert getattr(request, f"cache_{k}") == getattr(defaults, k)


def test_every_parser_is_built_without_torch():
    """`h3direct --help` and each subcommand's parser name their choices from torch-free tables: building them all
    imports no torch (a flag table imported from a model module once made every `--help` load it)."""
    code = "import sys; from h3direct.app import cli; cli.build_parser(None); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-1500:]


def test_notes_for_a_snapped_frame_count_and_a_defaulted_size(cache_env, tmp_path):
    from h3direct.app import bundled

    ckpt = bundled.ensure().dit
    p = cli.build_parser("generate")
    args = p.parse_args(["generate", "--checkpoint", str(ckpt), "--frames", "30", "-o", str(tmp_path / "x.mp4")])
    job = cli_generate.parse(args)
    notes = job.notes
    assert (job.request.width, job.request.height, job.request.steps) == (bundled.DEFAULT_WIDTH,
                                                                         bundled.DEFAULT_HEIGHT, bundled.DEFAULT_STEPS)
    assert any("--width/--height/--steps" in n and "96x64" in n for n in notes), notes
    assert any("--frames 30 snapped up to 39" in n for n in notes), notes
    from h3direct.sampling.rules import align_frame_count  # the grid the note and the pipeline use

    assert align_frame_count(30) == 39 and align_frame_count(22) == 22 and align_frame_count(5) == 5


class _KillOnFirstMux:
    """A stand-in for PyAV's output container: sends this process SIGTERM when the first packet is muxed."""

    def __init__(self, real):
        self.real, self.sent = real, False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def mux(self, packets):
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return self.real.mux(packets)


def test_sigterm_during_the_write_leaves_no_temp_file(cache_env, tmp_path, monkeypatch, capsys):
    import av

    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: _KillOnFirstMux(real_open(*a, **k))
                        if k.get("mode") == "w" else real_open(*a, **k))
    out = tmp_path / "out"
    out.mkdir()
    handler = signal.getsignal(signal.SIGTERM)
    rc = cli.main(["generate", "--frames", "5", "--steps", "1", "--width", "32", "--height", "32", "--quiet",
                   "-o", str(out / "x.mp4")])
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted" in err, err
    assert list(out.iterdir()) == []  # neither the mp4 nor its temporary file
    assert signal.getsignal(signal.SIGTERM) == handler  # the CLI put the previous handler back


def test_serve_output_root_is_checked_as_a_folder(tmp_path):
    """Any entry inside --output-root (here a folder named like an mp4) is no reason to refuse it."""
    from h3direct.app.cli_serve import service_of

    (tmp_path / "probe.mp4").mkdir()
    args = cli.build_parser("serve").parse_args(["serve", "--output-root", str(tmp_path)])
    service_of(args).prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.mp4"]  # the write probe left nothing behind
