"""Replay works on every trace the gate accepts, also one that records outputs only (the oracle-format contract:
a layer's inputs are derived from the previous layer's outputs): `python -m oracle replay --layer L` takes the
names the gate prints and derives the inputs exactly as teacher forcing does — a linear, an MLP, an attention and
a whole block, with h3direct (--direct) and with ComfyUI (comfy-marked, the live re-check)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from parity_tests.discovery import FIXTURES, find_dit_cases
from parity_tests.gate import run_dit_case

STEM = "trace_fx_bf16_ref2va_fp32"
LAYERS = ["blocks.1.mlp.fc2.out", "blocks.1.mlp", "blocks.1.attn", "blocks.1", "token_refiner.blocks.0.attn.out"]
POSITIONAL_INPUT = re.compile(r"\.in\.\d+$")


@pytest.fixture(scope="module")
def outputs_only(tmp_path_factory) -> Path:
    """A copy of a fixture trace without any recorded module input (`*.in.N`) and without the manifest's
    inputs name: what a third-party trace laid out like ../shared/oracle looks like."""
    folder = tmp_path_factory.mktemp("outputs_only")
    m = json.loads((FIXTURES / f"{STEM}.json").read_text())
    tensors = {k: v for k, v in load_file(str(FIXTURES / f"{STEM}.safetensors")).items()
               if not POSITIONAL_INPUT.search(k)}
    m["order"] = [n for n in m["order"] if not POSITIONAL_INPUT.search(n)]
    m["tensors"] = {k: v for k, v in m["tensors"].items() if k in tensors}
    m["aliases"] = {k: v for k, v in m["aliases"].items() if not POSITIONAL_INPUT.search(k) and v in tensors}
    for k in ("inputs", "inputs_sha256", "static_inputs_note"):
        m.pop(k, None)
    save_file(tensors, str(folder / f"{STEM}.safetensors"))
    (folder / f"{STEM}.json").write_text(json.dumps(m))
    for name in (m["checkpoint"], "inputs_fx_ref2va.safetensors"):
        shutil.copy(FIXTURES / name, folder / name)
    assert not any(".in." in n and POSITIONAL_INPUT.search(n) for n in tensors)
    return folder / f"{STEM}.safetensors"


def test_gate_teacher_forces_an_outputs_only_trace(outputs_only):
    cases, problems = find_dit_cases([outputs_only.parent])
    assert not problems and len(cases) == 1, problems
    result = run_dit_case(cases[0], mode="teacher")
    assert result.passed, result.report()
    names = {r.name for r in result.layers}
    for name in ("blocks.1.out", "blocks.1.attn.out", "blocks.1.mlp.fc1.out", "blocks.1.mlp.fc2.out",
                 "blocks.1.attn.qkv_proj.out", "blocks.0.out", "final_layer.video_out.out"):
        assert name in names, f"{name} not teacher-forced on the outputs-only trace"


@pytest.mark.parametrize("layer", LAYERS)
def test_replay_direct_on_outputs_only_trace(outputs_only, layer, capsys):
    from oracle.__main__ import main

    rc = main(["replay", "--trace", str(outputs_only), "--layer", layer, "--direct", "--no-comfy", "--budget", "1e-5"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "[h3direct]" in out.out and "ok (" in out.out and "all within budget" in out.out, out.out


def test_replay_direct_reports_a_perturbed_layer(outputs_only, tmp_path, capsys):
    """The derived inputs come from the recorded outputs: scaling block 1's recorded output is caught there."""
    from oracle.__main__ import main

    for p in outputs_only.parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    path = tmp_path / outputs_only.name
    tensors = load_file(str(path))
    tensors["blocks.1.out"] = tensors["blocks.1.out"] * 1.01
    save_file(tensors, str(path))
    rc = main(["replay", "--trace", str(path), "--layer", "blocks.1", "--direct", "--no-comfy", "--budget", "1e-5"])
    out = capsys.readouterr().out
    assert rc == 1 and "OVER BUDGET" in out and "blocks.1.out" in out, out
    rc = main(["replay", "--trace", str(path), "--layer", "blocks.1", "--direct", "--no-comfy"])
    out = capsys.readouterr().out
    assert rc == 0 and "no rule given" in out, out  # without a rule: reported, not judged


def test_replay_needs_something_to_run(outputs_only, capsys, monkeypatch):
    from oracle.__main__ import main

    monkeypatch.delenv("H3_COMFY_ROOT", raising=False)
    rc = main(["replay", "--trace", str(outputs_only), "--layer", "blocks.1"])
    assert rc == 2 and "nothing to replay: pass --comfy-root" in capsys.readouterr().err
    # a kernel row has no ComfyUI side: the line asks for what it needs, never for a ComfyUI checkout
    rc = main(["replay", "--trace", str(outputs_only), "--layer", "blocks.1", "--mode", "kernel"])
    err = capsys.readouterr().err
    assert rc == 2 and "a kernel row is h3direct's side alone (pass --direct)" in err and "comfy-root" not in err, err


def test_a_bad_backend_option_is_one_line_before_the_trace_loads(outputs_only, capsys):
    from oracle.__main__ import main

    rc = main(["replay", "--trace", str(outputs_only), "--layer", "blocks.1", "--direct", "--attention", "sol_attn",
               "--option", "sol_tau=fast"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == "oracle replay: error: sol_tau='fast': must be a number", err


@pytest.mark.comfy
@pytest.mark.parametrize("layer", LAYERS)
def test_replay_comfy_on_outputs_only_trace(outputs_only, layer, comfy_root):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "oracle", "replay", "--trace", str(outputs_only), "--layer", layer,
                        "--comfy-root", comfy_root, "--direct", "--budget", "1e-5"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "[comfy]" in r.stdout and "[h3direct]" in r.stdout and "all within budget" in r.stdout, r.stdout


def test_recorded_inputs_of_a_fully_recorded_module():
    """ComfyUI replay's inputs for a module whose `.in.N` are recorded: every one, tensors and static values."""
    from h3direct.traces.format import load_trace
    from oracle.replay_sites import recorded_inputs

    trace = load_trace(FIXTURES / f"{STEM}.safetensors")
    args, kwargs = recorded_inputs(trace, "blocks.1")
    assert len(args) == 4 and not kwargs
    assert args[0].shape == trace.get("blocks.1.in.0").shape and isinstance(args[2], list)
    args, kwargs = recorded_inputs(trace, "blocks.1.attn")
    assert len(args) == 1 and kwargs["rope_freqs"].shape == trace.get("blocks.0.in.3").shape


def test_the_gates_printed_command_replays_a_low_precision_layer_by_its_rule(capsys):
    """A bf16 trace: the gate prints `--ratio 1.5 --floor 1e-05`; replay measures both sides against the layer's fp32
    evaluation on the same inputs and passes; an h3direct layer off by 5 % fails it."""
    from oracle.__main__ import main
    from parity_tests.models import model as load_model

    cases, _ = find_dit_cases([FIXTURES])
    case = next(c for c in cases if c.compute == "bf16" and c.twin_fp32 is not None)
    result = run_dit_case(case, mode="teacher")
    row = next(r for r in result.layers if r.name == "blocks.1.mlp.fc2.out")
    assert row.replay.endswith("--ratio 1.5 --floor 1e-05"), row.replay
    argv = row.replay.split()[3:]  # after "python -m oracle"
    assert main(argv + ["--no-comfy"]) == 0
    out = capsys.readouterr().out
    assert "vs fp32: ours" in out and "all within budget" in out, out
    from oracle import replay as R

    real = R.DerivedInputs.__init__

    def bent(self, *a, **k):  # h3direct's bf16 model (not the fp32 reference) with a 5 % error at fc2
        real(self, *a, **k)
        if not k.get("widen"):
            self.model.get_submodule("blocks.1.mlp.fc2").register_forward_hook(lambda m, i, out: out * 1.05)

    R.DerivedInputs.__init__ = bent
    try:
        assert main(argv + ["--no-comfy"]) == 1
    finally:
        R.DerivedInputs.__init__ = real
    assert "OVER BUDGET" in capsys.readouterr().out
    load_model.cache_clear()


@pytest.mark.parametrize("kind", ["vae", "generate"])
def test_replay_takes_vae_and_generation_traces(kind, capsys):
    """Every trace the gate takes: a VAE key and a generation step re-run whole by h3direct (--direct)."""
    from oracle.__main__ import main
    from parity_tests.discovery import find_generate_cases, find_vae_cases

    if kind == "vae":
        case = next(c for c in find_vae_cases([FIXTURES])[0] if c.dtype == "fp32")
        from h3direct.traces.format import load_trace

        layer = next(n for n in load_trace(case.trace).names_in_order() if n.endswith(".out"))
    else:
        case = find_generate_cases([FIXTURES])[0][0]
        layer = "sampler.step1.denoised.video"
    rc = main(["replay", "--trace", str(case.trace), "--layer", layer, "--direct", "--no-comfy", "--budget", "1e-5"])
    out = capsys.readouterr().out
    assert rc == 0 and f"[h3direct] {layer}" in out and "all within budget" in out, out
