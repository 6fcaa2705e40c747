"""Read and write per-layer traces and self-describing inputs files (see oracle/FORMAT.md).

A trace is `<stem>.safetensors` (the tensors) plus `<stem>.json` (the manifest). Bit-identical tensors are stored
once; the manifest's `aliases` maps each dropped name to the stored one. `load_trace` resolves aliases, so every
recorded name is readable with `trace.get(name)`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3direct.errors import H3Error

TRACE_FORMAT = "h3-trace/1"
STATS_REL = 1e-5  # how far a legacy manifest's float stats may sit from ours (float32 vs float64 summation)



def manifest_path(path: str | Path) -> Path:
    """The JSON manifest beside a trace: same stem, `.json`."""
    return Path(path).with_suffix(".json")


def format_version(manifest: Mapping[str, Any]) -> int:
    """0 for the shared files (no `trace_format` field), N for `h3-trace/N`."""
    tag = manifest.get("trace_format")
    if tag is None:
        return 0
    prefix = "h3-trace/"
    if not isinstance(tag, str) or not tag.startswith(prefix) or not tag[len(prefix) :].isdigit():
        raise H3Error(f"manifest field trace_format={tag!r} is not 'h3-trace/N'")
    return int(tag[len(prefix) :])


@dataclass
class Trace:
    """One recorded trace: tensors (aliases resolved, float data as stored) and its manifest."""

    path: Path
    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]
    stored: tuple[str, ...] = ()  # names physically present in the .safetensors, file order

    @property
    def version(self) -> int:
        return format_version(self.manifest)

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.manifest.get("aliases") or {})

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            close = [n for n in self.tensors if name.split(".")[0] in n][:5]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise H3Error(f"no tensor named {name!r} in this trace{hint}", path=self.path) from None

    def produced_dtype(self, name: str) -> str | None:
        """The dtype the recorded program produced (floats are stored widened to float32)."""
        info = (self.manifest.get("tensors") or {}).get(self.aliases.get(name, name))
        extra = (self.manifest.get("alias_dtypes") or {}).get(name)
        return extra or (info or {}).get("dtype")

    def names_in_order(self) -> list[str]:
        """Every name (aliases included) in execution order.

        Version >= 1 manifests record `order`. Version 0 manifests list stored tensors in execution order under
        `tensors`; an alias is placed right after the tensor it points to (the best available approximation).
        Without any manifest order the file order is used.
        """
        order = self.manifest.get("order")
        if order:
            return [n for n in order if n in self.tensors]
        listed = list((self.manifest.get("tensors") or {}).keys()) or list(self.stored)
        by_target: dict[str, list[str]] = {}
        for alias, target in self.aliases.items():
            by_target.setdefault(target, []).append(alias)
        out: list[str] = []
        for name in listed:
            out.append(name)
            out.extend(by_target.get(name, []))
        seen = set(out)
        out.extend(n for n in self.tensors if n not in seen)
        return out


def load_trace(path: str | Path) -> Trace:
    """Load `<stem>.safetensors` and its `<stem>.json` manifest (manifest optional: then `{}`)."""
    path = Path(path)
    if path.suffix == ".json":
        path = path.with_suffix(".safetensors")
    if not path.is_file():
        raise H3Error("trace file not found (expected a .safetensors written by `oracle record`)", path=path)
    mpath = manifest_path(path)
    manifest: dict[str, Any] = {}
    if mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as exc:
            raise H3Error(f"manifest is not valid JSON ({exc.msg} at line {exc.lineno})", path=mpath) from None
    format_version(manifest)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), "pt") as f:
            stored = tuple(f.keys())
            for name in stored:
                tensors[name] = f.get_tensor(name)
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise H3Error(f"cannot read safetensors ({exc})", path=path) from None
    for alias, target in (manifest.get("aliases") or {}).items():
        if target not in tensors:
            raise H3Error(f"manifest alias {alias!r} -> {target!r}: target not stored", path=mpath)
        tensors[alias] = tensors[target]
    return Trace(path=path, tensors=tensors, manifest=manifest, stored=stored)


def tensor_stats(t: torch.Tensor) -> dict[str, float]:
    """mean / std / absmax as in the shared manifests (computed in float64)."""
    x = t.detach().to(torch.float64)
    if x.numel() == 0:
        return {"mean": 0.0, "std": 0.0, "absmax": 0.0}
    std = float(x.std()) if x.numel() > 1 else 0.0
    out = {"mean": float(x.mean()), "std": std, "absmax": float(x.abs().max())}
    return {k: (v if math.isfinite(v) else str(v)) for k, v in out.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storage_form(t: torch.Tensor) -> torch.Tensor:
    """Floats narrower than 32 bit are widened to float32 (exact); float64 and integer tensors are kept."""
    t = t.detach().to("cpu")
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)
    return t.contiguous()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored in the trace file (C order, storage dtype)."""
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.numel() else t
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def verify_trace(trace: Trace) -> list[str]:
    """Why the trace's tensors do not match its manifest (empty when they do).

    Manifests written by `save_trace` carry a sha256 per stored tensor: every stored tensor must be listed and match
    it, and every listed tensor must be stored. Older manifests (../shared/oracle) carry per-tensor mean / std /
    absmax only, computed by another program in another summation order: those must match to STATS_REL (relative to the
    value, or to the tensor's std for a mean near 0); any real edit of a tensor moves them far more.
    """
    problems: list[str] = []
    info = trace.manifest.get("tensors") or {}
    stored = set(trace.stored)
    if not info:
        return ["manifest lists no tensors (no digests to check)"]
    for name in sorted(set(info) - stored):
        if name not in trace.aliases:
            problems.append(f"{name}: listed in the manifest, not stored")
    for name in trace.stored:
        meta = info.get(name)
        if meta is None:
            problems.append(f"{name}: stored, not listed in the manifest")
            continue
        t = trace.tensors[name]
        if list(t.shape) != list(meta.get("shape", t.shape)):
            problems.append(f"{name}: shape {list(t.shape)} != manifest {meta.get('shape')}")
        elif "sha256" in meta:
            if tensor_sha256(t) != meta["sha256"]:
                problems.append(f"{name}: sha256 differs from the manifest")
        else:  # a manifest without digests (../shared/oracle, older h3-trace/1 files): its float stats
            stats = tensor_stats(t)
            scale = max(abs(float(meta.get("std") or 0.0)), abs(float(meta.get("absmax") or 0.0)) * 1e-3, 1e-30)
            for k in ("mean", "std", "absmax"):
                want, got = meta.get(k), stats[k]
                if isinstance(want, int | float) and isinstance(got, int | float) and \
                        abs(got - want) > STATS_REL * max(abs(want), scale):
                    problems.append(f"{name}: {k} {got!r} != manifest {want!r}")
                    break
    return problems


def _digest(t: torch.Tensor) -> tuple:
    raw = t.view(torch.uint8) if t.numel() else t
    return (str(t.dtype), tuple(t.shape), hashlib.sha1(raw.numpy().tobytes()).hexdigest())


def save_trace(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    manifest: Mapping[str, Any] | None = None,
    *,
    dedupe: bool = True,
) -> Path:
    """Write `<stem>.safetensors` + `<stem>.json`; `tensors` in execution order (kept as the manifest's `order`).

    Float tensors are stored as float32 (the manifest keeps the produced dtype); bit-identical tensors of the same
    produced dtype are stored once and listed under `aliases` (dropped name -> stored name).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise H3Error("trace output must end in .safetensors", path=path)
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise H3Error(f"duplicate tensor names in trace: {dup[:5]}", path=path)
    stored: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise H3Error(f"trace entry {name!r} is {type(t).__name__}, not a tensor", path=path)
        s = _storage_form(t)
        key = (_dtype_name(t.dtype), *_digest(s))
        if dedupe and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = s
        info[name] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), **tensor_stats(t),
                      "sha256": tensor_sha256(s)}
    out_manifest = dict(manifest or {})
    out_manifest["trace_format"] = TRACE_FORMAT
    out_manifest["order"] = names
    out_manifest["tensors"] = info
    out_manifest["aliases"] = aliases
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(path))
    manifest_path(path).write_text(json.dumps(out_manifest, indent=1, default=_json_default) + "\n")
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return _dtype_name(obj)
    if isinstance(obj, torch.Size | tuple):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return {"tensor": list(obj.shape), "dtype": _dtype_name(obj.dtype)}
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")




def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise H3Error("file not found", path=path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception as exc:
        raise H3Error(f"cannot read safetensors ({exc})", path=path) from None


def load_vae_inputs(path: str | Path) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """`vae_inputs_*.safetensors` -> {kind: {case: {field: tensor}}} from names `<kind>.<case>.<field>`."""
    path = Path(path)
    tensors, _ = _read_safetensors(path)
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 3:
            raise H3Error(f"tensor {name!r} is not named <kind>.<case>.<field>", path=path)
        kind, case, fld = parts
        out.setdefault(kind, {}).setdefault(case, {})[fld] = t
    return out
