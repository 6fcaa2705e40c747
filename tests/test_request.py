"""The typed request and options: one error type naming the field (spelled as a field for the HTTP API, as a flag on
the command line), each rule in one place, the environment read once with one boolean rule, and the new user's
trips: inputs that are not for the checkpoint, a checkpoint that is not a DiT, refused before anything is built."""

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from h3direct.app import cli
from h3direct.app.env import read_options, read_settings, variables
from h3direct.app.request import GenerateRequest, Roots
from h3direct.dit.options import AttentionOptions, FP8AttentionOptions, HeadSliceOptions, KernelOptions, Options
from h3direct.dit.sol_options import SolOptions
from h3direct.errors import ConfigError, H3Error, RequestError, flag_name

FIX = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("fields, field, kind, words", [
    ({"width": 100}, "width", "value", "width 100 must be a multiple of 32 in [32, 16384]"),
    ({"frames": 4}, "frames", "value", "frames 4 must be at least 5 and at most 3600"),
    ({"steps": 0}, "steps", "value", "steps 0 must be at least 1"),
    ({"seed": -1}, "seed", "value", "seed -1 must be in [0, 2^64)"),
    ({"cfg": float("nan")}, "cfg", "value", "cfg nan is not a finite number"),
    ({"sampler": "ddim"}, "sampler", "choice", "sampler 'ddim' is not supported; use one of euler, heun, dpmpp_2m"),
    ({"scheduler": "karras"}, "scheduler", "choice", "scheduler 'karras' is not supported"),
    ({"cache_mode": "lru"}, "cache_mode", "choice", "cache_mode 'lru' is not supported"),
    ({"ref_image_size": "huge"}, "ref_image_size", "choice", "ref_image_size 'huge' is not supported"),
    ({"prompt": "caf\udcc3"}, "prompt", "type", "prompt is not UTF-8 text"),
    ({"steps": "4"}, "steps", "type", "steps '4' must be an integer"),
    ({"ref_videos": ["a.mp4"] * 4}, "ref_videos", "value", "ref_videos: 4 files; H3 takes at most 3"),
    ({"first_frame": "f.png", "ref_images": ["r.png"]}, "first_frame/last_frame", "value", "separate tasks"),
    ({"steps": 101}, "steps", "value", "steps 101 is over the limit of 100 (--max-steps)"),
    ({"cache_mode": "easycache", "cache_start_percent": 0.9, "cache_end_percent": 0.1}, "cache_*", "value",
     "cache_*: cache start_percent=0.9, end_percent=0.1: need 0 ≤ start ≤ end ≤ 1"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_one_error_naming_the_field(fields, field, kind, words):
    with pytest.raises(RequestError) as e:
        GenerateRequest(**fields)
    err = e.value
    assert (err.field, err.kind) == (field, kind) and words in str(err) and "\n" not in str(err)
    # the command line spells the same error with its flags (the value and the words unchanged)
    assert err.render(flag_name).startswith("--" + field.split("/")[0].replace("_", "-"))


def test_a_valid_request_fills_its_defaults_and_resolves_its_files(tmp_path):
    (tmp_path / "p.txt").write_text("from a file\n")
    req = GenerateRequest(prompt_file="p.txt", output="out.mp4", roots=Roots(tmp_path, tmp_path))
    assert (req.width, req.height, req.frames, req.steps) == (96, 64, 22, 4)
    assert req.resolved.defaulted == ("width", "height", "frames", "steps")
    assert req.prompt_text == "from a file" and req.resolved.output == tmp_path / "out.mp4"
    assert dataclasses.replace(req, seed=1).seed == 1  # frozen: a change is a new, validated request
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.seed = 2
    with pytest.raises(RequestError, match=r"prompt_file '\.\./x': no such file under the input folder"):
        GenerateRequest(prompt_file="../x", roots=Roots(tmp_path))
    with pytest.raises(RequestError, match="must be a relative path inside the output folder"):
        GenerateRequest(output="/etc/x.mp4", roots=Roots(tmp_path, tmp_path))


@pytest.mark.parametrize("name,suffix", [("output", ".mp4"), ("save_latent", ".safetensors")])
@pytest.mark.parametrize("where", ["output_root", "path"])
def test_an_existing_output_is_refused_unless_overwrite(tmp_path, name, suffix, where):
    """`overwrite` off (the field's default): an output field that names an existing file is a 'conflict' (HTTP
    409) naming the field and the file, under the service's output folder and as a path alike."""
    (tmp_path / f"kept{suffix}").write_bytes(b"an earlier result")
    roots, given = (Roots(tmp_path, tmp_path), f"kept{suffix}") if where == "output_root" else \
        (Roots(), str(tmp_path / f"kept{suffix}"))
    with pytest.raises(RequestError) as e:
        GenerateRequest(**{name: given}, roots=roots)
    assert (e.value.field, e.value.kind) == (name, "conflict") and f"{name} {given!r} exists already" in str(e.value)
    req = GenerateRequest(**{name: given}, overwrite=True, roots=roots)
    assert getattr(req.resolved, name).resolve() == (tmp_path / f"kept{suffix}").resolve()
    assert (tmp_path / f"kept{suffix}").read_bytes() == b"an earlier result"  # nothing written by the checks


def test_options_round_trip_by_their_flat_names_and_check_their_rules():
    opts = Options(AttentionOptions("sol_attn", sol_attn=SolOptions(tau=2.0, exact_rows=False),
                                    fa3_fp8=FP8AttentionOptions(smooth_v=False),
                                    kj_head_sliced=HeadSliceOptions(size=4)),
                   KernelOptions(fused=False, mlp_chunks=3, fp8_linear="stream"))
    flat = opts.flat()
    assert flat["attention"] == "sol_attn" and flat["sol_tau"] == 2.0 and flat["head_slice_size"] == 4
    assert Options.from_flat(flat) == opts
    assert Options.from_flat({"sol_tau": 2.0}).attention.sol_attn.tau == 2.0
    for bad, words in (({"sol_tau": -1.0}, "sol_tau -1.0 must be a positive number"),
                       ({"head_slice_size": 0}, "head_slice_size 0 must be a positive integer"),
                       ({"mlp_chunks": 0}, "mlp_chunks 0 must be an integer >= 1"),
                       ({"fp8_linear": "fast"}, "fp8_linear 'fast' is not supported"),
                       ({"sol_taus": 1.0}, "sol_taus: not an option")):
        with pytest.raises(RequestError, match=words.replace("(", r"\(")):
            Options.from_flat(bad)


def test_name_value_assignments_by_the_variables_rule():
    """The gate's, replay's and e2e_frames' `--option NAME=VALUE`: typed by each option's rule, one line if bad."""
    from h3direct.dit.options import assignments, changed_options, describe, parse_assignments

    got = parse_assignments(["sol_tau=2", "sol_exact_rows=off", "head_slice_backend=fa3"], only="attention")
    assert got == {"sol_tau": 2.0, "sol_exact_rows": False, "head_slice_backend": "fa3"}
    assert parse_assignments(["mlp_chunks=3"]) == {"mlp_chunks": 3}
    opts = Options.from_flat({"attention": "sol_attn", **got}).attention
    # labels and replay flags name the options in effect: sol_attn never hands a call to kj_head_sliced
    in_effect = {"sol_tau": 2.0, "sol_exact_rows": False}
    assert changed_options(opts) == in_effect
    assert describe(opts) == "sol_attn (sol_tau=2, sol_exact_rows=off)"
    sliced = Options.from_flat({"attention": "kj_head_sliced", **got, "head_slice_backend": "sol_attn"}).attention
    assert describe(sliced) == "kj_head_sliced (sol_tau=2, sol_exact_rows=off, head_slice_backend=sol_attn)"
    # the spelling the labels and replay commands print reads back to the same values
    assert parse_assignments(assignments(got), only="attention") == got
    assert changed_options(Options.from_flat({"attention": "sdpa", **got}).attention) == {}
    assert assignments({"sol_tau": 1.25, "fused": True}) == ["sol_tau=1.25", "fused=on"]
    assert describe(AttentionOptions("sage2")) == "sage2"
    for bad, words in ((["sol_tau"], "'sol_tau': must be NAME=VALUE"),
                       (["sol_tau=x"], "sol_tau='x': must be a number"),
                       (["sol_tau=0"], "sol_tau='0': must be a positive number"),
                       (["sol_exact_rows=maybe"], "must be 1/0, true/false"),
                       (["fused=0"], "fused: not a backend's option"),  # a kernel option: not an attention one
                       (["attention=sage2"], "attention: not a backend's option"),  # that is --attention
                       (["sol_taus=1"], "sol_taus: not a backend's option (one of: sol_tau, ")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
            parse_assignments(bad, only="attention")


@pytest.mark.parametrize("raw, value", [("1", True), ("0", False), ("true", True), ("FALSE", False), ("yes", True),
                                        ("no", False), ("on", True), ("off", False)])
def test_one_boolean_rule_for_every_switch(raw, value):
    switches = [name for name in variables() if name in ("H3_FUSED", "H3_FP8_STRICT", "H3_SOL_STRICT",
                                                          "H3_FP8_ATTN_STRICT", "H3_FP8_ATTN_SMOOTH_V",
                                                          "H3_FP8_ATTN_ROTATE", "H3_SOL_EXACT_ROWS", "H3_SOL_TAIL")]
    assert len(switches) == 8  # once parsed each its own way (any non-"0", exactly "1", exactly 0/1)
    for name in switches:
        assert list(read_options({name: raw}).values()) == [value], name


@pytest.mark.parametrize("env, words", [
    ({"H3_FUSED": "maybe"}, "H3_FUSED='maybe': must be 1/0, true/false, yes/no or on/off"),
    ({"H3_FP8_STRICT": "2"}, "H3_FP8_STRICT='2'"),
    ({"H3_HEAD_SLICE_SIZE": "x"}, "H3_HEAD_SLICE_SIZE='x': must be an integer"),
    ({"H3_HEAD_SLICE_SIZE": "0"}, "H3_HEAD_SLICE_SIZE='0': must be a positive integer"),
    ({"H3_SOL_TAU": "-1"}, "H3_SOL_TAU='-1': must be a positive number"),
    ({"H3_NVFP4_DEQUANT": "cutlass"}, "H3_NVFP4_DEQUANT='cutlass': is not supported"),
    ({"H3_SOL_INT8_QK": "1"}, "no precision switch"),
    ({"H3_VAE_TILE_SIZE": "-2"}, "H3_VAE_TILE_SIZE='-2'"),
])
def test_a_bad_variable_is_one_line_at_startup(env, words, tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        read_settings(env) if env.keys() == {"H3_VAE_TILE_SIZE"} else read_options(env)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for command in (["generate", "-o", str(tmp_path / "x.mp4")], ["serve", "--port", "0"]):
        t = time.perf_counter()
        rc = cli.main(command)
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and next(iter(env)) in err, err
        assert time.perf_counter() - t < 10 and not (tmp_path / "x.mp4").exists()


def test_a_flag_wins_over_the_environment(tmp_path):
    from h3direct.app import cli_generate

    args = cli.build_parser("generate").parse_args(["generate", "--nvfp4-dequant", "torch", "--fused", "-o",
                                                   str(tmp_path / "x.mp4")])
    job = cli_generate.parse(args, env={"H3_NVFP4_DEQUANT": "kitchen", "H3_FUSED": "0", "H3_SOL_TAIL": "off"})
    k = job.options.kernels
    assert (k.nvfp4_dequant, k.fused, job.options.attention.sol_attn.tail) == ("torch", True, False)
    # a backend's option from the environment is a default for when that backend runs (compose passes them all);
    # given as a flag beside a backend that never reads it, it is one line
    args = cli.build_parser("generate").parse_args(["generate", "--sol-tau", "1.5", "-o", str(tmp_path / "x.mp4")])
    with pytest.raises(ConfigError, match="--sol-tau: an option of sol_attn, which attention sdpa does not run"):
        cli_generate.parse(args, env={})


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model load, any bundled model built, any DiT evaluation fails the test."""
    from h3direct.app import bundled
    from h3direct.dit import loader
    from h3direct.traces import evaluate
    from h3direct.vae import loader as vae_loader

    def tripwire(*a, **k):
        raise AssertionError("something was built, loaded or computed before the refusal")

    for mod, name in ((bundled, "ensure"), (loader, "load_dit"), (vae_loader, "load_video_vae"),
                      (vae_loader, "load_audio_vae"), (evaluate, "one_step")):
        monkeypatch.setattr(mod, name, tripwire)


def test_trace_inputs_for_another_checkpoint_are_one_line_before_compute(tmp_path, capsys, nothing_loads):
    """The new user's command: the td80 inputs (80-wide text states) with the 96-wide checkpoint used to end in a
    31-line traceback from a matrix product; now one line, exit 2, nothing loaded or run."""
    rc = cli.main(["trace", "--checkpoint", str(FIX / "h3_fx_bf16.safetensors"), "--inputs",
                   str(FIX / "inputs_fx_td80_t2va.safetensors"), "--out", str(tmp_path / "t.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "text_states [1, 8, 80] are 80 wide; the checkpoint takes [1, L, 96]" in err and "Traceback" not in err
    assert not (tmp_path / "t.safetensors").exists()


def test_trace_vae_inputs_for_another_vae_are_one_line(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({"video_decode.x.latent": torch.zeros(1, 16, 1, 3, 3)}, str(tmp_path / "in.safetensors"))
    rc = cli.main(["trace-vae", "--weights", str(FIX / "vae_video_fx.safetensors"), "--config",
                   str(FIX / "vae_config_fixture.json"), "--inputs", str(tmp_path / "in.safetensors"), "--out",
                   str(tmp_path / "t.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "video_decode.x.latent [1, 16, 1, 3, 3]" in err, err


@pytest.mark.parametrize("content, words", [
    ("truncated", "--checkpoint: header length 5200 runs past the end of the file (size 5000)"),
    ("text", "--checkpoint: header length"),
    ("vae", "--checkpoint: not an H3 DiT checkpoint"),
], ids=["truncated", "text", "a-vae"])
def test_a_bad_checkpoint_is_refused_by_its_header_before_anything_is_built(tmp_path, capsys, nothing_loads,
                                                                             content, words):
    ck = tmp_path / "ck.safetensors"
    if content == "truncated":
        ck.write_bytes((FIX / "h3_fx_bf16.safetensors").read_bytes()[:5000])
    elif content == "text":
        ck.write_text("this is a text file, not a checkpoint\n")
    else:
        ck.write_bytes((FIX / "vae_video_fx.safetensors").read_bytes())
    t = time.perf_counter()
    rc = cli.main(["generate", "--checkpoint", str(ck), "-o", str(tmp_path / "x.mp4")])  # (no size flags: a note)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "note" not in err, err
    assert words in err and err.startswith("h3direct generate: error: "), err
    assert time.perf_counter() - t < 5 and not (tmp_path / "x.mp4").exists()


def test_text_embeds_for_another_checkpoint_are_refused_from_its_header(tmp_path, capsys, nothing_loads):
    from safetensors.torch import save_file

    save_file({"text_states": torch.zeros(1, 4, 80), "token_tags": torch.ones(4, dtype=torch.long)},
              str(tmp_path / "e.safetensors"))
    rc = cli.main(["generate", "--checkpoint", str(FIX / "h3_fx_bf16.safetensors"), "--text-embeds",
                   str(tmp_path / "e.safetensors"), "-o", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--text-embeds: text states [1, 4, 80]" in err, err


def test_a_text_encoder_needs_its_tokenizer_before_anything_loads(tmp_path, capsys, nothing_loads):
    """H3_COMFY_ROOT is not the runtime's: a text encoder's tokenizer comes with its files or from --tokenizer."""
    from h3direct.app.models import ModelSpec

    te = tmp_path / "models" / "te.safetensors"
    te.parent.mkdir()
    from safetensors.torch import save_file

    from h3direct.text.qwen import comfy_state_dict, make_tiny_text_encoder

    save_file(comfy_state_dict(make_tiny_text_encoder(0)), str(te))
    with pytest.raises(RequestError, match="no tokenizer comes with it"):
        ModelSpec(text_encoder=str(te))
    tok = te.parent / "qwen25_tokenizer"
    tok.mkdir()
    (tok / "vocab.json").write_text("{}")
    with pytest.raises(RequestError, match=r"not a Qwen2 tokenizer folder \(no merges.txt\)"):
        ModelSpec(text_encoder=str(te), tokenizer=str(tok))
    (tok / "merges.txt").write_text("")
    assert ModelSpec(text_encoder=str(te)).text_encoder == str(te)  # found beside the file
    with pytest.raises(H3Error, match="not a Qwen3-VL text encoder"):
        ModelSpec(text_encoder=str(FIX / "vae_video_fx.safetensors"), tokenizer=str(tok))
