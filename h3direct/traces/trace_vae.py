"""`h3direct trace-vae`: run every VAE case of an inputs file through the public decode/encode path and record a trace.

The VAE kind (video or audio) is told by the weights' keys; the cases are the `<kind>_decode.<case>.*` and
`<kind>_encode.<case>.*` tensors of the inputs file (`vae_inputs_public.safetensors` layout). Names follow the shared
oracle: `<case>.vae_decode.out`, `<case>.vae_encode.out`, and per-module `<case>.<module path>[#k].out|in` for the
modules the oracle records (k = k-th call, tiles row-major inside each temporal chunk).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

SITES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    # kind -> [(module-path regex, what to record)]
    "video_decode": [
        (r"post_quant_conv", ("in", "out")),
        (r"decoder\.x_embedder", ("out",)),
        (r"decoder\.transformer_blocks\.\d+", ("out",)),
        (r"decoder\.norm_out", ("out",)),
    ],
    "video_encode": [
        (r"encoder\.down\.([3-9]|\d\d+)\.block\.\d+", ("out",)),
        (r"encoder\.down\.([3-9]|\d\d+)\.downsample", ("out",)),
        (r"encoder\.conv_out", ("out",)),
        (r"quant_conv", ("out",)),
    ],
    "audio_decode": [
        (r"dec_in_proj", ("out",)),
        (r"decoder\.conv_pre", ("out",)),
        (r"decoder\.ups\.\d+\.0", ("out",)),
        (r"decoder\.resblocks\.[0-2]", ("out",)),
        (r"decoder\.activation_post", ("in", "out")),
        (r"decoder\.conv_post", ("out",)),
    ],
    "audio_encode": [
        (r"encoder\.block\.([2-9]|\d\d+)", ("out",)),
        (r"pre_block\.attn", ("out",)),
        (r"pre_block", ("out",)),
        (r"mean_proj", ("out",)),
    ],
}


class Recorder:
    """Forward hooks that append `(name, tensor)` in execution order, prefixed by the current case."""

    def __init__(self, model, sites: list[tuple[str, tuple[str, ...]]]):
        self.items: list[tuple[str, object]] = []
        self.prefix = ""
        self.calls: dict[str, int] = {}
        self.handles = []
        for path, module in model.named_modules():
            for pattern, what in sites:
                if re.fullmatch(pattern, path):
                    self.handles.append(module.register_forward_hook(self._hook(path, what)))
                    break

    def _hook(self, path: str, what: tuple[str, ...]) -> Callable:
        def hook(module, args, output):
            k = self.calls.get(self.prefix + path, 0)
            self.calls[self.prefix + path] = k + 1
            name = f"{self.prefix}{path}" + (f"#{k}" if k else "")
            if "in" in what:
                self.items.append((f"{name}.in", args[0].detach().clone()))
            if "out" in what:
                self.items.append((f"{name}.out", output.detach().clone()))

        return hook

    def case(self, name: str) -> None:
        self.prefix = f"{name}."

    def add(self, name: str, t) -> None:
        self.items.append((name, t.detach().clone()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", required=True, help="VAE safetensors (ComfyUI keys; video or audio, told by keys)")
    parser.add_argument("--config", help="constructor-args JSON (vae_config_public.json layout); default: real sizes")
    parser.add_argument("--inputs", required=True, help="VAE inputs safetensors (<kind>.<case>.<field> names)")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="compute dtype (audio: fp32 only)")
    parser.add_argument("--only", choices=("decode", "encode"), help="run only decode or only encode cases")
    parser.add_argument("--out", required=True, help="trace .safetensors to write (a .json manifest goes beside it)")


def check_fits(inputs: dict, cfg, kind: str, path) -> None:
    """H3Error (one line) unless every case of `inputs` fits the VAE (`cfg`): decode latents with its latent channels,
    video pixels with 3 colour channels, stereo waveforms. Checked before any case runs."""
    from h3direct.errors import H3Error

    want = {"video_decode": ("latent", 5, 1, cfg.embed_dim if kind == "video" else None),
            "audio_decode": ("latent", 4, 1, getattr(cfg, "vae_latent_channels", None)),
            "video_encode": ("pixels", 4, -1, 3), "audio_encode": ("waveform", 3, -1, 2)}
    for what, cases in inputs.items():
        if what not in want or not what.startswith(kind):
            continue
        name, ndim, axis, size = want[what]
        for case, fields in cases.items():
            t = fields.get(name)
            if t is None or t.ndim != ndim or t.shape[axis] != size:
                got = None if t is None else list(t.shape)
                raise H3Error(f"--inputs: {what}.{case}.{name} {got} does not fit this {kind} VAE (needs {ndim} "
                              f"dims with {size} channels): these inputs are for another VAE or config", path=path)


def run(*, weights: str, inputs: str, out: str, config: str | None = None, dtype: str = "fp32",
        only: str | None = None) -> int:
    import json

    import torch

    from h3direct.errors import H3Error
    from h3direct.traces.format import load_vae_inputs, save_trace
    from h3direct.vae.api import decode_audio, decode_video, encode_audio, encode_video
    from h3direct.vae.audio import AudioVAE
    from h3direct.vae.config import read_constructor_args
    from h3direct.vae.loader import load_vae

    constructor_args = read_constructor_args(config)
    compute = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    vae = load_vae(weights, constructor_args, dtype=compute)
    kind = "audio" if isinstance(vae, AudioVAE) else "video"
    if kind == "audio" and dtype != "fp32":
        raise H3Error(f"the audio VAE runs in fp32 only (got --dtype {dtype})", path=weights)
    cases_in = load_vae_inputs(inputs)
    check_fits(cases_in, vae.cfg, kind, inputs)
    runs = {
        "video_decode": lambda d: decode_video(vae, d["latent"], dtype=compute),
        "video_encode": lambda d: encode_video(vae, d["pixels"], dtype=compute),
        "audio_decode": lambda d: decode_audio(vae, d["latent"]),
        "audio_encode": lambda d: encode_audio(vae, d["waveform"]),
    }
    ops = (only,) if only else ("decode", "encode")
    wanted = [f"{kind}_{op}" for op in ops if f"{kind}_{op}" in cases_in]
    if not wanted:
        names = " or ".join(f"{kind}_{op}.*" for op in ops)
        raise H3Error(f"no {names} cases (found kinds: {sorted(cases_in)})", path=inputs)

    items, cases = [], {}
    for what in wanted:
        rec = Recorder(vae, SITES[what])
        try:
            for case, fields in cases_in[what].items():
                rec.case(case)
                result = runs[what](fields)
                rec.add(f"{case}.vae_{what.split('_')[1]}.out", result)
                cases.setdefault(what, {})[case] = {
                    "input": {k: list(v.shape) for k, v in fields.items()}, "output": list(result.shape)}
        finally:
            rec.close()
        items += rec.items

    cfg = vae.cfg
    manifest = {
        "producer": "h3direct trace-vae",
        "kind": kind,
        "compute_dtype": dtype,
        "weights": str(weights),
        "inputs": str(inputs),
        "constructor_args": constructor_args.get("constructor_args", constructor_args),
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "attention": "torch.nn.functional.scaled_dot_product_attention",
        "cases": cases,
    }
    path = save_trace(out, items, manifest)
    print(json.dumps({"out": str(path), "kind": kind, "dtype": dtype, "tensors": len(items),
                      "cases": {k: sorted(v) for k, v in cases.items()}}))
    return 0
