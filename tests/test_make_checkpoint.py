"""Synthetic checkpoints: layout table vs the shared checkpoint_info*.json, the shared files themselves (marker
`shared`), determinism, NVFP4 companions, the streaming writer, the CLI, and (marker `comfy`) loading in ComfyUI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from h3direct.app.cli import main as cli_main
from h3direct.checkpoint.keys import dit_keys, nvfp4_layer_names
from h3direct.checkpoint.quant import NVFP4_MARKER
from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, unswizzle_block_scales
from h3direct.checkpoint.synthetic import dit_plan, write_dit_checkpoint, write_state_dict
from h3direct.config import H3Config
from parity_tests.discovery import SHARED_ORACLE

try:
    import comfy_goldens as goldens
except ImportError:  # rootdir-relative import
    from tests import comfy_goldens as goldens

# where each shared file comes from: (info json, preset, quant, key list in the json)
SHARED = {
    "h3_tiny_bf16": ("checkpoint_info.json", "tiny", "none", "bf16_keys"),
    "h3_tiny_nvfp4": ("checkpoint_info.json", "tiny", "nvfp4", "nvfp4_keys"),
    "h3_tiny_curve_bf16": ("checkpoint_info_curve.json", "tiny-curve", "none", "bf16_keys"),
    "h3_tiny_curve_nvfp4": ("checkpoint_info_curve.json", "tiny-curve", "nvfp4", "nvfp4_keys"),
}
# Tolerances: the oracle's adaln_t_table cosine was evaluated with a different op order than ours (same draws);
# measured max |diff| 1.77e-6 on values of magnitude <= ~3 (a few fp32 ulps).
TOLERANCES = {("adaln_t_table", "fp32"): {"atol": 4e-6, "rtol": 0.0}}


def header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), "pt") as f:
        out = {}
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = (str(sl.get_dtype()), tuple(sl.get_shape()))
    return out


ST_TO_TORCH = {"F32": "float32", "BF16": "bfloat16", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}


# ---------------------------------------------------------------- layout table

@pytest.mark.shared
@pytest.mark.parametrize("name", sorted(SHARED))
def test_layout_matches_checkpoint_info(name):
    info_file, preset, quant, key_list = SHARED[name]
    info = json.loads((SHARED_ORACLE / info_file).read_text())
    config = H3Config.from_dict(info["config"])
    assert config == H3Config.from_name(preset)
    layout = dit_keys(config, quant)
    assert {k: [s.dtype, list(s.shape)] for k, s in layout.items()} == info[key_list]
    if quant == "nvfp4":
        assert nvfp4_layer_names(config) == sorted(info["nvfp4_quantized_layers"])


@pytest.mark.shared
@pytest.mark.parametrize("name", sorted(SHARED))
def test_layout_matches_shared_file_header(name):
    _, preset, quant, _ = SHARED[name]
    got = {k: (ST_TO_TORCH[d], s) for k, (d, s) in header(SHARED_ORACLE / f"{name}.safetensors").items()}
    assert got == {k: (s.dtype, s.shape) for k, s in dit_keys(H3Config.from_name(preset), quant).items()}


def test_full_layout_sizes():
    """The real sizes: 50 blocks x 4 NVFP4 linears without the refiner; every tensor under ~2 GB."""
    full_curve = H3Config.from_name("full-curve")
    assert len(nvfp4_layer_names(full_curve, nvfp4_refiner=False)) == 200
    assert len(nvfp4_layer_names(full_curve)) == 208
    layout = dit_keys(full_curve, "nvfp4", nvfp4_refiner=False)
    inner = 56 * 128  # heads x head_dim = 7168, wider than hidden 5376
    qkv = layout["blocks.49.attn.qkv_proj.weight"]
    assert qkv.shape == (3 * inner, 5376 // 2) and qkv.logical_shape == (3 * inner, 5376)
    assert layout["blocks.0.attn.qkv_proj.weight_scale"].shape == (3 * inner, 336)
    assert layout["blocks.0.attn.out_proj.weight"].logical_shape == (5376, inner)
    assert layout["adaln_t_table"].shape == (1025, 8)
    assert layout["token_refiner.blocks.1.mlp.fc1.weight"].dtype == "bfloat16"
    full = dit_keys(H3Config.from_name("full"), "none")
    assert max(s.logical_shape[0] * (s.logical_shape[1] if len(s.logical_shape) > 1 else 1) * 4
               for s in full.values()) < 2**31  # the largest fp32 master tensor
    assert "time_embedder.proj_in.weight" in full and "adaln_t_table" not in full


# ---------------------------------------------------------------- generated files

@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> path of the tiny checkpoints made with seed 0 (the shared files' seed)."""
    d = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, (_, preset, quant, _) in SHARED.items():
        out[name] = d / f"{name}.safetensors"
        write_dit_checkpoint(out[name], H3Config.from_name(preset), quant, seed=0)
    return out


@pytest.mark.shared
@pytest.mark.parametrize("name", sorted(SHARED))
def test_seed0_reproduces_shared_checkpoint(made, name):
    """The shared tiny files follow the init recipe we implement; ComfyUI's quantizer made the NVFP4 bytes."""
    from safetensors.torch import load_file

    ours, ref = load_file(str(made[name])), load_file(str(SHARED_ORACLE / f"{name}.safetensors"))
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        if k == "adaln_t_table":
            torch.testing.assert_close(ours[k], ref[k], **TOLERANCES[("adaln_t_table", "fp32")])
        else:
            assert torch.equal(ours[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)), k


def test_same_seed_same_bytes_other_seed_differs(tmp_path, made):
    cfg = H3Config.from_name("tiny")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_dit_checkpoint(a, cfg, "nvfp4", seed=0)
    write_dit_checkpoint(b, cfg, "nvfp4", seed=1)
    assert a.read_bytes() == made["h3_tiny_nvfp4"].read_bytes()
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        for k in fa.keys():
            ta, tb = fa.get_tensor(k), fb.get_tensor(k)
            if k.endswith(("comfy_quant", "rope.inv_freq")):
                assert torch.equal(ta, tb), k
            else:
                assert not torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)), k


def test_nvfp4_companions_well_formed_and_decodable(made):
    cfg = H3Config.from_name("tiny")
    layout = dit_keys(cfg, "nvfp4")
    bf16_path, q_path = made["h3_tiny_bf16"], made["h3_tiny_nvfp4"]
    with safe_open(str(q_path), "pt") as fq, safe_open(str(bf16_path), "pt") as fb:
        for layer in nvfp4_layer_names(cfg):
            marker = fq.get_tensor(f"{layer}.comfy_quant")
            assert bytes(marker.tolist()) == NVFP4_MARKER == b'{"format": "nvfp4"}'
            packed, bs, gs = (fq.get_tensor(f"{layer}.{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
            assert (packed.dtype, bs.dtype, gs.dtype, gs.shape) == (torch.uint8, torch.float8_e4m3fn, torch.float32,
                                                                    torch.Size([]))
            assert not bs.float().isnan().any() and gs > 0
            spec = layout[f"{layer}.weight"]
            w = dequantize_nvfp4(packed, bs, gs, torch.float32, shape=spec.logical_shape)
            master = fb.get_tensor(f"{layer}.weight").float()
            # round to nearest: |err| <= half the widest E2M1 gap (1.0, between 4 and 6) x the block's decode
            # scale s, or, where the E4M3 scale rounded down, the clamp at 6s: amax - 6s
            s = gs * unswizzle_block_scales(bs, *w.shape[:1], w.shape[1] // 16).float()[..., None]
            amax = master.abs().reshape(master.shape[0], -1, 16).amax(-1, keepdim=True)
            err = (w - master).reshape(master.shape[0], -1, 16).abs()
            assert (err <= torch.maximum(s, amax - 6 * s) * (1 + 1e-5) + 1e-9).all(), layer
            # qkv rows are contiguous q | k | v thirds of the master weight
            if layer.endswith("qkv_proj"):
                h = cfg.hidden_size
                for i in range(3):
                    third = dequantize_nvfp4(packed, bs, gs, torch.float32)[i * h:(i + 1) * h]
                    torch.testing.assert_close(third, w[i * h:(i + 1) * h], rtol=0, atol=0)


def test_master_values_follow_recipe(made):
    """Independent look at the statistics the recipe promises (not a copy of our own output)."""
    with safe_open(str(made["h3_tiny_bf16"]), "pt") as f:
        norm = f.get_tensor("blocks.0.norm1.weight").float()
        assert abs(norm.mean().item() - 1) < 0.02 and 0.03 < norm.std().item() < 0.07
        w = f.get_tensor("blocks.0.mlp.fc1.weight").float()
        assert abs(w.std().item() * 128**0.5 - 1) < 0.05
        ada = f.get_tensor("blocks.0.adaln_proj.linear.weight").float()
        assert abs(ada.std().item() * 64**0.5 - 1.5) < 0.05
        inv = f.get_tensor("rope.inv_freq")
        assert torch.equal(inv, torch.tensor([1.0, 0.1, 0.01, 0.001]).float()) or torch.allclose(
            inv, torch.tensor([10000 ** (-i / 4) for i in range(4)]), rtol=1e-6)


# ---------------------------------------------------------------- streaming writer

def test_streaming_writer_is_read_by_safetensors(tmp_path):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    sd = {
        "a.odd": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.scalar": torch.tensor(0.25),
        "c.fp8": torch.randn(7, 4, generator=g).to(torch.float8_e4m3fn),
        "d.bytes": torch.arange(19, dtype=torch.uint8),
        "e.int8": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=g),
        "f.empty": torch.zeros(0, 3),
    }
    path = tmp_path / "w.safetensors"
    size = write_state_dict(path, sd, {"h3direct": "{}"})
    assert size == path.stat().st_size
    back = load_file(str(path))
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and back[k].shape == sd[k].shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8)), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"h3direct": "{}"}
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + n) % 8 == 0  # data section 8-byte aligned


def test_writer_rejects_a_tensor_that_breaks_its_plan(tmp_path):
    from h3direct.checkpoint.synthetic import write_safetensors_stream

    plan = [("x", "float32", (2, 2), 16)]
    with pytest.raises(AssertionError, match="expected x"):
        write_safetensors_stream(tmp_path / "bad.safetensors", plan, [("x", torch.zeros(2, 3))])
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_plan_order_is_the_draw_order_with_companions():
    order = [s.name for s in dit_plan(H3Config.from_name("tiny"), "nvfp4")]
    i = order.index("blocks.0.attn.qkv_proj.weight")
    assert order[i:i + 4] == ["blocks.0.attn.qkv_proj.weight", "blocks.0.attn.qkv_proj.weight_scale",
                              "blocks.0.attn.qkv_proj.weight_scale_2", "blocks.0.attn.qkv_proj.comfy_quant"]
    assert len(order) == len(set(order)) == len(dit_keys(H3Config.from_name("tiny"), "nvfp4"))


# ---------------------------------------------------------------- CLI

def test_cli_make_checkpoint_config_json_curve(tmp_path, capsys):
    cfg = {"hidden_size": 64, "num_layers": 3, "token_refiner_num_layers": 1, "num_attention_heads": 2,
           "attention_head_dim": 32, "ffn_hidden_size": 96, "text_dim": 48, "rope_inv_freq_len": 4}
    out = tmp_path / "c.safetensors"
    rc = cli_main(["make-checkpoint", "--config", json.dumps(cfg), "--adaln", "curve", "--quant", "nvfp4",
                   "--seed", "3", "--out", str(out)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["adaln_curve_grid"] == 1025 and report["config"]["num_layers"] == 3
    got = header(out)
    assert got["adaln_t_table"] == ("F32", (1025, 8))
    assert got["blocks.2.mlp.fc2.weight"] == ("U8", (64, 48))
    assert "time_embedder.proj_in.weight" not in got
    with safe_open(str(out), "pt") as f:
        info = json.loads(f.metadata()["h3direct"])
        assert "config" not in f.metadata()  # ComfyUI's detection would read it
    assert info["seed"] == 3 and info["h3_config"]["adaln_curve_grid"] == 1025


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "unknown preset"),
    (["--config", "{\"rope_inv_freq_len\": 40}"], "wider than a head"),
    (["--config", "/nonexistent.json"], "no such file"),
    (["--config", "{\"bogus\": 1}"], "unknown field"),
], ids=["preset", "inconsistent", "missing-file", "unknown-field"])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    rc = cli_main(["make-checkpoint", *argv, "--out", str(tmp_path / "x.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def _cli_audio_vae(tmp_path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = tmp_path / "va.safetensors"
    assert cli_main(["make-checkpoint", "--component", "audio_vae", "--preset", "tiny", "--out", str(out)]) == 0
    return header(out)


def test_cli_vae_component(tmp_path, capsys):
    from h3direct.vae.synthetic import make_state_dict

    want = make_state_dict("audio_vae", "tiny", seed=0)
    assert {k: s for k, (_, s) in _cli_audio_vae(tmp_path).items()} == {k: tuple(t.shape) for k, t in want.items()}


@pytest.mark.shared
def test_cli_vae_component_has_the_shared_tiny_layout(tmp_path, capsys):
    """Same keys and shapes as the tiny audio VAE ComfyUI was traced with."""
    ref = header(SHARED_ORACLE / "vae_audio_tiny.safetensors")
    assert {k: s for k, (_, s) in _cli_audio_vae(tmp_path).items()} == {k: s for k, (_, s) in ref.items()}


# ---------------------------------------------------------------- ComfyUI

def _open_comfy(root: str):
    from h3direct.errors import H3Error
    from oracle.comfy_env import open_comfy

    try:
        return open_comfy(root, device="cpu", compute_dtype="fp32", attention="pytorch")
    except (ImportError, H3Error) as exc:  # a ComfyUI checkout was given: not importing it is a failure
        pytest.fail(f"cannot import ComfyUI from {root} in this process: {exc}")


@pytest.mark.comfy
@pytest.mark.parametrize("quant", ["none", "nvfp4"])
@pytest.mark.parametrize("adaln", ["full", "curve"])
def test_made_checkpoint_loads_and_runs_in_comfyui(tmp_path, quant, adaln, ndarrays_regression, data_regression,
                                                    comfy_root):
    """ComfyUI detects our config, loads every key (none missing / unexpected), and its own forward keeps
    O(1) activations through all blocks (8 layers here)."""
    from safetensors.torch import load_file

    from h3direct.checkpoint.synthetic import resolve_config

    env = _open_comfy(comfy_root)
    cfg = resolve_config("tiny", None, adaln).replace(num_layers=8)
    path = tmp_path / "m.safetensors"
    write_dit_checkpoint(path, cfg, quant, seed=5)
    sd = load_file(str(path))
    patcher = env.sd.load_diffusion_model_state_dict(dict(sd))
    assert patcher is not None, "ComfyUI did not recognise the checkpoint"
    detected = {k: v for k, v in patcher.model.model_config.unet_config.items() if k not in ("image_model", "dtype")}
    assert detected == cfg.comfy_dict()
    dm = patcher.model.diffusion_model
    assert set(dm.state_dict()) == set(sd)
    for k, v in dm.state_dict().items():  # what ComfyUI holds is what we wrote (bf16 upcast exactly to fp32)
        if v.dtype == sd[k].dtype:
            assert torch.equal(v.reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8)), k
        else:
            assert torch.equal(v.float(), sd[k].float()), k
    for layer in nvfp4_layer_names(cfg) if quant == "nvfp4" else []:
        qt = dm.get_submodule(layer).weight  # ComfyUI's QuantizedTensor, decoded by ComfyUI
        ref = qt.dequantize()
        ours = dequantize_nvfp4(sd[f"{layer}.weight"], sd[f"{layer}.weight_scale"], sd[f"{layer}.weight_scale_2"],
                                ref.dtype, shape=tuple(ref.shape))
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), layer

    stds = {}
    for i, block in enumerate(dm.blocks):
        block.register_forward_hook(lambda m, a, o, i=i: stds.__setitem__(i, o.float().std().item()))
    g = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, 24, 3, 6, 8, generator=g), torch.randn(1, 32, 2, 10, generator=g)
    with torch.no_grad():
        ctx = dm.preprocess_text_embeds(torch.randn(1, 12, cfg.text_dim, generator=g))
        out_v, out_a = dm._forward((video, audio), torch.tensor([800.0]), ctx)
    assert sorted(stds) == list(range(cfg.num_layers))
    for value in [ctx.std().item(), *stds.values(), out_v.std().item(), out_a.std().item()]:
        assert 0.3 < value < 5.0, (stds, ctx.std().item(), out_v.std().item(), out_a.std().item())
    # what ComfyUI made of the file, committed for the CI twin below
    import hashlib

    deq = {}
    for layer in nvfp4_layer_names(cfg) if quant == "nvfp4" else []:
        w = dm.get_submodule(layer).weight.dequantize()
        deq[layer] = [str(w.dtype).removeprefix("torch."), list(w.shape),
                      hashlib.sha256(w.float().contiguous().numpy().tobytes()).hexdigest()]
    data_regression.check({"detected_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in detected.items()},
                           "keys": {k: [str(v.dtype).removeprefix("torch."), list(v.shape)]
                                    for k, v in sorted(dm.state_dict().items())},
                           "dequantized_sha256": deq},
                          fullpath=goldens.GOLDENS / f"made_checkpoint_{adaln}_{quant}.yml")
    g = torch.Generator().manual_seed(0)
    text = (torch.randn(1, 24, 3, 6, 8, generator=g), torch.randn(1, 32, 2, 10, generator=g),
            torch.randn(1, 12, cfg.text_dim, generator=g))[2]
    from parity_tests.budgets import load_budgets

    rel = load_budgets().rules["fp32_limit"]  # the fp32 rule: what ComfyUI's fp32 forward is held to
    goldens.record(ndarrays_regression, f"made_checkpoint_{adaln}_{quant}",
                   {"video": video, "audio": audio, "text": text, "context": ctx, "out_video": out_v,
                    "out_audio": out_a}, rounding={"context": rel, "out_video": rel, "out_audio": rel})


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
@pytest.mark.parametrize("adaln", ["full", "curve"])
def test_made_checkpoint_as_comfyui_loads_it_golden(tmp_path, quant, adaln):
    """make-checkpoint's file as ComfyUI loaded it (detected config, every key's dtype / shape, its NVFP4 decode, its
    forward on fixed inputs), against the same file loaded by h3direct."""
    import hashlib

    import yaml

    from h3direct.checkpoint.synthetic import resolve_config
    from h3direct.dit.loader import load_dit
    from h3direct.dit.model import Conditioning
    from h3direct.traces.metrics import rel_l2
    from parity_tests.budgets import load_budgets

    want = yaml.safe_load((goldens.GOLDENS / f"made_checkpoint_{adaln}_{quant}.yml").read_text())
    ref = goldens.load(f"made_checkpoint_{adaln}_{quant}")
    cfg = resolve_config("tiny", None, adaln).replace(num_layers=8)
    path = tmp_path / "m.safetensors"
    write_dit_checkpoint(path, cfg, quant, seed=5)
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.comfy_dict().items()} == \
        want["detected_config"]
    with safe_open(str(path), "pt") as f:
        ours = {k: f.get_slice(k) for k in f.keys()}
        assert set(ours) == set(want["keys"])
        for k, (_comfy_dtype, shape) in want["keys"].items():  # ComfyUI holds bf16 upcast to fp32
            assert list(ours[k].get_shape()) == shape, k
        for layer, (dtype, shape, digest) in want["dequantized_sha256"].items():
            w = dequantize_nvfp4(f.get_tensor(f"{layer}.weight"), f.get_tensor(f"{layer}.weight_scale"),
                                 f.get_tensor(f"{layer}.weight_scale_2"), getattr(torch, dtype), shape=tuple(shape))
            assert hashlib.sha256(w.float().contiguous().numpy().tobytes()).hexdigest() == digest, layer
    model = load_dit(path, compute_dtype="fp32", device="cpu")
    limit = load_budgets().rules["fp32_limit"]  # the fp32 rule
    with torch.no_grad():
        ctx = model.preprocess_text(ref["text"])
        out_v, out_a = model.forward_inner(ref["video"], ref["audio"], torch.tensor([800.0]), ctx, Conditioning())
    for name, got in (("context", ctx), ("out_video", out_v), ("out_audio", out_a)):
        err = rel_l2(got.float(), ref[name].reshape(got.shape).float())
        assert err <= limit, f"{name}: rel-L2 {err:.3e} > {limit:g}"


@pytest.mark.parametrize("preset, adaln, expected", [
    ("tiny", "curve", "tiny-curve"), ("tiny-curve", "full", "tiny"),
    ("full", "curve", "full-curve"), ("full-curve", "full", "full"), ("tiny", None, "tiny"),
    ("small", "curve", "small-curve"), ("small-curve", "full", "small"),
])
def test_adaln_switch_gives_the_matching_preset(preset, adaln, expected):
    from h3direct.checkpoint.synthetic import resolve_config

    got = resolve_config(preset, None, adaln)
    assert got.comfy_dict() == H3Config.from_name(expected).comfy_dict()
