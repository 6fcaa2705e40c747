"""DiT unit tests: ground truth from ComfyUI's recorded facts (positions, layout, key tables) and from
independent math, never from h3direct's own outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from h3direct.app.cli import main as cli
from h3direct.checkpoint.keys import dit_keys
from h3direct.config import PRESETS, H3Config
from h3direct.dit.attention import attention, available_backends, check_backend
from h3direct.dit.blocks import MLP
from h3direct.dit.loader import build_model, load_state_dict
from h3direct.dit.rope import rms_norm_rope
from h3direct.dit.sequence import build_layout
from h3direct.errors import BackendUnavailable, CheckpointError
from h3direct.traces.inputs import load_inputs
from h3direct.traces.pairing import pair_inputs
from parity_tests.discovery import FIXTURES, SHARED_ORACLE

INPUT_FILES = sorted(SHARED_ORACLE.glob("inputs_*.safetensors")) + sorted(FIXTURES.glob("inputs_*.safetensors"))


def _recorded_positions(path: str) -> torch.Tensor | None:
    """ComfyUI's float64 positions for an inputs file: in the file (../shared/oracle), else in the fixture DiT trace
    ComfyUI recorded from it (manifest `inputs`; `layout.position_ids` is stored float64)."""
    inp = load_inputs(path)
    if "layout_position_ids_f64" in inp.tensors:
        return inp["layout_position_ids_f64"]
    from h3direct.traces.format import load_trace

    for m in sorted(Path(path).parent.glob("trace_*.json")):
        man = json.loads(m.read_text())
        if man.get("inputs") == Path(path).name and "unet_config_detected" in man:
            return load_trace(m.with_suffix(".safetensors")).get("layout.position_ids")
    return None


POSITIONED = [pytest.param(p, id=p.stem, marks=[pytest.mark.shared] if p.parent == SHARED_ORACLE else [])
              for p in INPUT_FILES if _recorded_positions(p) is not None]


@pytest.mark.parametrize("path", POSITIONED)
def test_layout_positions_bitwise_equal_comfyui(path):
    """ComfyUI's float64 packed rope positions (recorded for every inputs file) are reproduced to the bit."""
    inp = load_inputs(path)
    v, a = inp["video_latent"], inp["audio_latent"]
    layout = build_layout(inp["text_states"].shape[1], v.shape[2], v.shape[3] + v.shape[3] % 2,
                          v.shape[4] + v.shape[4] % 2, a.shape[-1], keyframes=inp.keyframes, refs=inp.refs)
    ref = _recorded_positions(path)
    assert ref.dtype == torch.float64 and layout.position_ids.dtype == torch.float64
    assert torch.equal(layout.position_ids, ref)


# ComfyUI's recorded segments: the shared traces with references and their audio (ref2va_av) and with keyframes
# (fl2va), and the committed fixture DiT traces (a reference image, a denoise mask)
SEGMENT_TRACES = [pytest.param(SHARED_ORACLE / f"{n}.json", id=n, marks=pytest.mark.shared)
                  for n in ("trace_curve_bf16_ref2va_av_fp32", "trace_curve_bf16_fl2va_fp32")]
SEGMENT_TRACES += [pytest.param(m, id=m.stem) for m in sorted(FIXTURES.glob("trace_fx_*_fp32.json"))]


@pytest.mark.parametrize("manifest", SEGMENT_TRACES)
def test_layout_segments_match_comfyui_manifest(manifest):
    man = json.loads(manifest.read_text())
    path, problem = pair_inputs(manifest.parent, man, manifest.with_suffix(".safetensors"),
                                manifest.parent / Path(man["checkpoint"]).name)
    assert problem is None, problem
    inp = load_inputs(path)
    v, a = inp["video_latent"], inp["audio_latent"]
    layout = build_layout(inp["text_states"].shape[1], *v.shape[2:], a.shape[-1], keyframes=inp.keyframes,
                          refs=inp.refs)
    assert layout.manifest() == man["layout"]["segments"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_model_keys_equal_the_checkpoint_layout_table(preset, quant):
    """Module paths are checkpoint keys: the model's state dict has exactly the table's keys and shapes."""
    config = PRESETS[preset]
    table = dit_keys(config, quant)
    formats = {k[: -len(".comfy_quant")]: "nvfp4" for k in table if k.endswith(".comfy_quant")}
    model = build_model(config, formats)
    sd = model.state_dict()
    assert set(sd) == set(table)
    for k, spec in table.items():
        if not k.endswith(".comfy_quant"):
            assert tuple(sd[k].shape) == spec.shape, k


def _tiny_sd():
    from h3direct.checkpoint.synthetic import iter_dit_tensors

    return dict(iter_dit_tensors(PRESETS["tiny"], "none", seed=0))


def test_strict_loader_rejects_missing_unexpected_and_misshapen_keys():
    sd = _tiny_sd()
    load_state_dict(dict(sd))  # the intact file loads
    broken = dict(sd)
    broken.pop("blocks.1.mlp.fc2.weight")
    with pytest.raises(CheckpointError, match="missing key.*blocks.1.mlp.fc2.weight"):
        load_state_dict(broken)
    extra = dict(sd, **{"blocks.0.attn.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected key.*blocks.0.attn.extra.weight"):
        load_state_dict(extra)
    bad = dict(sd)
    bad["blocks.0.norm1.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"blocks.0.norm1.weight has shape \[7\]"):
        load_state_dict(bad)


def test_dtype_policy_follows_comfyui():
    sd = _tiny_sd()
    m32 = load_state_dict(dict(sd), compute_dtype=torch.float32)
    assert {p.dtype for p in m32.parameters()} == {torch.float32}
    m16 = load_state_dict(dict(sd), compute_dtype=torch.bfloat16)
    assert m16.video_patch_proj.weight.dtype == torch.float32  # fp32 island
    assert m16.time_embedder.proj_in.weight.dtype == torch.float32
    assert m16.final_layer.video_out.weight.dtype == torch.float32
    assert m16.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert m16.rope.inv_freq.dtype == torch.float32


def test_mlp_chunks_bitwise_equal_in_fp32():
    torch.manual_seed(0)
    mlp = MLP(64, 96)
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(1000, 64)
    ref = mlp(x)
    for n in (2, 3, 5, 7, 16, 1000):
        assert torch.equal(mlp(x, chunks=n), ref), n


def test_rms_norm_rope_matches_independent_formula():
    torch.manual_seed(1)
    s, h, d, r = 5, 2, 16, 6  # rotate 2r = 12 of 16 dims
    x = torch.randn(1, s, h, d, dtype=torch.float64)
    w = torch.rand(d, dtype=torch.float64) + 0.5
    ang = torch.randn(s, r, dtype=torch.float64)
    table = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, s, 1, r, 2, 2)
    got = rms_norm_rope(x, w, table, 1e-6)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    x1, x2 = n[..., :r], n[..., r:2 * r]
    c, sn = ang.cos()[None, :, None], ang.sin()[None, :, None]
    want = torch.cat([x1 * c - x2 * sn, x1 * sn + x2 * c, n[..., 2 * r:]], -1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_sdpa_matches_softmax_formula():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 3, 9, 8, dtype=torch.float64) for _ in range(3))
    want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    got = attention(q, k, v, "sdpa")
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(1, 9, 24))


def test_unknown_and_unavailable_backends_are_clear_errors():
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'nope'.*available here: .*sdpa"):
        check_backend("nope")
    assert "sdpa" in available_backends()
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="cudnn_sdpa.*CUDA"):
            check_backend("cudnn_sdpa", torch.empty(0))


def test_trace_cli_bad_inputs_are_one_line_exit_2(tmp_path, capsys):
    ck = tmp_path / "trunc.safetensors"
    ck.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    inp = tmp_path / "none.safetensors"
    for argv in (["trace", "--checkpoint", str(ck), "--inputs", str(inp), "--out", str(tmp_path / "t.safetensors")],
                 ["trace", "--checkpoint", str(ck), "--inputs", str(inp), "--attention", "nope",
                  "--out", str(tmp_path / "t.safetensors")]):
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("h3direct trace: error:"), err


def test_config_rejects_rope_wider_than_a_head():
    with pytest.raises(Exception, match="rope rotates"):
        H3Config(attention_head_dim=64, rope_inv_freq_len=16)


def test_swiglu_order_gate_then_up():
    """fc1 rows are [gate | up] (ComfyUI's chunk order): check against the formula with explicit halves."""
    torch.manual_seed(3)
    mlp = MLP(8, 4)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(3, 8)
    h = x @ mlp.fc1.weight.T
    want = (F.silu(h[:, :4]) * h[:, 4:]) @ mlp.fc2.weight.T
    torch.testing.assert_close(mlp(x), want)


def test_odd_condition_latent_is_a_one_line_error():
    """ComfyUI pads only the target latent; an odd keyframe/ref latent cannot be patchified (ComfyUI crashes)."""
    from h3direct.dit.model import Conditioning
    from h3direct.errors import H3Error

    model = load_state_dict(_tiny_sd())
    video, audio = torch.zeros(1, 24, 2, 4, 6), torch.zeros(1, 32, 2, 4)
    cond = Conditioning(keyframes=[{"resolved_frame_index": 0, "latent": torch.zeros(1, 24, 1, 5, 7)}])
    with pytest.raises(H3Error, match=r"keyframe 0 latent is 5x7"):
        model.layout_for(4, video, audio, cond)


def test_hidden_sized_text_states_are_cast_to_the_compute_dtype():
    """ComfyUI casts the text states to the inference dtype before the (skipped) refiner."""
    model = load_state_dict(_tiny_sd(), compute_dtype=torch.bfloat16)
    states = torch.randn(1, 3, model.config.hidden_size)
    assert model.preprocess_text(states).dtype == torch.bfloat16
