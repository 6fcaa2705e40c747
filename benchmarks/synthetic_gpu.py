"""Full-size synthetic H3 models built directly on the target device (no disk, no full fp32 copy).

DiT (`build_dit`): two builders, same result layout (keys, shapes, dtypes):

- ``make_checkpoint`` (preferred when `h3direct.make_checkpoint.iter_dit_tensors` exists): the checkpoint
  generator's own recipe, one tensor at a time on the device, then `h3direct.dit.loader.load_state_dict`
  (strict, ComfyUI's dtype policy) — exactly what loading the same file from disk would give;
- ``direct``: `h3direct.dit.loader.build_model` on meta, every tensor given its policy dtype while still on
  meta, `to_empty(device)`, then filled in place: Linear weights ~ N(0, (gain/sqrt(fan_in))²) (gain 0.6 for
  curve adaLN, 1.5 full adaLN, 2.0 `time_embedder.proj_out`), biases N(0, 0.02²), RMSNorm 1 + N(0, 0.05²),
  `adaln_t_table` smooth cosine curves, `rope.inv_freq` = 10000^(-arange(L)/L), NVFP4 layers quantized from
  a bf16 draw by `h3direct.quant.nvfp4.quantize_nvfp4`.

`weights="nvfp4"` puts the 4·num_layers DiT block linears (qkv_proj, out_proj, fc1, fc2) in NVFP4; the
token-refiner blocks stay bf16 (the released pruned layout). Memory: bf16 full model ~37.6 GiB, NVFP4 ~11.7 GiB;
the largest temporary is one fp32 master tensor (fc1: 0.6 GB).

VAEs (`build_video_vae`, `build_audio_vae`): `h3direct.vae.synthetic`'s per-key init rules evaluated with a
generator on the device, written in place into a model whose tensors already have the compute dtype.

CLI (a build check): `python3 benchmarks/synthetic_gpu.py --preset tiny --device cpu --weights bf16,nvfp4`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402  (puts the repo root on sys.path)

NVFP4_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
BUILDERS = ("auto", "make_checkpoint", "direct")


def dit_formats(config, weights: str) -> dict[str, str]:
    """layer path -> 'nvfp4' for the DiT block linears ({} for bf16)."""
    if weights == "bf16":
        return {}
    if weights != "nvfp4":
        raise ValueError(f"weights must be bf16 or nvfp4, got {weights!r}")
    return {f"blocks.{i}.{name}": "nvfp4" for i in range(config.num_layers) for name in NVFP4_LINEARS}


def _has_make_checkpoint() -> bool:
    try:
        from h3direct.make_checkpoint import iter_dit_tensors  # noqa: F401
    except ImportError:
        return False
    return True


def build_dit(config, weights: str, device, *, compute_dtype=None, nvfp4_mode: str = "w4a16", seed: int = 0,
              builder: str = "auto"):
    """(H3DiT on `device` in eval mode, info dict). compute_dtype default bf16."""
    import torch

    compute_dtype = compute_dtype or torch.bfloat16
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {BUILDERS}, got {builder!r}")
    if builder == "auto":
        builder = "make_checkpoint" if _has_make_checkpoint() else "direct"
    C.sync(device)
    t0 = time.perf_counter()
    fn = _build_via_make_checkpoint if builder == "make_checkpoint" else _build_direct
    model = fn(config, weights, device, compute_dtype, nvfp4_mode, seed)
    C.sync(device)
    info = {"weights": weights, "builder": builder, "nvfp4_mode": nvfp4_mode if weights == "nvfp4" else None,
            "compute_dtype": str(compute_dtype).removeprefix("torch."), "build_s": time.perf_counter() - t0,
            "model_gib": C.module_gib(model), "allocated_gib": C.allocated_gib(device)}
    return model, info


# ---------------------------------------------------------------- builder 1: the checkpoint generator

def _build_via_make_checkpoint(config, weights, device, compute_dtype, nvfp4_mode, seed):
    from h3direct.dit.loader import load_state_dict
    from h3direct.make_checkpoint import iter_dit_tensors

    quant = "nvfp4" if weights == "nvfp4" else "none"
    sd = {}
    for key, t in iter_dit_tensors(config, quant, seed, str(device), nvfp4_refiner=False):
        # the loader parses the JSON markers with numpy: keep those 19-byte tensors on the CPU
        sd[key] = t.cpu() if key.endswith(".comfy_quant") else t
    model = load_state_dict(sd, compute_dtype=compute_dtype, nvfp4_mode=nvfp4_mode, device=device,
                            source="synthetic")
    del sd
    return model


# ---------------------------------------------------------------- builder 2: fill a meta model in place

def _policy_dtype(module, compute, mixed):
    """The loader's dtype policy for a module's float parameters (None = keep as declared)."""
    import torch

    try:
        from h3direct.dit.loader import _target_dtype

        return _target_dtype(module, compute, mixed)
    except ImportError:  # the loader's table, restated
        from h3direct.dit.linear import Linear, NVFP4Linear

        if isinstance(module, NVFP4Linear):
            return None
        if compute == torch.float32:
            return torch.float32
        if isinstance(module, Linear) and module.island and not mixed:
            return torch.float32
        return compute


def _gain(name: str, curve: bool) -> float:
    if ".adaln_proj." in name or name.startswith("adaln_proj."):
        return 0.6 if curve else 1.5
    if name.startswith("time_embedder.proj_out."):
        return 2.0
    return 1.0


def _build_direct(config, weights, device, compute_dtype, nvfp4_mode, seed):
    import torch
    from torch import nn

    from h3direct.dit.blocks import RMSNorm
    from h3direct.dit.linear import NVFP4Linear
    from h3direct.dit.loader import build_model
    from h3direct.quant import NVFP4_MARKER
    from h3direct.quant.nvfp4 import quantize_nvfp4

    formats = dit_formats(config, weights)
    model = build_model(config, formats, nvfp4_mode)
    mixed = bool(formats)
    # give every float parameter its policy dtype while still on meta (no full fp32 copy ever exists)
    for module in model.modules():
        target = _policy_dtype(module, compute_dtype, mixed)
        if target is None:
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != target:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=target, device="meta"),
                                                   requires_grad=False))
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module.comfy_quant = torch.empty(len(NVFP4_MARKER), dtype=torch.uint8, device="meta")
    model.to_empty(device=device)

    g = torch.Generator(device=device).manual_seed(seed)
    curve = config.is_curve
    modules = dict(model.named_modules())
    with torch.no_grad():
        for mod_name in sorted(modules):
            module = modules[mod_name]
            prefix = f"{mod_name}." if mod_name else ""
            if isinstance(module, NVFP4Linear):
                n, k = module.out_features, module.in_features
                w = torch.randn((n, k), generator=g, device=device, dtype=torch.float32)
                w = w.mul_(_gain(prefix + "weight", curve) / math.sqrt(k)).to(torch.bfloat16)
                q = quantize_nvfp4(w)
                del w
                module.weight.copy_(q.packed)
                module.weight_scale.copy_(q.block_scale)
                module.weight_scale_2.copy_(q.global_scale)
                module.comfy_quant.copy_(torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8))
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.02, generator=g)
                continue
            for name, p in module.named_parameters(recurse=False):
                key = prefix + name
                if isinstance(module, RMSNorm):
                    p.normal_(1.0, 0.05, generator=g)
                elif name == "bias":
                    p.normal_(0.0, 0.02, generator=g)
                elif name == "weight":
                    std = _gain(key, curve) / math.sqrt(p.shape[1])
                    p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(std))
                else:
                    raise AssertionError(f"no init rule for {key}")
        inv = model.rope.inv_freq
        L = inv.shape[0]
        inv.copy_(10000.0 ** (-torch.arange(L, dtype=torch.float32, device=device) / L))
        if curve:
            grid, k = model.adaln_t_table.shape
            a = torch.randn(k, generator=g, device=device)
            f = 0.5 + 3.5 * torch.rand(k, generator=g, device=device)
            phi = 2 * math.pi * torch.rand(k, generator=g, device=device)
            b = 0.5 * torch.randn(k, generator=g, device=device)
            t = torch.linspace(0, 1, grid, device=device)[:, None]
            model.adaln_t_table.copy_(a * torch.cos(math.pi * f * t + phi) + b)
    model.compute_dtype = compute_dtype
    model.eval()
    return model


# ---------------------------------------------------------------- VAEs

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
    ap.add_argument("--builder", choices=BUILDERS, default="auto")
    ap.add_argument("--vae", action="store_true", help="also build both VAEs")
    args = ap.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    p = C.PRESETS[args.preset]
    config = H3Config.from_name(p.dit_config)
    rows = []
    for w in args.weights.split(","):
        model, info = build_dit(config, w, args.device, nvfp4_mode=p.nvfp4_mode, builder=args.builder)
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
    C.print_table("synthetic builds", ["model", "builder", "build s", "GiB", "allocated GiB"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
