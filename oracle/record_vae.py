"""`python -m oracle record-vae`: ComfyUI's H3 video / audio VAE decode and encode, traced per case.

ComfyUI's loader (`comfy.sd.VAE(sd=..., dtype=...)`) recognises the H3 VAEs by their keys but always builds the
full-size classes. For tiny test VAEs the constructor arguments of a `vae_config_*.json` (its `constructor_args`)
are injected by swapping, for the duration of the load only, the class names the loader looks up
(`MiniMaxH3VideoVAE`, `ViT3DDecoder`, `MiniMaxH3AudioVAE`) for subclasses that add those keyword arguments.
Nothing else changes: ComfyUI's state-dict load, dtype cast, `VAE.decode` / `VAE.encode` (chunked output buffer,
tiling, temporal chunking, waveform crop) and all model code run as shipped.

One trace per operation (`<modality>_decode` or `<modality>_encode`, the manifest's `kind`), names as the shared
VAE traces: `<case>.<module path>[#k].in|out` for the sites below, `<case>.vae_decode.out` / `.vae_encode.out`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error

OPS = ("decode", "encode")

# kind -> [(module path pattern, what is recorded)]: the sites of ../shared/oracle README section 3
# the recorded module sites: the same table h3direct's trace-vae records (one vocabulary)
from h3direct.traces.trace_vae import SITES  # noqa: E402

# the input field of each kind in a `vae_inputs_*.safetensors` file
INPUT_FIELD = {"video_decode": "latent", "audio_decode": "latent", "video_encode": "pixels",
               "audio_encode": "waveform"}
# the per-call method of each video kind whose argument shapes the manifest lists (tiles / chunks)
CALL_METHOD = {"video_decode": "_decode_pixels", "video_encode": "_encode_moments"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comfy-root", help="ComfyUI checkout (default: $H3_COMFY_ROOT)")
    parser.add_argument("--weights", required=True, help="VAE .safetensors in ComfyUI's key layout (video or audio)")
    parser.add_argument("--config", help="vae_config_*.json whose constructor_args build the VAE (default: full size)")
    parser.add_argument("--inputs", required=True, help="vae_inputs_*.safetensors (<kind>.<case>.<field> tensors)")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32",
                        help="ComfyUI VAE dtype (comfy.sd.VAE(dtype=...)); the audio VAE is fp32 only")
    parser.add_argument("--op", choices=OPS, help="decode or encode (default: every op with cases in --inputs)")
    parser.add_argument("--calls", choices=("all", "first"),
                        help="module sites of every tile/chunk call, or of the first call of each case only "
                        "(default: all for fp32, first for fp16, as the shared traces)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", required=True,
                        help="trace .safetensors; with several ops it must contain '{op}' "
                        "(e.g. trace_vae_video_{op}_fp32.safetensors)")


def constructor_args(config: dict | None) -> dict[str, dict[str, Any]]:
    """{class name: keyword arguments} from a vae_config JSON (or its bare `constructor_args`); notes dropped."""
    if not config:
        return {}
    raw = config.get("constructor_args", config)
    if not isinstance(raw, dict):
        raise H3Error("VAE config: constructor_args is not a JSON object")
    out = {}
    for cls, kwargs in raw.items():
        if not isinstance(kwargs, dict):
            raise H3Error(f"VAE config: constructor_args.{cls} is not a JSON object")
        out[cls] = {k: v for k, v in kwargs.items() if not k.startswith("note")}
    return out


def _with_kwargs(cls: type, extra: dict[str, Any]) -> type:
    """A subclass of ComfyUI's `cls` whose constructor gets `extra` on top of what its caller passes."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **{**kwargs, **extra})

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


@contextlib.contextmanager
def sized_classes(ctor: dict[str, dict[str, Any]]) -> Iterator[None]:
    """While active, ComfyUI's H3 VAE classes are built with the given constructor arguments."""
    import importlib

    video = importlib.import_module("comfy.ldm.minimax.vae")
    audio = importlib.import_module("comfy.ldm.minimax.audio_vae")
    slots = {"MiniMaxH3VideoVAE": video, "ViT3DDecoder": video, "MiniMaxH3AudioVAE": audio}
    unknown = sorted(set(ctor) - set(slots))
    if unknown:
        raise H3Error(f"VAE config: constructor_args for unknown class(es) {unknown}; known: {sorted(slots)}")
    saved = {name: getattr(mod, name) for name, mod in slots.items()}
    try:
        for name, kwargs in ctor.items():
            if kwargs:
                setattr(slots[name], name, _with_kwargs(saved[name], kwargs))
        yield
    finally:
        for name, mod in slots.items():
            setattr(mod, name, saved[name])


class CaseRecorder:
    """Forward hooks on the selected sites; names `<case>.<path>[#k].in|out` in execution order."""

    def __init__(self, model, sites: list[tuple[str, tuple[str, ...]]], *, first_call_only: bool):
        self.items: list[tuple[str, Any]] = []
        self.first_call_only = first_call_only
        self.case = ""
        self.calls: dict[str, int] = {}
        self.handles = []
        for path, module in model.named_modules():
            what = next((w for pattern, w in sites if re.fullmatch(pattern, path)), None)
            if what is None:
                continue
            if "in" in what:
                self.handles.append(module.register_forward_pre_hook(self._pre(path)))
            self.handles.append(module.register_forward_hook(self._post(path, "out" in what)))

    def start(self, case: str) -> None:
        self.case, self.calls = case, {}

    def _name(self, path: str) -> str | None:
        k = self.calls.get(path, 0)
        if k and self.first_call_only:
            return None
        return f"{self.case}.{path}" + (f"#{k}" if k else "")

    def _pre(self, path: str) -> Callable:
        def hook(module, args):
            name = self._name(path)
            if name is not None:
                self.items.append((f"{name}.in", args[0].detach().clone()))

        return hook

    def _post(self, path: str, record_out: bool) -> Callable:
        def hook(module, args, output):
            name = self._name(path)
            self.calls[path] = self.calls.get(path, 0) + 1
            if name is not None and record_out:
                self.items.append((f"{name}.out", output.detach().clone()))

        return hook

    def add(self, name: str, t) -> None:
        self.items.append((name, t.detach().clone()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def load_comfy_vae(env, weights: Path, ctor: dict[str, dict[str, Any]], dtype: str):
    """ComfyUI's own `comfy.sd.VAE` for `weights`, built with `ctor` constructor arguments."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(weights))
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    with sized_classes(ctor):
        vae = env.sd.VAE(sd=sd, dtype=torch_dtype)
    model = vae.first_stage_model
    name = type(model).__name__ if model is not None else None
    if name not in ("MiniMaxH3VideoVAE", "MiniMaxH3AudioVAE"):
        raise H3Error(f"ComfyUI built {name} from these weights, not an H3 video/audio VAE", path=weights)
    return vae, ("video" if name == "MiniMaxH3VideoVAE" else "audio")


def _case_plan(model, kind: str, x) -> dict[str, Any]:
    """Tiles / temporal chunks ComfyUI plans for one case (its own methods), for the manifest."""
    if kind == "video_decode":
        r = model.vae_ratio
        plan = {"split_tiles_h": list(model.split_tiles(x.shape[-2] * r)),
                "split_tiles_w": list(model.split_tiles(x.shape[-1] * r)), "temporal": None}
        if x.shape[2] > 1:
            pad, n = model._decode_temporal_chunks(x.shape[2])
            plan["temporal"] = {"pad_tokens": int(pad), "num_chunks": int(n)}
        return {**plan, "tile_size": model.tile_size, "tile_overlap_min": model.tile_overlap_min}
    return {}


def record_op(env, vae, kind: str, cases: dict[str, dict[str, Any]], *, first_call_only: bool
              ) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """Run every case of `kind` through ComfyUI's VAE.decode / VAE.encode; (tensors in order, per-case facts)."""
    import torch

    model = vae.first_stage_model
    op = kind.split("_")[1]
    field = INPUT_FIELD[kind]
    rec = CaseRecorder(model, SITES[kind], first_call_only=first_call_only)
    calls: list[list[int]] = []
    method = CALL_METHOD.get(kind)
    if method:  # an instance attribute shadows the method: ComfyUI's own code still runs, its shapes are noted
        original = getattr(model, method)

        def noting(x, _original=original):
            calls.append(list(x.shape))
            return _original(x)

        setattr(model, method, noting)
    facts: dict[str, Any] = {}
    try:
        with torch.inference_mode():
            for case, fields in cases.items():
                if field not in fields:
                    raise H3Error(f"VAE inputs: case {case!r} of {kind} has no {field!r} tensor")
                x = fields[field]
                rec.start(case)
                calls.clear()
                out = vae.decode(x) if op == "decode" else vae.encode(x)
                rec.add(f"{case}.vae_{op}.out", out)
                info = {field: list(x.shape), ("output" if op == "decode" else "latent"): list(out.shape)}
                if method:
                    info[f"{method.lstrip('_')}_calls"] = [list(c) for c in calls]
                facts[case] = {**info, **_case_plan(model, kind, x)}
    finally:
        rec.close()
        if method:
            delattr(model, method)
    return rec.items, facts


def _vae_attention() -> str:
    import importlib

    fn = importlib.import_module("comfy.ldm.minimax.vae").optimized_attention
    return getattr(fn, "__name__", repr(fn))


def _set_name(config: Path | None) -> str | None:
    if config is None:
        return None
    m = re.fullmatch(r"vae_config_(.+)\.json", config.name)
    return m.group(1) if m else config.stem


def run(args: argparse.Namespace) -> int:
    import json

    from h3direct.traces.format import load_vae_inputs, save_trace
    from oracle.comfy_env import open_comfy
    from oracle.record import file_fields

    weights = Path(args.weights)
    if not weights.is_file():
        raise H3Error("VAE weights not found", path=weights)
    config_path = Path(args.config) if args.config else None
    config: dict = {}
    if config_path is not None:
        try:
            config = json.loads(config_path.read_text())
        except OSError:
            raise H3Error("VAE config not found", path=config_path) from None
        except json.JSONDecodeError as exc:
            raise H3Error(f"VAE config is not JSON ({exc.msg} at line {exc.lineno})", path=config_path) from None
    ctor = constructor_args(config)
    inputs = load_vae_inputs(args.inputs)

    env = open_comfy(args.comfy_root, device=args.device, compute_dtype="fp32", attention="pytorch")
    vae, modality = load_comfy_vae(env, weights, ctor, args.dtype)
    if modality == "audio" and args.dtype != "fp32":
        raise H3Error(f"the audio VAE is fp32 only in ComfyUI (got --dtype {args.dtype})", path=weights)
    ops = [args.op] if args.op else [op for op in OPS if f"{modality}_{op}" in inputs]
    missing = [f"{modality}_{op}" for op in ops if f"{modality}_{op}" not in inputs]
    if not ops or missing:
        raise H3Error(f"no {' / '.join(missing) or modality + '_*'} cases (kinds in the file: {sorted(inputs)})",
                      path=args.inputs)
    if len(ops) > 1 and "{op}" not in args.out:
        raise H3Error(f"--out {args.out}: several ops ({', '.join(ops)}) to write; "
                      "put '{op}' in the name or pass --op")
    first_only = (args.calls or ("first" if args.dtype == "fp16" else "all")) == "first"

    for op in ops:
        kind = f"{modality}_{op}"
        items, facts = record_op(env, vae, kind, inputs[kind], first_call_only=first_only)
        manifest = {
            "comfyui_commit": env.commit,
            "set": _set_name(config_path) or "default",
            "seed": config.get("seed"),
            "kind": kind,
            "compute_dtype": args.dtype,
            "vae_dtype": str(vae.vae_dtype),
            **file_fields("weights", weights),
            **(file_fields("config", config_path) if config_path else {"config": None}),
            **file_fields("inputs", args.inputs),
            "constructor_args": config.get("constructor_args", {}),
            "attention": _vae_attention(),
            "calls_recorded": "first" if first_only else "all",
            "cases": facts,
            "environment": env.describe(),
            "notes": f"<case>.vae_{op}.out = comfy.sd.VAE.{op}(<case>.{INPUT_FIELD[kind]}) as ComfyUI returns it "
            "(channels last). '#k' = k-th call of a module inside the case (tiles row-major inside each temporal "
            "chunk); .in of post_quant_conv / activation_post recorded before the call. Audio runs its stereo "
            "channels as a batch of 2 mono signals.",
        }
        out = save_trace(args.out.replace("{op}", op), items, manifest)
        print(f"wrote {out} ({len(items)} tensors, {kind}, {vae.vae_dtype}, cases {', '.join(facts)})")
    return 0
