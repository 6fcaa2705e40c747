"""h3direct.traces.format reads every shared oracle file and round-trips its own format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from h3direct.errors import H3Error
from h3direct.traces.format import TRACE_FORMAT, load_trace, load_vae_inputs, save_trace
from h3direct.traces.inputs import load_inputs
from parity_tests.discovery import SHARED_ORACLE as SHARED

TRACES = sorted(SHARED.glob("trace_*.safetensors")) if SHARED.is_dir() else []
INPUTS = sorted(SHARED.glob("inputs_*.safetensors")) if SHARED.is_dir() else []


@pytest.mark.shared
@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_shared_trace_loads_with_aliases(path: Path) -> None:
    trace = load_trace(path)
    raw = json.loads(path.with_suffix(".json").read_text())
    assert trace.version == 0
    # every manifest entry and every alias is readable, with the manifest's shape
    for name, info in raw["tensors"].items():
        assert list(trace.get(name).shape) == info["shape"], name
    for alias, target in raw.get("aliases", {}).items():
        assert alias not in trace.stored
        assert torch.equal(trace.get(alias), trace.get(target))
    names = trace.names_in_order()
    assert sorted(names) == sorted(set(raw["tensors"]) | set(raw.get("aliases", {})))
    # stored tensors keep the manifest's execution order
    stored_order = [n for n in names if n in raw["tensors"]]
    assert stored_order == list(raw["tensors"])
    with pytest.raises(H3Error, match="no tensor named"):
        trace.get("blocks.99.nothing")


@pytest.mark.shared
def test_shared_trace_stats_match_manifest() -> None:
    # independent check of tensor contents: the manifest's absmax/mean were written by the recorder
    trace = load_trace(SHARED / "trace_bf16_t2va_fp32.safetensors")
    for name, info in trace.manifest["tensors"].items():
        t = trace.get(name).double()
        assert abs(float(t.abs().max()) - info["absmax"]) <= 1e-5 * max(1.0, info["absmax"]), name
        assert abs(float(t.mean()) - info["mean"]) <= 1e-5 * max(1.0, info["std"]), name


@pytest.mark.shared
@pytest.mark.parametrize("path", INPUTS, ids=[p.stem for p in INPUTS])
def test_shared_inputs_load(path: Path) -> None:
    inp = load_inputs(path)
    with safe_open(str(path), "pt") as f:
        desc = json.loads(f.metadata()["h3_inputs"])
    assert inp.task == desc["task"] and inp.variant == desc["variant"]
    assert inp.sigma == pytest.approx(0.8) and inp.sampler_seed == 0
    assert inp.text_states.shape[1] == inp.token_tags.shape[0]
    assert len(inp.refs) == len(desc.get("refs", [])) and len(inp.keyframes) == len(desc.get("keyframes", []))
    for raw, ref in zip(desc.get("refs", []), inp.refs, strict=True):
        assert ref["kind"] == raw["kind"]
        for key in ("latent", "audio_latent"):
            if key in raw:
                assert torch.equal(ref[key], inp.tensors[raw[key]])
    for raw, kf in zip(desc.get("keyframes", []), inp.keyframes, strict=True):
        assert kf["resolved_frame_index"] == raw["resolved_frame_index"]
        assert torch.equal(kf["latent"], inp.tensors[raw["latent"]])
    if "denoise_mask" in desc:
        assert set(inp.denoise_mask) == {"video", "audio"}
        assert inp.denoise_mask["video"].shape[2:] == inp.video_latent.shape[2:]
    else:
        assert inp.denoise_mask is None


@pytest.mark.shared
def test_vae_inputs_load() -> None:
    cases = load_vae_inputs(SHARED / "vae_inputs_public.safetensors")
    assert set(cases) == {"video_decode", "audio_decode", "video_encode", "audio_encode"}
    assert tuple(cases["video_decode"]["two_chunks"]["latent"].shape) == (1, 24, 12, 3, 2)


def test_save_trace_round_trip_dedupes(tmp_path: Path) -> None:
    a = torch.randn(3, 4, dtype=torch.bfloat16)
    b = torch.randn(5)
    tensors = {
        "x.out": a,
        "y.in.0": a.clone(),
        "z.out": b,
        "pos": torch.arange(6, dtype=torch.float64) / 3,
        "idx": torch.arange(4),
        "w.out": a.float(),
    }  # same values as `a` but produced as float32: not an alias
    out = save_trace(tmp_path / "t.safetensors", tensors, {"task": "t2va"})
    trace = load_trace(out)
    assert trace.version == 1 and trace.manifest["trace_format"] == TRACE_FORMAT
    assert trace.aliases == {"y.in.0": "x.out"}
    assert trace.names_in_order() == list(tensors)
    assert trace.get("x.out").dtype == torch.float32 and torch.equal(trace.get("x.out"), a.float())
    assert trace.produced_dtype("y.in.0") == "bfloat16" and trace.produced_dtype("w.out") == "float32"
    assert trace.get("pos").dtype == torch.float64 and trace.get("idx").dtype == torch.int64
    assert trace.manifest["tensors"]["z.out"]["absmax"] == pytest.approx(float(b.abs().max()))


def test_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(H3Error, match="not found"):
        load_trace(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 16)
    with pytest.raises(H3Error, match="cannot read"):
        load_trace(bad)
    from safetensors.torch import save_file

    save_file({"video_noise": torch.zeros(1)}, str(tmp_path / "i.safetensors"))
    with pytest.raises(H3Error, match="h3_inputs"):
        load_inputs(tmp_path / "i.safetensors")


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_fixture_traces_are_full_detail_version_1() -> None:
    """The committed golden traces are ours (h3-trace/1) and replayable layer by layer (full detail)."""
    dit = [p for p in sorted(FIXTURES.glob("trace_*.json")) if "unet_config_detected" in p.read_text()]
    assert dit, "no DiT fixture traces"
    for p in dit:
        t = load_trace(p.with_suffix(".safetensors"))
        assert t.version == 1 and t.manifest.get("trace_detail", "full") == "full", p.name
        last = int(t.manifest["unet_config_detected"]["num_layers"]) - 1
        assert f"blocks.{last}.in.0" in t, f"{p.name}: block inputs missing (teacher forcing needs them)"
