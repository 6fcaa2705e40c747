"""`python -m oracle record`: one denoiser evaluation of a ComfyUI-loaded H3 checkpoint, traced per layer.

Path (all ComfyUI's own code): `comfy.sd.load_diffusion_model` -> `CFGGuider` (cfg 1, positive only) ->
`KSAMPLER` with a one-step function that calls the model once at sigma. Conditioning and latents come from a
self-describing inputs file (h3direct/traces/format.py `load_inputs`).

A low-precision recording brings its fp32 twin (the same case in fp32, the ratio rule's reference) and, on a GPU
where SageAttention is importable (or with `--sage-twin`), ComfyUI's fast mode: the same case under
`--use-sage-attention`, `<stem>_sage.safetensors`, the reference of h3direct's quantized-attention class
(parity_tests/ladder.py). Each runs in its own process (ComfyUI reads its switches once). ComfyUI falls back to
PyTorch attention on a sage error and only logs it: such a recording is refused, never kept.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comfy-root", help="ComfyUI checkout (default: $H3_COMFY_ROOT)")
    parser.add_argument("--checkpoint", required=True, help="H3 DiT .safetensors in ComfyUI's key layout")
    parser.add_argument("--inputs", required=True, help="self-describing inputs file (h3-oracle-inputs/1)")
    parser.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--attention",
        default="pytorch",
        help="ComfyUI attention switch: pytorch|sage|flash|split|"
        "sub_quad|ck|default (default: pytorch = --use-pytorch-cross-attention)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--detail",
        choices=("full", "reduced"),
        default="full",
        help="full: inputs of every module (teacher forcing of any layer); reduced: the shared set",
    )
    parser.add_argument("--out", required=True, help="output trace .safetensors (manifest written beside it)")
    parser.add_argument("--no-twin", action="store_true",
                        help="bf16: do not record the fp32 twin (the gate's ratio rule needs it; without it only "
                             "`pytest -m parity --no-twin` gates this trace, by rounding bounds)")
    parser.add_argument("--sage-twin", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16/fp16: also record ComfyUI --use-sage-attention on the same case, beside the trace "
                             "as <stem>_sage (the reference of the gate's quantized-attention class); default: on "
                             "a CUDA device where SageAttention is importable")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_fields(key: str, path: str | Path) -> dict:
    """A recorded file in a manifest: its name, its sha256 and where it was (absolute), so that the gate and replay
    find it beside the trace or where it was recorded from (`h3direct.traces.pairing.recorded_file`)."""
    path = Path(path)
    return {key: path.name, f"{key}_sha256": file_sha256(path), f"{key}_path": str(path.resolve())}


def build_conditioning(inputs) -> list:
    """`[[text_states, {minimax_token_tags, minimax_keyframes?, minimax_refs?}]]` as ComfyUI's nodes produce it."""
    extra: dict[str, Any] = {"minimax_token_tags": inputs.token_tags}
    if inputs.keyframes:
        extra["minimax_keyframes"] = [dict(kf) for kf in inputs.keyframes]
    if inputs.refs:
        extra["minimax_refs"] = [dict(r) for r in inputs.refs]
    return [[inputs.text_states, extra]]


SAGE_FALLBACK = "Error running sage attention"  # what ComfyUI logs when it runs PyTorch attention instead


class _SageFallbacks(logging.Handler):
    """Counts ComfyUI's log lines saying a sage call fell back to PyTorch attention."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if SAGE_FALLBACK in msg:
            self.lines.append(msg.strip())


def sage_importable() -> bool:
    return importlib.util.find_spec("sageattention") is not None


def record_dit(env, checkpoint: Path, inputs, *, detail: str = "full") -> tuple[dict, dict]:
    """Run one traced denoiser evaluation; returns (tensors in execution order, manifest fields). Under ComfyUI's
    sage attention, a call that fell back to PyTorch attention (ComfyUI only logs it) refuses the recording."""
    fallbacks = _SageFallbacks()
    logging.getLogger().addHandler(fallbacks)
    try:
        tensors, manifest = _record_dit(env, checkpoint, inputs, detail=detail)
    finally:
        logging.getLogger().removeHandler(fallbacks)
    if env.attention == "sage":
        if manifest["attention"] != "attention_sage":
            raise H3Error(f"ComfyUI ran {manifest['attention']}, not attention_sage, under --use-sage-attention")
        if fallbacks.lines:
            raise H3Error(f"ComfyUI's sage attention fell back to PyTorch attention in {len(fallbacks.lines)} "
                          f"call(s) ({fallbacks.lines[0][:160]}): not a recording of its fast mode")
    return tensors, manifest


def _record_dit(env, checkpoint: Path, inputs, *, detail: str = "full") -> tuple[dict, dict]:
    import torch

    from oracle.hooks import Recorder

    samplers, nested = env.samplers, env.nested_tensor
    wrappers = env.patcher_extension.WrappersMP
    patcher = env.sd.load_diffusion_model(str(checkpoint))
    base = patcher.model
    if type(base).__name__ != "MiniMaxH3":
        raise H3Error(f"ComfyUI detected {type(base).__name__}, not MiniMaxH3", path=checkpoint)
    device = env.model_management.get_torch_device()

    rec = Recorder(detail=detail, attention_cls=env.h3_model.Attention)
    rec.attach(base.diffusion_model)
    patcher.add_wrapper_with_key(wrappers.DIFFUSION_MODEL, "h3_oracle", rec.diffusion_model_wrapper)
    patcher.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = rec.attention_override

    video_shape, audio_shape = tuple(inputs.video_latent.shape), tuple(inputs.audio_latent.shape)
    layout_info: dict[str, Any] = {}

    def one_step(model, x, sigmas, extra_args=None, callback=None, disable=None):
        # the packed sampler state -> one model call (KSamplerX0Inpaint applies the denoise mask)
        rec.add_streams("sampler.x_in", env.utils.unpack_latents(x, [video_shape, audio_shape]))
        denoised = model(x, sigmas[0] * x.new_ones([x.shape[0]]), **(extra_args or {}))
        rec.add_streams("sampler.denoised", env.utils.unpack_latents(denoised, [video_shape, audio_shape]))
        return denoised

    guider = samplers.CFGGuider(patcher)
    guider.set_cfg(1.0)
    guider.inner_set_conds({"positive": build_conditioning(inputs)})
    noise = nested.NestedTensor([inputs.video_noise, inputs.audio_noise])
    latent = nested.NestedTensor([inputs.video_latent, inputs.audio_latent])
    mask = None
    if inputs.denoise_mask:
        mask = nested.NestedTensor([inputs.denoise_mask["video"], inputs.denoise_mask["audio"]])
    sigma = float(inputs.get("sigma").flatten()[0]) if "sigma" in inputs.tensors else inputs.sigma
    sigmas = torch.tensor([sigma, 0.0], dtype=torch.float32)
    with torch.no_grad():
        out = guider.sample(
            noise,
            latent,
            samplers.KSAMPLER(one_step),
            sigmas,
            denoise_mask=mask,
            disable_pbar=True,
            seed=inputs.sampler_seed,
        )
    rec.add_streams("sample_out", out)
    rec.detach()
    if rec.payload is not None:
        layout_info.update(_layout_fields(rec.payload))

    ms = patcher.get_model_object("model_sampling")
    cfg = base.model_config
    manifest = {
        "model_dtype": str(patcher.model_dtype()),
        "inference_dtype": str(base.get_dtype_inference()),
        "manual_cast_dtype": str(base.manual_cast_dtype),
        "attention": env.attention_function(),
        "unet_config_detected": {
            k: (str(v) if not isinstance(v, int | float | str | bool | list) else v) for k, v in cfg.unet_config.items()
        },
        "sampling": {
            "shift": float(ms.shift),
            "audio_shift": float(getattr(ms, "audio_shift", 0.0) or 0.0),
            "audio_scale": float(getattr(ms, "audio_scale", 1.0)),
        },
        "layout": layout_info,
        "static_inputs": rec.static_inputs,
        "device": str(device),
    }
    return rec.tensors(), manifest


def _layout_fields(payload: dict) -> dict:
    layout = payload.get("layout")
    out: dict[str, Any] = {}
    if layout is not None:
        out["segments"] = [[int(a), int(b), str(k)] for a, b, k in layout.segments]
        out["seq_len"] = int(layout.seq_len)
    out["audio_scale"] = float(payload.get("audio_scale", 1.0))
    out["payload_keys"] = sorted(payload)
    return out


def open_run(args: argparse.Namespace):
    """(checkpoint path, inputs, ComfyUI environment, common manifest fields) of a DiT recording command."""
    from h3direct.checkpoint.inspect import inspect_checkpoint
    from h3direct.config import H3Config
    from h3direct.traces.inputs import check_fits, load_inputs
    from oracle.comfy_env import open_comfy

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_file():
        raise H3Error("checkpoint not found", path=checkpoint)
    inputs = load_inputs(args.inputs)
    # the inputs against the checkpoint's header (one line, before ComfyUI is imported): ComfyUI itself would stop
    # deep in a matrix product
    check_fits(inputs, H3Config.from_dict(inspect_checkpoint(checkpoint)["config"]))
    env = open_comfy(args.comfy_root, device=args.device, compute_dtype=args.compute_dtype, attention=args.attention)
    common = {
        "comfyui_commit": env.commit,
        **file_fields("checkpoint", checkpoint),
        **file_fields("inputs", args.inputs),
        "task": inputs.task,
        "variant": inputs.variant,
        "seed": inputs.sampler_seed,
        "sampler_seed": inputs.sampler_seed,
        "compute_dtype_requested": args.compute_dtype,
        "bf16_patched": env.bf16_patched,
        "nvfp4_mode": env.nvfp4_mode(),
    }
    return checkpoint, inputs, env, common


def twin_path(out: str | Path) -> Path:
    """Where the fp32 twin of a low-precision trace goes: its name with the dtype replaced (else `_fp32` added)."""
    out = Path(out)
    stem = out.stem
    for low in ("bf16", "fp16"):
        i = stem.rfind(low)
        if i >= 0:
            return out.with_name(stem[:i] + "fp32" + stem[i + len(low):] + out.suffix)
    return out.with_name(f"{stem}_fp32{out.suffix}")


def record_beside(args: argparse.Namespace, out: Path, compute: str, attention: str, what: str, flag: str) -> Path:
    """Another recording of the same case (`compute`, ComfyUI's `attention` switch) at `out`, in its own process
    (ComfyUI reads its switches once); `what` / `flag` name it and the flag that skips it in the error line."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "oracle", "record", "--checkpoint", str(args.checkpoint), "--inputs",
           str(args.inputs), "--compute-dtype", compute, "--attention", attention, "--device", args.device,
           "--detail", args.detail, "--no-twin", "--no-sage-twin", "--out", str(out)]
    if args.comfy_root:
        cmd += ["--comfy-root", args.comfy_root]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise H3Error(f"{what} failed: {tail[0]} (pass {flag} to record without it)")
    print(r.stdout.strip())
    return out


def record_twin(args: argparse.Namespace) -> Path:
    """The fp32 twin of a low-precision recording."""
    return record_beside(args, twin_path(args.out), "fp32", args.attention, "the fp32 twin", "--no-twin")


def sage_path(out: str | Path) -> Path:
    """Where ComfyUI --use-sage-attention's recording of a low-precision trace goes: `<stem>_sage`."""
    out = Path(out)
    return out.with_name(f"{out.stem}_sage{out.suffix}")


def wants_sage_twin(args: argparse.Namespace) -> bool:
    """--sage-twin as given; by default on for a low-precision recording on CUDA where SageAttention imports."""
    if args.compute_dtype == "fp32" or args.attention == "sage":
        if args.sage_twin:
            raise H3Error("--sage-twin records a low-precision case beside its PyTorch-attention trace: use it with "
                          "--compute-dtype bf16 and the default --attention")
        return False
    if args.sage_twin is None:
        return args.device == "cuda" and sage_importable()
    return args.sage_twin


def record_sage_twin(args: argparse.Namespace) -> Path:
    """ComfyUI --use-sage-attention on the same case, in the same compute dtype."""
    return record_beside(args, sage_path(args.out), args.compute_dtype, "sage", "the sage twin", "--no-sage-twin")


def run(args: argparse.Namespace) -> int:
    from h3direct.traces.format import save_trace

    if (args.attention == "sage" or args.sage_twin) and not sage_importable():
        raise H3Error("ComfyUI's --use-sage-attention needs SageAttention, which is not importable here "
                      "(build it with tools/build_sageattention.sh)")
    sage = wants_sage_twin(args)
    checkpoint, inputs, env, common = open_run(args)
    tensors, fields = record_dit(env, checkpoint, inputs, detail=args.detail)
    manifest = {
        **common,
        "sigma": inputs.sigma,
        **fields,
        "trace_detail": args.detail,
        "environment": env.describe(),
        "notes": "aliases: name -> stored tensor with bit-identical content. Float tensors narrower than 32 bit are "
        "stored as float32; 'dtype' is the dtype ComfyUI produced. '#k' = k-th call of a module.",
    }
    out = save_trace(args.out, tensors, manifest)
    print(
        f"wrote {out} ({len(tensors)} tensors, attention {fields['attention']}, "
        f"inference dtype {fields['inference_dtype']})"
    )
    if args.compute_dtype != "fp32" and not args.no_twin:
        record_twin(args)
    if sage:
        record_sage_twin(args)
    return 0
