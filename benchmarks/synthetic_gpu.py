"""Full-size synthetic H3 models built directly on the target device (no disk, no full fp32 copy).

DiT (`build_dit`): the checkpoint generator's own recipe (`h3direct.checkpoint.synthetic.iter_dit_tensors`), one
tensor at a time on the device, then `h3direct.dit.loader.load_state_dict` (strict, ComfyUI's dtype policy) —
exactly what loading the same file from disk would give.

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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402  (puts the repo root on sys.path)

from h3direct.checkpoint.keys import BLOCK_LINEARS as NVFP4_LINEARS  # noqa: E402


def dit_formats(config, weights: str) -> dict[str, str]:
    """layer path -> 'nvfp4' for the DiT block linears ({} for bf16)."""
    if weights == "bf16":
        return {}
    if weights != "nvfp4":
        raise ValueError(f"weights must be bf16 or nvfp4, got {weights!r}")
    return {f"blocks.{i}.{name}": "nvfp4" for i in range(config.num_layers) for name in NVFP4_LINEARS}


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
    C.print_table("synthetic builds", ["model", "builder", "build s", "GiB", "allocated GiB"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
