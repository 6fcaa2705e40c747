"""The config derived from a checkpoint's shapes (`h3direct.config.shape_fields` / `H3Config.from_shapes`, which the
loader and `h3direct inspect` use) against two independent answers, on every committed DiT checkpoint:

- a second derivation written here from ComfyUI's detection rules (`comfy/model_detection.py`, MiniMax H3 branch:
  gate keys, blocks counted from 0 until the first missing index, one shape dimension per field);
- ComfyUI's own `unet_config_detected`, recorded in the manifests of the traces made with that checkpoint.

Checkpoints: fixtures/*.safetensors, fixtures/gpu/*.safetensors and, when present, ../shared/oracle/*.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3direct.app.cli import main
from h3direct.checkpoint.safetensors_header import read_header
from h3direct.config import H3Config, shape_fields
from h3direct.errors import ConfigError
from parity_tests.discovery import FIXTURES, SHARED_ORACLE

FOLDERS = [FIXTURES, FIXTURES / "gpu", SHARED_ORACLE]
# keys of ComfyUI's unet_config_detected that are not derived from tensor shapes
NOT_FROM_SHAPES = {"image_model", "dtype"}


def _dit_checkpoints() -> list[Path]:
    found = []
    for folder in FOLDERS:
        for p in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            if "video_patch_proj.weight" in read_header(p).tensors:
                found.append(p)
    return found


CHECKPOINTS = _dit_checkpoints()
# the ones in ../shared/oracle are `shared` tests (deselected without it)
CASES = [pytest.param(p, id=f"{p.parent.name}/{p.stem}", marks=[pytest.mark.shared] if p.parent == SHARED_ORACLE else [])
         for p in CHECKPOINTS]


def comfy_rules(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """ComfyUI's H3 detection restated: which tensor dimension gives which field, fields in its order."""
    def blocks(prefix: str) -> int:
        n = 0
        while any(k.startswith(f"{prefix}{n}.") for k in shapes):
            n += 1
        return n

    head_dim = shapes["blocks.0.attn.q_norm.weight"][0]
    out = {"num_layers": blocks("blocks."), "token_refiner_num_layers": blocks("token_refiner.blocks."),
           "hidden_size": shapes["video_patch_proj.weight"][0],
           "latents_dim": shapes["final_layer.video_out.weight"][0] // (1 * 2 * 2),
           "audio_latents_dim": shapes["final_layer.audio_out.weight"][0], "attention_head_dim": head_dim,
           "num_attention_heads": shapes["blocks.0.attn.qkv_proj.weight"][0] // 3 // head_dim,
           "ffn_hidden_size": shapes["blocks.0.mlp.fc1.weight"][0] // 2,
           "text_dim": shapes["condition_proj.weight"][1]}
    if "adaln_t_table" in shapes:
        grid, width = shapes["adaln_t_table"]
        out |= {"adaln_curve_grid": grid, "time_embed_dim": width}
    else:
        hidden, t_in = shapes["time_embedder.proj_in.weight"]
        out |= {"timestep_input_dim": t_in, "time_embed_hidden_size": hidden,
                "time_embed_dim": shapes["time_embedder.proj_out.weight"][0]}
    out["rope_inv_freq_len"] = shapes["rope.inv_freq"][0]
    return out


def recorded_detections(ckpt: Path) -> list[dict]:
    """ComfyUI's unet_config_detected from every trace manifest next to `ckpt` that names it."""
    found = []
    for m in sorted(ckpt.parent.glob("trace_*.json")):
        manifest = json.loads(m.read_text())
        if manifest.get("checkpoint") == ckpt.name and "unet_config_detected" in manifest:
            found.append({k: v for k, v in manifest["unet_config_detected"].items() if k not in NOT_FROM_SHAPES})
    return found


def test_committed_checkpoints_are_found():
    names = {p.name for p in CHECKPOINTS}
    assert {"h3_fx_bf16.safetensors", "h3_fx_curve_nvfp4.safetensors", "h3_small_curve_nvfp4.safetensors"} <= names


@pytest.mark.parametrize("ckpt", CASES)
def test_derived_config_equals_comfy_detection(ckpt, tmp_path, capsys):
    shapes = read_header(ckpt).shapes()
    ours = H3Config.from_shapes(shapes).comfy_dict()
    want = comfy_rules(shapes)
    assert ours == want and list(ours) == list(want)  # the same fields, in ComfyUI's order
    assert shape_fields(shapes) == want
    recorded = recorded_detections(ckpt)
    assert recorded, f"no trace manifest records {ckpt.name}"
    for detected in recorded:
        assert detected == want
    assert main(["inspect", str(ckpt), "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == want and report["anomalies"] == []


def test_block_count_stops_at_the_first_gap():
    """Where a derivation could go wrong quietly: blocks 0 and 2 present, 1 absent. ComfyUI counts one block; so must
    both derivations (a count of distinct indices would say two)."""
    shapes = read_header(FIXTURES / "h3_fx_bf16.safetensors").shapes()
    gap = {(k.replace("blocks.1.", "blocks.2.", 1) if k.startswith("blocks.1.") else k): v for k, v in shapes.items()}
    assert comfy_rules(shapes)["num_layers"] == 2
    assert comfy_rules(gap)["num_layers"] == 1 and shape_fields(gap) == comfy_rules(gap)
    with pytest.raises(ConfigError, match="missing rope.inv_freq"):
        shape_fields({k: v for k, v in shapes.items() if k != "rope.inv_freq"})
