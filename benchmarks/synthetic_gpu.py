"""Full-size synthetic H3 models built directly on the target device (no disk, no full fp32 copy).

DiT (`build_dit`): the checkpoint generator's own recipe (`h3direct.checkpoint.synthetic.iter_dit_tensors`), one
tensor at a time on the device, then `h3direct.dit.loader.load_state_dict` (strict, ComfyUI's dtype policy) —
exactly what loading the same file from disk would give.

`weights="nvfp4"` puts the 4·num_layers DiT block linears (qkv_proj, out_proj, fc1, fc2) in NVFP4; the
token-refiner blocks stay bf16 (the released pruned layout). Memory: bf16 full model ~37.6 GiB, NVFP4 ~11.7 GiB;
the largest temporary is one fp32 master tensor (fc1: 0.6 GB).

VAEs (`build_video_vae`, `build_audio_vae`): `h3direct.vae.synthetic`'s per-key init rules evaluated with a
generator on the device, written in place into a model whose tensors already have the compute dtype.

Text encoder (`build_text_encoder`): the Qwen3-VL-32B encoder (50 layers, hidden 5,120, the vision tower) made one
tensor at a time on the device in the file's layout (`text_encoder_tensors`: ComfyUI's keys, every float tensor
bf16; `weights="nvfp4"` puts the 350 decoder linears in NVFP4 with their scales and `comfy_quant` markers, as a
quantized file holds them), then loaded by the runtime's strict loader (`text_encoder_of`). bf16
~48 GiB, NVFP4 ~15 GiB. Init: linear weights ~ N(0, 1/fan_in), the residual branches' output projections (o_proj,
down_proj; the vision tower's attn.proj, mlp.linear_fc2) scaled by 1/sqrt(2 x depth) so the residual stream stays
O(1) over the layers; biases ~ N(0, 0.02^2); norm weights 1 + N(0, 0.05^2); token embeddings N(0, 1); the vision
position table 0.5 N(0, 1).

CLI (a build check): `python -m benchmarks.synthetic_gpu --preset tiny --device cpu --weights bf16,nvfp4 [--vae]
[--text-encoder]`.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import _common as C
from h3direct.text.load import NVFP4_LINEARS as TEXT_NVFP4_LINEARS


def build_dit(config, weights: str, device, *, compute_dtype=None, nvfp4_mode: str = "w4a16", seed: int = 0,
              fp8_linear: str = "off"):
    """(H3DiT on `device` in eval mode, info dict). compute_dtype default bf16."""
    import torch

    compute_dtype = compute_dtype or torch.bfloat16
    C.sync(device)
    t0 = time.perf_counter()
    model = _build_via_make_checkpoint(config, weights, device, compute_dtype, nvfp4_mode, seed, fp8_linear)
    C.sync(device)
    info = {"weights": weights, "builder": "make_checkpoint", "nvfp4_mode": nvfp4_mode if weights == "nvfp4" else None,
            "compute_dtype": str(compute_dtype).removeprefix("torch."), "fp8_linear": fp8_linear, "build_s": time.perf_counter() - t0,
            "model_gib": C.module_gib(model), "allocated_gib": C.allocated_gib(device)}
    return model, info


def _build_via_make_checkpoint(config, weights, device, compute_dtype, nvfp4_mode, seed, fp8_linear="off"):
    from h3direct.checkpoint.synthetic import iter_dit_tensors
    from h3direct.dit.loader import load_state_dict

    quant = "nvfp4" if weights == "nvfp4" else "none"
    sd = {}
    for key, t in iter_dit_tensors(config, quant, seed, str(device), nvfp4_refiner=False):
        # the loader parses the JSON markers with numpy: keep those 19-byte tensors on the CPU
        sd[key] = t.cpu() if key.endswith(".comfy_quant") else t
    model = load_state_dict(sd, compute_dtype=compute_dtype, nvfp4_mode=nvfp4_mode, device=device,
                            source="synthetic", fp8_linear=fp8_linear)
    del sd
    return model


def _fill_vae(model, component: str, device, seed: int) -> None:
    import torch

    from h3direct.vae import synthetic
    from h3direct.vae.config import VIDEO_LATENTS_MEAN, VIDEO_LATENTS_STD

    init = synthetic._init  # the per-key rule table of the synthetic checkpoints
    g = torch.Generator(device=device).manual_seed(seed + (100 if component == "video_vae" else 200))
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad(), torch.device(device):
        for key in sorted(tensors):
            dst = tensors[key]
            if key == "latents_mean":
                known = component == "video_vae" and dst.shape[0] == len(VIDEO_LATENTS_MEAN)
                val = torch.tensor(VIDEO_LATENTS_MEAN) if known else torch.randn(dst.shape, generator=g) * 0.1
            elif key == "latents_std":
                known = component == "video_vae" and dst.shape[0] == len(VIDEO_LATENTS_STD)
                val = torch.tensor(VIDEO_LATENTS_STD) if known else torch.rand(dst.shape, generator=g) * 0.4 + 0.8
            else:
                owner = model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
                val = init(key, owner, dst, g)
                if not key.endswith(".filter"):
                    val = val.to(torch.float16)  # the synthetic checkpoints are stored in fp16
            dst.copy_(val.reshape(dst.shape))


def build_video_vae(preset: str, device, dtype=None, seed: int = 0):
    """(VideoVAE in `dtype` (default fp16) on `device`, info)."""
    import torch

    from h3direct.vae import VIDEO_PRESETS, VideoVAE

    dtype = dtype or torch.float16
    C.sync(device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = VideoVAE(VIDEO_PRESETS[preset])
    model.set_compute_dtype(dtype)
    model.to_empty(device=device)
    _fill_vae(model, "video_vae", device, seed)
    model.eval()
    C.sync(device)
    return model, {"build_s": time.perf_counter() - t0, "model_gib": C.module_gib(model),
                   "dtype": str(dtype).removeprefix("torch.")}


def build_audio_vae(preset: str, device, seed: int = 0):
    """(AudioVAE in fp32 on `device`, info)."""
    import torch

    from h3direct.vae import AUDIO_PRESETS, AudioVAE

    C.sync(device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AudioVAE(AUDIO_PRESETS[preset])
    model.to_empty(device=device)
    _fill_vae(model, "audio_vae", device, seed)
    model.eval()
    C.sync(device)
    return model, {"build_s": time.perf_counter() - t0, "model_gib": C.module_gib(model), "dtype": "float32"}


# ---------------------------------------------------------------- text encoder

TEXT_RESIDUAL_OUT = {"model": ("self_attn.o_proj", "mlp.down_proj"), "visual": ("attn.proj", "mlp.linear_fc2")}
TEXT_SEED_OFFSET = 300  # the text encoder's generator: seed + this (the DiT and VAEs draw from their own)


def text_encoder_config(name: str):
    """The encoder of a benchmark preset (`Preset.text_encoder`): qwen3vl_32b as H3 ships it; tiny = hidden 96 (the
    tiny DiT's text_dim), 2 layers, head_dim 128 (the MRoPE sections of the full model, which ComfyUI's Qwen3-VL
    fixes), the tiny vision tower."""
    from h3direct.text.qwen import PRESETS, TextEncoderConfig
    from h3direct.text.vision import VISION_PRESETS

    if name == "tiny":
        return TextEncoderConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=128, vision=VISION_PRESETS["tiny"])
    return PRESETS[name]


def _text_master(name: str, shape, config, g, device):
    """fp32 value of one text-encoder tensor (the module docstring's init rules)."""
    import math

    import torch

    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=g, device=device)
    if name.endswith("pos_embed.weight"):
        return 0.5 * torch.randn(shape, generator=g, device=device)
    if "norm" in module and name.endswith(".weight"):
        return 1.0 + 0.05 * torch.randn(shape, generator=g, device=device)
    if name.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=g, device=device)
    tower = name.split(".", 1)[0]
    depth = config.num_hidden_layers if tower == "model" else config.vision.depth
    gain = 1 / math.sqrt(2 * depth) if name.removesuffix(".weight").endswith(TEXT_RESIDUAL_OUT[tower]) else 1.0
    fan_in = math.prod(shape[1:])
    return (gain / math.sqrt(fan_in)) * torch.randn(shape, generator=g, device=device)


def text_encoder_tensors(config, weights: str, device, seed: int = 0):
    """(key, tensor) of the synthetic text encoder in the file's layout, one master tensor at a time in sorted key
    order: bf16, or (`weights="nvfp4"`) each decoder linear as packed weight, block scale, global scale and its
    `comfy_quant` marker (on the CPU: the loaders parse it on the host)."""
    import torch

    from h3direct.checkpoint.quant import NVFP4_MARKER
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4
    from h3direct.text.qwen import QwenVL

    if weights not in ("bf16", "nvfp4"):
        raise ValueError(f"text encoder weights must be bf16 or nvfp4, got {weights!r}")
    with torch.device("meta"):
        layout = QwenVL(config).state_dict()
    g = torch.Generator(device=device).manual_seed(seed + TEXT_SEED_OFFSET)
    for name in sorted(layout):
        value = _text_master(name, layout[name].shape, config, g, device).to(torch.bfloat16)
        layer = name.removesuffix(".weight")
        if weights == "nvfp4" and layer.startswith("model.layers.") and layer.endswith(TEXT_NVFP4_LINEARS):
            q = quantize_nvfp4(value)  # from the bf16-rounded weight, as a quantized file is made
            del value
            yield name, q.packed
            yield f"{layer}.weight_scale", q.block_scale
            yield f"{layer}.weight_scale_2", q.global_scale
            yield f"{layer}.comfy_quant", torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8)
        else:
            yield name, value


def build_text_encoder(name: str, weights: str, device, seed: int = 0):
    """(h3direct QwenTextEncoder `name` (`text_encoder_config`) on `device`, fp32 compute as ComfyUI runs it, info)."""
    from h3direct.text.load import text_encoder_of

    config = text_encoder_config(name)
    C.sync(device)
    t0 = time.perf_counter()
    sd = dict(text_encoder_tensors(config, weights, device, seed))
    enc = text_encoder_of(sd, f"synthetic text encoder ({weights})", config)
    del sd
    C.sync(device)
    return enc, {"weights": weights, "build_s": time.perf_counter() - t0, "model_gib": C.module_gib(enc.net),
                 "layers": config.num_hidden_layers, "hidden": config.hidden_size}


# ---------------------------------------------------------------- CLI

def dtype_census(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        k = str(t.dtype).removeprefix("torch.")
        out[k] = out.get(k, 0) + t.numel()
    return out


def main(argv=None) -> int:
    from h3direct.config import H3Config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(C.PRESETS), default="full")
    ap.add_argument("--device", default=None)
    ap.add_argument("--weights", default="nvfp4,bf16")
    ap.add_argument("--vae", action="store_true", help="also build both VAEs")
    ap.add_argument("--text-encoder", action="store_true", help="also build the text encoder (each --weights)")
    args = ap.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    p = C.PRESETS[args.preset]
    config = H3Config.from_name(p.dit_config)
    rows = []
    for w in args.weights.split(","):
        model, info = build_dit(config, w, args.device, nvfp4_mode=p.nvfp4_mode)
        info["dtypes"] = dtype_census(model)
        print(json.dumps(info))
        rows.append([w, info["builder"], info["build_s"], info["model_gib"], info["allocated_gib"]])
        del model
        C.free_memory(args.device)
    if args.vae:
        for name, fn in (("video_vae", lambda: build_video_vae(p.vae_preset, args.device)),
                         ("audio_vae", lambda: build_audio_vae(p.vae_preset, args.device))):
            model, info = fn()
            print(json.dumps({"model": name, **info}))
            rows.append([name, "synthetic", info["build_s"], info["model_gib"], C.allocated_gib(args.device)])
            del model
            C.free_memory(args.device)
    if args.text_encoder:
        for w in args.weights.split(","):
            enc, info = build_text_encoder(p.text_encoder, w, args.device)
            print(json.dumps({"model": "text_encoder", **info}))
            rows.append([f"text_encoder {w}", "synthetic", info["build_s"], info["model_gib"],
                         C.allocated_gib(args.device)])
            del enc
            C.free_memory(args.device)
    C.print_table("synthetic builds", ["model", "builder", "build s", "GiB", "allocated GiB"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
