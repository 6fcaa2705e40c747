"""`python -m oracle record-generate`: a short ComfyUI H3 generation, recorded step by step.

All ComfyUI's own code: `comfy.sd.load_diffusion_model`, the `MiniMaxH3SigmaShift` node (shift_video / shift_audio,
as the H3 templates use it), `comfy.samplers.calculate_sigmas(model_sampling, scheduler, steps)`,
`comfy.samplers.sampler_object(sampler)`, `CFGGuider` (cfg 1, positive only) `.sample(...)` with the inputs file's
noise as the initial noise, its latents as `latent_image` (full denoise: x_T = σ0·noise + (1 − σ0)·latent, audio
carried) and its denoise mask, if any. The sampler callback records, per step i, the packed state it was handed,
unpacked: `sampler.step{i}.x.{video,audio}` (x at σ_i, sampler space, audio carried) and
`sampler.step{i}.denoised.{video,audio}` (the x0 prediction); then `sample_out.{video,audio}` (what `sample`
returns: the final latents, audio un-carried) and `sampler.sigmas`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from h3direct.errors import H3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comfy-root", help="ComfyUI checkout (default: $H3_COMFY_ROOT)")
    parser.add_argument("--checkpoint", required=True, help="H3 DiT .safetensors in ComfyUI's key layout")
    parser.add_argument("--inputs", required=True,
                        help="self-describing inputs file (its noise, latents, conditioning)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sampler", default="euler", help="ComfyUI sampler name (default euler)")
    parser.add_argument("--scheduler", default="simple", help="ComfyUI scheduler name (default simple)")
    parser.add_argument("--shift-video", type=float, default=12.0)
    parser.add_argument("--shift-audio", type=float, default=3.0)
    parser.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--attention", default="pytorch", help="ComfyUI attention switch (default pytorch)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--easycache", metavar="THRESHOLD[,START,END]",
                        help="apply ComfyUI's EasyCache node (reuse_threshold, start_percent, end_percent; defaults "
                             "0.15 / 0.95); records which steps called the model (cache.evaluated)")
    parser.add_argument("--out", required=True, help="output trace .safetensors (manifest written beside it)")


def _shifted(env, patcher, shift_video: float, shift_audio: float):
    """The model patched by ComfyUI's own MiniMaxH3SigmaShift node."""
    import importlib

    try:
        nodes = importlib.import_module("comfy_extras.nodes_minimax_h3")
    except ModuleNotFoundError as exc:
        raise H3Error(f"cannot import ComfyUI's H3 nodes (comfy_extras.nodes_minimax_h3): {exc}") from None
    out = nodes.MiniMaxH3SigmaShift.execute(patcher, shift_video, shift_audio)
    return out.result[0] if hasattr(out, "result") else out[0]


def parse_easycache(value: str | None) -> dict | None:
    if not value:
        return None
    try:
        parts = [float(p) for p in value.split(",")]
    except ValueError:
        raise H3Error(f"--easycache {value!r}: expected THRESHOLD[,START,END] numbers") from None
    if not 1 <= len(parts) <= 3:
        raise H3Error(f"--easycache {value!r}: expected THRESHOLD[,START,END]")
    threshold, start, end = (parts + [0.15, 0.95][len(parts) - 1:])[:3]
    if not (threshold >= 0 and 0 <= start <= end <= 1):
        raise H3Error(f"--easycache {value!r}: need threshold >= 0 and 0 <= start <= end <= 1")
    return {"mode": "easycache", "threshold": threshold, "start_percent": start, "end_percent": end,
            "subsample_factor": 8}


def _with_easycache(patcher, cache: dict, calls: list):
    """The model patched by ComfyUI's own EasyCache node, plus an inner wrapper noting every model call it lets
    through (the sampler sigma of the call)."""
    import importlib

    nodes = importlib.import_module("comfy_extras.nodes_easycache")
    out = nodes.EasyCacheNode.execute(patcher, cache["threshold"], cache["start_percent"], cache["end_percent"], False)
    patched = out.result[0] if hasattr(out, "result") else out[0]
    wrappers = importlib.import_module("comfy.patcher_extension").WrappersMP

    def note_call(executor, *args, **kwargs):
        opts = args[3] if len(args) > 3 and isinstance(args[3], dict) else kwargs.get("transformer_options", {})
        calls.append(float(opts["sigmas"].reshape(-1)[0]))
        return executor(*args, **kwargs)

    patched.add_wrapper_with_key(wrappers.DIFFUSION_MODEL, "h3_oracle_calls", note_call)
    return patched


def record_generation(env, checkpoint: Path, inputs, *, steps: int, sampler: str, scheduler: str,
                      shift_video: float, shift_audio: float, cache: dict | None = None) -> tuple[list, dict]:
    import torch

    from oracle.record import build_conditioning

    if steps < 1:
        raise H3Error(f"--steps {steps}: need at least one step")
    samplers, nested, utils = env.samplers, env.nested_tensor, env.utils
    patcher = env.sd.load_diffusion_model(str(checkpoint))
    if type(patcher.model).__name__ != "MiniMaxH3":
        raise H3Error(f"ComfyUI detected {type(patcher.model).__name__}, not MiniMaxH3", path=checkpoint)
    patcher = _shifted(env, patcher, shift_video, shift_audio)
    calls: list[float] = []
    if cache:
        patcher = _with_easycache(patcher, cache, calls)
    ms = patcher.get_model_object("model_sampling")
    sigmas = samplers.calculate_sigmas(ms, scheduler, steps).to(torch.float32)
    shapes = [tuple(inputs.video_latent.shape), tuple(inputs.audio_latent.shape)]
    items: list = []

    def add_streams(prefix, packed):
        # the sampler may hand over a NestedTensor (video, audio) or the flat packed tensor
        parts = list(packed.unbind()) if getattr(packed, "is_nested", False) else utils.unpack_latents(packed, shapes)
        for label, t in zip(("video", "audio"), parts, strict=True):
            items.append((f"{prefix}.{label}", t.detach().clone()))

    def callback(i, denoised, x, total):
        add_streams(f"sampler.step{i}.x", x)
        add_streams(f"sampler.step{i}.denoised", denoised)

    guider = samplers.CFGGuider(patcher)
    guider.set_cfg(1.0)
    guider.inner_set_conds({"positive": build_conditioning(inputs)})
    noise = nested.NestedTensor([inputs.video_noise, inputs.audio_noise])
    latent = nested.NestedTensor([inputs.video_latent, inputs.audio_latent])
    mask = None
    if inputs.denoise_mask:
        mask = nested.NestedTensor([inputs.denoise_mask["video"], inputs.denoise_mask["audio"]])
    with torch.no_grad():
        out = guider.sample(noise, latent, samplers.sampler_object(sampler), sigmas, denoise_mask=mask,
                            callback=callback, disable_pbar=True, seed=inputs.sampler_seed)
    parts = list(out.unbind()) if getattr(out, "is_nested", False) else list(out)
    for label, t in zip(("video", "audio"), parts, strict=True):
        items.append((f"sample_out.{label}", t.detach().clone()))
    items.append(("sampler.sigmas", sigmas.clone()))
    if cache:
        table = [float(s) for s in sigmas[:-1]]
        called = {table.index(c) for c in calls if c in table}
        items.append(("cache.evaluated", torch.tensor([int(i in called) for i in range(steps)], dtype=torch.int64)))
    facts = {
        "sampler": sampler, "scheduler": scheduler, "steps": steps, "cfg": 1.0, "denoise": 1.0,
        "sampling": {"shift": float(ms.shift), "audio_shift": float(getattr(ms, "audio_shift", 0.0) or 0.0),
                     "audio_scale": float(getattr(ms, "audio_scale", 1.0))},
        "sigmas": [float(s) for s in sigmas],
        "model_dtype": str(patcher.model_dtype()),
        "inference_dtype": str(patcher.model.get_dtype_inference()),
        "attention": env.attention_function(),
    }
    if cache:
        facts["cache"] = cache
    return items, facts


def run(args: argparse.Namespace) -> int:
    from h3direct.traces.format import save_trace
    from oracle.record import open_run

    checkpoint, inputs, env, common = open_run(args)
    items, facts = record_generation(env, checkpoint, inputs, steps=args.steps, sampler=args.sampler,
                                     scheduler=args.scheduler, shift_video=args.shift_video,
                                     shift_audio=args.shift_audio, cache=parse_easycache(args.easycache))
    manifest = {
        "kind": "generate",
        **common,
        **facts,
        "environment": env.describe(),
        "notes": "sampler.step{i}.x = the sampler state at sigma_i handed to the model (packed sampler space, audio "
        "carried x audio_scale), .denoised = its x0 prediction; sample_out = CFGGuider.sample's result.",
    }
    out = save_trace(args.out, items, manifest, dedupe=False)
    print(f"wrote {out} ({len(items)} tensors, {args.steps} {args.sampler}/{args.scheduler} steps, "
          f"sigmas {', '.join(f'{s:.4f}' for s in facts['sigmas'])})")
    return 0
