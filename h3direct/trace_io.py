"""Writing traces in the oracle layout: float tensors as float32 (float64 kept), a JSON manifest beside
the .safetensors with per-tensor shape / produced dtype / stats, and bit-identical duplicates stored once
(`aliases`: dropped name -> stored name). See oracle/FORMAT.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TRACE_FORMAT = "h3-trace/1"


def _stats(t: torch.Tensor) -> dict:
    f = t.double()
    return {"mean": float(f.mean()) if f.numel() else 0.0, "std": float(f.std()) if f.numel() > 1 else 0.0,
            "absmax": float(f.abs().max()) if f.numel() else 0.0}


def write_trace(path: str | Path, tensors: dict[str, torch.Tensor], dtypes: dict[str, str], manifest: dict) -> dict:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_content: dict[tuple, list[str]] = {}
    info = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if t.is_floating_point() and t.dtype != torch.float64:
            t = t.float()
        t = t.contiguous()
        info[name] = {"shape": list(t.shape), "dtype": dtypes.get(name, str(t.dtype).replace("torch.", "")),
                      **(_stats(t) if t.is_floating_point() else {})}
        key = (tuple(t.shape), t.dtype)
        for other in by_content.get(key, []):
            if torch.equal(stored[other], t):
                aliases[name] = other
                break
        else:
            stored[name] = t
            by_content.setdefault(key, []).append(name)
    manifest = {"trace_format": TRACE_FORMAT, **manifest, "tensors": info, "aliases": aliases,
                "order": list(tensors)}
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(stored, str(tmp))
    os.replace(tmp, path)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(manifest, indent=1))
    return {"trace": str(path), "manifest": str(json_path), "tensors": len(info), "stored": len(stored)}
