"""fixtures/gpu/ is what its README says: ComfyUI's H200 recordings of the head_dim-128 `small` preset, whose
checkpoints and inputs the committed commands rebuild byte for byte, each bf16 trace beside its fp32 twin."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from h3direct.config import H3Config

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "fixtures" / "gpu"
MANIFESTS = sorted(GPU.glob("trace_*.json"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("quant, name", [("none", "bf16"), ("nvfp4", "nvfp4")])
def test_small_preset_rebuilds_the_committed_checkpoints(tmp_path, quant, name):
    from h3direct.checkpoint.synthetic import resolve_config, write_dit_checkpoint

    out = tmp_path / f"h3_small_curve_{name}.safetensors"
    write_dit_checkpoint(out, resolve_config("small", None, "curve"), quant, seed=0)
    assert _sha(out) == _sha(GPU / out.name), f"make-checkpoint --preset small no longer gives {out.name}"


def test_build_inputs_gpu_rebuilds_the_committed_inputs(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "fixtures" / "build_inputs.py"), "--gpu", str(tmp_path)], check=True,
                   timeout=120)
    assert _sha(tmp_path / "inputs_gpu_ref2va.safetensors") == _sha(GPU / "inputs_gpu_ref2va.safetensors")
    from h3direct.traces.inputs import load_inputs

    big = load_inputs(tmp_path / "inputs_gpu_ref2va_s4k.safetensors")
    _, _, t, h, w = big.video_latent.shape
    assert t * (h // 2) * (w // 2) >= 3584 and big.task == "ref2va" and big.refs


def test_gpu_traces_were_recorded_by_comfyui_on_a_gpu():
    assert len(MANIFESTS) == 4
    want = H3Config.from_name("small-curve").comfy_dict()
    computes = set()
    for path in MANIFESTS:
        m = json.loads(path.read_text())
        env = m["environment"]
        assert env["device"] == "cuda" and m["device"].startswith("cuda"), path.name
        assert env["gpu_name"] == "NVIDIA H200" and env["gpu_capability"] == "9.0", path.name
        assert m["comfyui_commit"] == "0f1fa67a" and not m["bf16_patched"], path.name
        detected = m["unet_config_detected"]
        assert {k: detected[k] for k in want} == want, f"{path.name}: ComfyUI detected another model"
        assert detected["attention_head_dim"] == 128
        dtype = m["compute_dtype_requested"]
        assert m["inference_dtype"] == {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[dtype], path.name
        assert m["checkpoint_sha256"] == _sha(GPU / m["checkpoint"]), path.name
        computes.add((m["checkpoint"], dtype))
    for ckpt in ("h3_small_curve_bf16.safetensors", "h3_small_curve_nvfp4.safetensors"):
        assert {(ckpt, "bf16"), (ckpt, "fp32")} <= computes, f"{ckpt}: a bf16 trace without its fp32 twin"


def test_record_device_cuda_without_a_gpu_is_one_line_exit_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal is for machines without one")
    root = tmp_path / "comfy_root"
    (root / "comfy" / "ldm" / "minimax").mkdir(parents=True)
    (root / "comfy" / "sd.py").write_text("")
    (root / "comfy" / "ldm" / "minimax" / "model.py").write_text("")
    r = subprocess.run([sys.executable, "-m", "oracle", "record", "--comfy-root", str(root), "--device", "cuda",
                        "--checkpoint", str(GPU / "h3_small_curve_bf16.safetensors"),
                        "--inputs", str(GPU / "inputs_gpu_ref2va.safetensors"), "--out", str(tmp_path / "t.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "cuda" in r.stderr
    assert not (tmp_path / "t.safetensors").exists()


def test_sol_algorithm_is_exact_attention_on_the_short_gpu_fixture():
    """At S = 64 every key block is the query's own (diagonal) block: comfy-kitchen's Sol-Attn algorithm (what the
    gate holds sol_attn's kernel to) is exact attention on the fixture's recorded q/k/v, up to its bf16 inputs."""
    from h3direct.dit.loader import load_dit
    from h3direct.traces.evaluate import conditioning_of
    from h3direct.traces.format import load_trace
    from h3direct.traces.inputs import load_inputs
    from h3direct.traces.kernels import exact_attention, sol_algorithm
    from h3direct.traces.replay import available_sites

    trace = load_trace(GPU / "trace_gpu_small_bf16_ref2va_bf16.safetensors")
    inputs = load_inputs(GPU / "inputs_gpu_ref2va.safetensors")
    model = load_dit(GPU / "h3_small_curve_bf16.safetensors", compute_dtype="bf16")
    sites = [s for s in available_sites(model, trace, conditioning_of(inputs), inputs["text_states"])
             if s.operands is not None and s.name.startswith("blocks.")]
    assert {s.name for s in sites} == {"blocks.0.attn.out_proj.in", "blocks.1.attn.out_proj.in"}
    for s in sites:
        q, k, v, prefix = s.operands()
        assert q.shape[2] == 64
        ref, exact = sol_algorithm(q, k, v, prefix)[0], exact_attention(q, k, v)[0]
        assert float((ref - exact).norm() / exact.norm()) <= 4e-3, s.name
