"""Manifests are verified, not trusted: every committed fixture trace names the ComfyUI commit and the sha256 of the
H3 sources that recorded it and carries a sha256 per tensor; a trace whose tensors do not match its manifest is a
problem of discovery (the gate fails: test_traces_pair_up); live mode warns when the ComfyUI checkout's H3 sources
are not the ones the traces were recorded with."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from h3direct.traces.format import load_trace, tensor_sha256, verify_trace
from parity_tests.discovery import FIXTURES, find_dit_cases, find_generate_cases, find_vae_cases

FIXTURE_TRACES = sorted(FIXTURES.glob("trace_*.safetensors"))
STEM = "trace_fx_micro_td80_t2va_fp32"


@pytest.mark.parametrize("path", FIXTURE_TRACES, ids=[p.stem for p in FIXTURE_TRACES])
def test_fixture_manifest_names_its_recording_and_digests(path: Path):
    trace = load_trace(path)
    m = trace.manifest
    assert re.fullmatch(r"[0-9a-f]{7,40}", str(m.get("comfyui_commit", ""))), m.get("comfyui_commit")
    assert re.fullmatch(r"[0-9a-f]{64}", str((m.get("environment") or {}).get("h3_sources_sha256", "")))
    for name in trace.stored:
        assert re.fullmatch(r"[0-9a-f]{64}", m["tensors"][name].get("sha256", "")), f"{name}: no sha256"
    assert verify_trace(trace) == []
    for key, file in (("checkpoint_sha256", "checkpoint"), ("inputs_sha256", "inputs"), ("weights_sha256", "weights")):
        if m.get(file):
            assert re.fullmatch(r"[0-9a-f]{64}", str(m.get(key, ""))), f"{file} recorded without {key}"


def _copy(folder: Path) -> Path:
    m = json.loads((FIXTURES / f"{STEM}.json").read_text())
    for name in (f"{STEM}.safetensors", f"{STEM}.json", m["checkpoint"], m["inputs"]):
        shutil.copy(FIXTURES / name, folder / name)
    return folder / f"{STEM}.safetensors"


def test_an_edited_tensor_is_caught(tmp_path):
    path = _copy(tmp_path)
    tensors = load_file(str(path))
    tensors["blocks.0.mlp.fc1.out"][0, 0] += 1e-6  # one element, far below any parity budget
    save_file(tensors, str(path))
    cases, problems = find_dit_cases([tmp_path])
    assert not cases and len(problems) == 1
    assert "tensors do not match the manifest" in problems[0] and "blocks.0.mlp.fc1.out: sha256" in problems[0]


def test_a_dropped_tensor_and_an_edited_legacy_trace_are_caught(tmp_path):
    path = _copy(tmp_path)
    tensors = load_file(str(path))
    del tensors["blocks.0.mlp.fc1.out"]
    save_file(tensors, str(path))
    assert any("listed in the manifest, not stored" in p for p in verify_trace(load_trace(path)))
    # a manifest without digests (the shared layout) is checked by its float stats
    path = _copy(tmp_path)
    mpath = path.with_suffix(".json")
    m = json.loads(mpath.read_text())
    for info in m["tensors"].values():
        info.pop("sha256", None)
    mpath.write_text(json.dumps(m))
    assert verify_trace(load_trace(path)) == []
    tensors = load_file(str(path))
    tensors["blocks.0.attn.qkv_proj.out"] = tensors["blocks.0.attn.qkv_proj.out"] * 1.001
    save_file(tensors, str(path))
    bad = verify_trace(load_trace(path))
    assert bad and bad[0].startswith("blocks.0.attn.qkv_proj.out:"), bad


def test_every_default_root_trace_is_verified():
    """The gate's discovery verifies every trace it pairs: no problem on the committed fixtures."""
    for find in (find_dit_cases, find_vae_cases, find_generate_cases):
        _, problems = find([FIXTURES])
        assert not problems, problems
    assert tensor_sha256(load_file(str(FIXTURES / f"{STEM}.safetensors"))["condition_proj.out"]) == \
        load_trace(FIXTURES / f"{STEM}.safetensors").manifest["tensors"]["condition_proj.out"]["sha256"]


def test_live_mode_warns_on_other_h3_sources(tmp_path):
    from oracle.comfy_env import H3_SOURCES
    from parity_tests.live import source_drift

    fake = tmp_path / "ComfyUI"
    for rel in (*H3_SOURCES, "comfy/sd.py"):
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text("# not the recorded sources\n")
    line = source_drift([FIXTURES], str(fake))
    assert line is not None and "differ from those" in line and str(fake) in line


@pytest.mark.comfy
def test_live_mode_is_quiet_on_the_recording_sources(comfy_root):
    from parity_tests.live import source_drift

    assert source_drift([FIXTURES], comfy_root) is None
