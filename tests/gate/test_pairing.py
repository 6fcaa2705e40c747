"""Pairing traces with their inputs cannot be fooled: a folder mixing two model configs (text_dim 96 and 80) whose
inputs files share seed and geometry (identical noise and latents, hence identical sampler.x_in) pairs each trace
with its own inputs, also without the manifests' `inputs` names (the shared layout); two different candidates that
both reproduce a trace are a one-line error naming both; a replaced file fails its recorded sha256."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from parity_tests.discovery import FIXTURES, find_dit_cases
from parity_tests.gate import run_dit_case

MICRO = "trace_fx_micro_td80_t2va_fp32"  # text_dim 80, inputs_fx_td80_t2va
WIDE = "trace_fx_curve_bf16_t2va_mask_fp32"  # text_dim 96, inputs_fx_t2va_mask (same noise/latents)


def _copy_case(stem: str, folder: Path, *, anonymous: bool) -> dict:
    m = json.loads((FIXTURES / f"{stem}.json").read_text())
    for name in (f"{stem}.safetensors", m["checkpoint"], m["inputs"]):
        shutil.copy(FIXTURES / name, folder / name)
    if anonymous:  # the shared layout: the manifest names no inputs file
        m = {k: v for k, v in m.items() if k not in ("inputs", "inputs_sha256")}
    (folder / f"{stem}.json").write_text(json.dumps(m))
    return m


def _write_inputs_like(src: Path, dst: Path, **changes: torch.Tensor) -> None:
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src))
    tensors.update(changes)
    save_file(tensors, str(dst), metadata=meta)


@pytest.fixture
def mixed(tmp_path) -> Path:
    _copy_case(MICRO, tmp_path, anonymous=True)
    _copy_case(WIDE, tmp_path, anonymous=True)
    # decoys of the micro trace's task (t2va) with the same noise / latents: text_dim 96, and 80 wide but other text
    shutil.copy(FIXTURES / "inputs_fx_t2va.safetensors", tmp_path / "inputs_aa_wide_t2va.safetensors")
    other = torch.randn(1, 8, 80, generator=torch.Generator().manual_seed(7))
    _write_inputs_like(FIXTURES / "inputs_fx_td80_t2va.safetensors", tmp_path / "inputs_ab_prompt2.safetensors",
                       text_states=other)
    return tmp_path


def test_two_models_same_seed_pair_by_every_recorded_input(mixed):
    from h3direct.traces.format import load_trace
    from h3direct.traces.pairing import input_mismatch

    cases, problems = find_dit_cases([mixed])
    assert not problems, problems
    paired = {c.trace.stem: c.inputs.name for c in cases}
    assert paired == {MICRO: "inputs_fx_td80_t2va.safetensors", WIDE: "inputs_fx_t2va_mask.safetensors"}
    # sampler.x_in alone cannot tell them apart: the decoys reproduce it bit for bit
    trace = load_trace(mixed / f"{MICRO}.safetensors")
    for decoy in ("inputs_aa_wide_t2va.safetensors", "inputs_ab_prompt2.safetensors"):
        x = load_file(str(mixed / decoy))
        assert torch.equal(0.8 * x["video_noise"] + (1 - torch.tensor([0.8])) * x["video_latent"],
                           trace.get("sampler.x_in.video"))
        why = input_mismatch(mixed / decoy, trace, mixed / "h3_fx_micro_td80_bf16.safetensors")
        assert why is not None and ("text" in why), why
    for case in cases:
        result = run_dit_case(case, mode="teacher")
        assert result.passed, result.report()


def test_two_fitting_candidates_are_one_ambiguity_line(mixed):
    # a second file reproducing every input the trace holds, but differing where the trace cannot tell
    src = FIXTURES / "inputs_fx_td80_t2va.safetensors"
    tags = load_file(str(src))["token_tags"].clone()
    tags[0] = 0
    _write_inputs_like(src, mixed / "inputs_zz_copy.safetensors", token_tags=tags)
    _, problems = find_dit_cases([mixed])
    line = next(p for p in problems if MICRO in p)
    assert "\n" not in line and "ambiguous" in line
    assert "inputs_fx_td80_t2va.safetensors" in line and "inputs_zz_copy.safetensors" in line


def test_recorded_sha256_wins_and_catches_a_replaced_file(tmp_path):
    m = _copy_case(MICRO, tmp_path, anonymous=False)
    assert m.get("inputs_sha256") and m.get("checkpoint_sha256"), "oracle record writes both digests"
    cases, problems = find_dit_cases([tmp_path])
    assert not problems and cases[0].inputs.name == m["inputs"]
    other = torch.randn(1, 8, 80, generator=torch.Generator().manual_seed(7))
    _write_inputs_like(FIXTURES / m["inputs"], tmp_path / m["inputs"], text_states=other)
    _, problems = find_dit_cases([tmp_path])
    assert len(problems) == 1 and "does not match the manifest's inputs_sha256" in problems[0], problems
