"""Generations on the bundled models hold to a golden made by h3direct 5c36f66, before the request and options were
typed, within the fp32 rule, under two ATen CPU capabilities; they are the same bits with every option spelled out
at its default (flags and environment), and the same bits again from a clip's own provenance (`generate
--from-provenance`), options included; `--save-latent` feeds `decode-latent`, which takes the bundled VAEs and their
preset.

Bitwise is kept for what is bitwise by construction: the same process on the same machine making a clip twice (or
again from its provenance). The golden was made on one machine: another CPU's vector kernels (AVX2 / AVX-512, MKL)
round fp32 otherwise, so a generation there is the same math, not the same bits, and is held to the project's fp32
rule ([rules].fp32_limit of `parity_tests/budgets.toml`, rel-L2). `python tests/test_regenerate.py OUT.npz` writes
a golden's latents (the golden's layout), as the pinned runs below do."""

import hashlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import av  # (the media extra: CI installs it, so its absence fails)
import numpy as np
import pytest
import torch

from h3direct.app import cli

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "fixtures" / "generate" / "bundled_golden.npz"
FP32_LIMIT = float(tomllib.loads((REPO / "parity_tests" / "budgets.toml").read_text())["rules"]["fp32_limit"])
# the golden's requests (made with H3Pipeline.bundled() on one CPU thread, the generate command's choice for them)
CASES = {"t2va": dict(prompt="a golden clip", width=32, height=32, frames=22, steps=2, seed=7),
         "t2va_heun_cfg": dict(prompt="a golden clip", negative_prompt="noise", width=64, height=32, frames=5, steps=2,
                               seed=3, sampler="heun", cfg=2.0)}
PARTS = ("video_latent", "audio_latent")


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def within_fp32_rule(got: np.ndarray, ref: np.ndarray) -> tuple[bool, str]:
    """(passes, what was measured): the same shape and rel-L2 against `ref` at most [rules].fp32_limit."""
    if np.shape(got) != np.shape(ref):
        return False, f"shape {np.shape(got)} vs {np.shape(ref)}"
    rel = rel_l2(got, ref)
    return rel <= FP32_LIMIT, f"rel_l2 {rel:.3e} (limit {FP32_LIMIT:g})"


def generate_cases(out: Path) -> None:
    """The golden's generations on the bundled models, one CPU thread, written as the golden's latents plus the ATen
    CPU capability they ran under."""
    from h3direct.app.pipeline import H3Pipeline
    from h3direct.app.request import GenerateRequest

    torch.set_num_threads(1)
    pipe = H3Pipeline.bundled()
    arrays = {"capability": np.array(torch.backends.cpu.get_cpu_capability().lower())}
    for name, request in CASES.items():
        res = pipe.generate(GenerateRequest(**request))
        arrays.update({f"{name}.{part}": getattr(res, part).numpy() for part in PARTS})
    np.savez(out, **arrays)


def capabilities() -> tuple[str, str]:
    """Two ATen CPU capabilities to pin: the portable one and this CPU's own (AVX2 where that is the portable one)."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    return "default", native if native != "default" else "avx2"


@pytest.fixture(scope="module")
def pinned(cache_env, tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """The golden's generations under each capability of `capabilities()`: one subprocess each, side by side (ATen
    reads ATEN_CPU_CAPABILITY once, at start), on the session's bundled models, built in this process: their random
    weights come from torch.randn, whose vectorized path rounds otherwise than the default one, so a bundle built
    under `default` holds other weights, and these runs are to differ in their kernels only."""
    tmp = tmp_path_factory.mktemp("pinned")
    procs = {cap: subprocess.Popen([sys.executable, __file__, str(tmp / f"{cap}.npz")], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env={**os.environ, "ATEN_CPU_CAPABILITY": cap})
             for cap in capabilities()}
    runs = {}
    for cap, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={cap}:\n{out[-3000:]}"
        with np.load(tmp / f"{cap}.npz") as f:
            runs[cap] = dict(f)
    return runs


def test_each_run_ran_under_its_pinned_capability(pinned):
    a, b = capabilities()
    assert a != b
    assert {cap: str(run["capability"]) for cap, run in pinned.items()} == {a: a, b: b}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("cap", capabilities())
def test_bundled_generation_holds_to_the_golden(pinned, cap, name):
    """Both latents of each case within the fp32 rule of the golden's. The golden's frames and audio are checked
    through them: the golden holds sha256 hashes of its uint8 frames and audio, which no tolerance can be applied
    to, and a latent within the rule may move a decoded value across a uint8 rounding boundary; the frames and
    audio are the bundled VAEs' decode of these latents (`test_save_latent_then_decode_latent_with_the_bundled_vaes`
    holds a clip's frames to `decode-latent`'s of its saved latent), and the VAEs are gated against ComfyUI."""
    with np.load(GOLDEN) as golden:
        for part in PARTS:
            ok, measured = within_fp32_rule(pinned[cap][f"{name}.{part}"], golden[f"{name}.{part}"])
            assert ok, f"{name}.{part} under ATEN_CPU_CAPABILITY={cap}: {measured}"


def test_the_rule_rejects_a_latent_off_by_1e_4():
    rng = np.random.default_rng(0)
    with np.load(GOLDEN) as golden:
        for key in (f"{name}.{part}" for name in CASES for part in PARTS):
            ref = golden[key]
            direction = rng.standard_normal(ref.shape)
            for rel, accepted in ((1e-4, False), (1e-7, True)):
                moved = ref + rel * np.linalg.norm(ref) / np.linalg.norm(direction) * direction
                assert within_fp32_rule(moved.astype(np.float32), ref)[0] is accepted, (key, rel)
            assert not within_fp32_rule(ref[..., :-1], ref)[0]


def _generate(tmp_path, capsys, name: str, *argv: str, env: dict | None = None, monkeypatch=None) -> dict:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    prompt = [] if "--prompt-file" in argv else ["--prompt", "the same clip"]
    rc = cli.main(["generate", "--width", "32", "--height", "32", "--frames", "5", "--steps", "2", "--seed", "4",
                   *prompt, "-o", str(tmp_path / name), *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    for k in env or {}:
        monkeypatch.delenv(k)
    return json.loads(out)


def _frames_and_audio(path) -> tuple[list, list]:
    with av.open(str(path)) as c:
        frames = [f.to_ndarray() for f in c.decode(video=0)]
    with av.open(str(path)) as c:
        audio = [f.to_ndarray() for f in c.decode(audio=0)]
    return frames, audio


def _same_media(a, b) -> bool:
    (fa, aa), (fb, ab) = _frames_and_audio(a), _frames_and_audio(b)
    return len(fa) == len(fb) and all(np.array_equal(x, y) for x, y in zip(fa, fb)) and \
        len(aa) == len(ab) and all(np.array_equal(x, y) for x, y in zip(aa, ab))


def test_every_option_spelled_out_at_its_default_is_the_same_clip(cache_env, tmp_path, capsys, monkeypatch):
    from h3direct.dit.options import Options, not_in_effect

    plain = _generate(tmp_path, capsys, "plain.mp4")
    defaults = Options().flat()
    flags = []
    idle = set(not_in_effect(Options(), defaults))  # the options of backends sdpa never calls: refused as flags
    assert {"sol_tau", "fp8_attn_rotate", "head_slice_size", "fp8_linear_layers"} <= idle
    for name, value in defaults.items():
        if name in idle:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else f"--no-{name.replace('_', '-')}"] if isinstance(value, bool) else [flag, str(value)]
    env = {"H3_SOL_TAU": "1.3", "H3_FUSED": "yes", "H3_FP8_ATTN_SMOOTH_V": "on", "H3_HEAD_SLICE_SIZE": "8"}
    spelled = _generate(tmp_path, capsys, "spelled.mp4", *flags, env=env, monkeypatch=monkeypatch)
    assert spelled["provenance"]["options"] == plain["provenance"]["options"] == defaults
    assert _same_media(tmp_path / "plain.mp4", tmp_path / "spelled.mp4")
    assert (tmp_path / "plain.mp4").read_bytes() == (tmp_path / "spelled.mp4").read_bytes()  # the tag too


def _cpu_sol_attn(monkeypatch):
    """sol_attn has no CPU kernel: a stand-in registered with the same options class, whose output depends on its
    options (tau scales the scores), so that a clip made with a non-default tau differs from the default one."""
    import torch.nn.functional as F

    from h3direct.dit import attention as A
    from h3direct.dit.sol_options import SolOptions

    def stand_in(q, k, v, opts):
        return F.scaled_dot_product_attention(q, k, A.dense_rows(v), scale=opts.sol_attn.tau / q.shape[-1] ** 0.5)

    monkeypatch.setitem(A._REGISTRY, "sol_attn", A.Backend("sol_attn", stand_in, lambda like, opts: None,
                                                           exact=False, options=SolOptions))


def test_from_provenance_remakes_the_clip_bitwise_options_included(cache_env, tmp_path, capsys, monkeypatch):
    """A clip made with --attention sol_attn and a non-default tau (a CPU stand-in of sol_attn that uses tau) is made
    again from its own mp4, bit for bit, with nothing else on the command line but the output."""
    _cpu_sol_attn(monkeypatch)
    made = _generate(tmp_path, capsys, "made.mp4", "--attention", "sol_attn", "--sol-tau", "2.0", "--cfg", "1.5",
                     "--negative-prompt", "blur")
    _generate(tmp_path, capsys, "tau13.mp4", "--attention", "sol_attn", "--cfg", "1.5",
                            "--negative-prompt", "blur")
    assert made["provenance"]["options"]["sol_tau"] == 2.0 and made["attention"] == "sol_attn"
    assert not _same_media(tmp_path / "made.mp4", tmp_path / "tau13.mp4")  # tau reaches the computation
    rc = cli.main(["generate", "--from-provenance", str(tmp_path / "made.mp4"), "-o", str(tmp_path / "again.mp4")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    again = json.loads(out)
    assert again["provenance"] == made["provenance"]
    assert (tmp_path / "again.mp4").read_bytes() == (tmp_path / "made.mp4").read_bytes()
    # a flag given as well wins over the recorded value
    rc = cli.main(["generate", "--from-provenance", str(tmp_path / "made.mp4"), "--sol-tau", "1.3", "-o",
                   str(tmp_path / "again13.mp4")])
    assert rc == 0, capsys.readouterr().err
    assert _same_media(tmp_path / "again13.mp4", tmp_path / "tau13.mp4")


def test_from_provenance_finds_its_references_and_refuses_what_it_cannot_remake(cache_env, tmp_path, capsys,
                                                                              monkeypatch):
    from PIL import Image

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # "here", the other folder a reference is looked for in

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "r.png")
    rc = cli.main(["generate", "--width", "32", "--height", "32", "--frames", "5", "--steps", "1", "--prompt",
                   "<Picture 1>", "--ref-images", str(tmp_path / "r.png"), "-o", str(tmp_path / "ref.mp4"), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    rc = cli.main(["generate", "--from-provenance", str(tmp_path / "ref.mp4"), "-o", str(tmp_path / "ref2.mp4"),
                   "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "ref2.mp4").read_bytes() == (tmp_path / "ref.mp4").read_bytes()
    recorded, other = (hashlib.sha256(b).hexdigest()[:12] for b in ((tmp_path / "r.png").read_bytes(), b"changed"))
    made_with = f"--ref-images: the clip was made with 'r.png' (sha256 {recorded}...)"
    changed = f"{made_with}, found at {tmp_path / 'r.png'} but its sha256 differs ({other}...)"
    for change, output, needle in ((None, "ref.mp4", "the clip being made again"),
                                   ("changed", "x.mp4", changed),
                                   ("removed", "x.mp4", made_with)):
        if change == "changed":
            (tmp_path / "r.png").write_bytes(b"changed")  # the reference is not the recorded one any more
        if change == "removed":
            (tmp_path / "r.png").unlink()
        rc = cli.main(["generate", "--from-provenance", str(tmp_path / "ref.mp4"), "-o", str(tmp_path / output)])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
        assert ("found neither beside ref.mp4 nor here" in err) == (change == "removed"), err
    (tmp_path / "plain.mp4").write_bytes((tmp_path / "ref.mp4").read_bytes()[:100])
    rc = cli.main(["generate", "--from-provenance", str(tmp_path / "plain.mp4"), "-o", str(tmp_path / "y.mp4")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--from-provenance" in err, err


def test_save_latent_then_decode_latent_with_the_bundled_vaes(cache_env, tmp_path, capsys):
    """The new user's path: generate --save-latent F, then decode-latent F with no VAE flags at all (the bundled
    VAEs), or with their preset named as generate takes it (--vae-config tiny)."""
    from h3direct.app import bundled

    s = _generate(tmp_path, capsys, "gen.mp4", "--save-latent", str(tmp_path / "lat.safetensors"))
    assert s["output"].endswith("gen.mp4") and (tmp_path / "lat.safetensors").is_file()
    b = bundled.ensure()
    for extra in ([], ["--vae", str(b.video_vae), "--audio-vae", str(b.audio_vae)],
                  ["--vae", str(b.video_vae), "--vae-config", "tiny", "--audio-vae", str(b.audio_vae)]):
        out = tmp_path / f"dec{len(extra)}.mp4"
        rc = cli.main(["decode-latent", str(tmp_path / "lat.safetensors"), "-o", str(out), *extra])
        stdout, err = capsys.readouterr()
        assert rc == 0, err
        assert json.loads(stdout)["frames"] == 5
        # the same decoder as generate's: the same frames (the container's tag aside)
        assert all(np.array_equal(x, y) for x, y in zip(_frames_and_audio(out)[0],
                                                        _frames_and_audio(tmp_path / "gen.mp4")[0]))
    # a latent that is not for these VAEs: one line, before anything is decoded
    from safetensors.torch import save_file

    save_file({"video_latent": torch.zeros(1, 16, 2, 2, 2)}, str(tmp_path / "bad.safetensors"))
    rc = cli.main(["decode-latent", str(tmp_path / "bad.safetensors"), "-o", str(tmp_path / "bad.mp4")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "16 channels" in err, err
    assert not (tmp_path / "bad.mp4").exists()


def test_prompt_file_is_the_prompt(cache_env, tmp_path, capsys):
    long = "a long prompt " * 200  # too long for some shells' comfort, fine for the limit (4096)
    (tmp_path / "p.txt").write_text(long + "\n", encoding="utf-8")
    a = _generate(tmp_path, capsys, "a.mp4", "--prompt-file", str(tmp_path / "p.txt"))
    rc = cli.main(["generate", "--width", "32", "--height", "32", "--frames", "5", "--steps", "2", "--seed", "4",
                   "--prompt", long, "-o", str(tmp_path / "b.mp4")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert a["provenance"]["prompt"] == long and _same_media(tmp_path / "a.mp4", tmp_path / "b.mp4")
    (tmp_path / "bad.txt").write_bytes(b"caf\xff")
    (tmp_path / "big.txt").write_text("x" * 5000)
    for argv, needle in ((["--prompt-file", str(tmp_path / "bad.txt")], "not UTF-8"),
                         (["--prompt-file", str(tmp_path / "big.txt")], "--max-prompt-chars"),
                         (["--prompt-file", str(tmp_path / "nope.txt")], "not found"),
                         (["--prompt-file", str(tmp_path / "p.txt"), "--prompt", "x"], "--prompt/--prompt-file are both given")):
        rc = cli.main(["generate", *argv, "-o", str(tmp_path / "x.mp4")])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, (argv, err)


if __name__ == "__main__":
    generate_cases(Path(sys.argv[1]))
