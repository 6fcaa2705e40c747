"""Test helper: pull named top-level definitions out of ComfyUI source files as an oracle.

Importing ComfyUI whole needs its GPU-side dependencies; the H3 facts we test against live in
small pure-torch functions, so we compile just those (by name, via `ast`) into a namespace.
Nothing here is ComfyUI code: it reads the run's ComfyUI checkout (the `comfy_root` fixture) at test time.
"""

from __future__ import annotations

import ast
import math
import types
from pathlib import Path

import numpy as np
import torch


def load(root: str, relpath: str, names, **extra) -> types.SimpleNamespace:
    src = (Path(root) / relpath).read_text()
    tree = ast.parse(src)
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign)) and
            (getattr(n, "name", None) in names or
             (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets)))]
    found = {getattr(n, "name", None) or n.targets[0].id for n in keep}
    missing = set(names) - found
    assert not missing, f"{relpath}: {missing} not found"
    ns = {"torch": torch, "math": math, "np": np, "__name__": "comfy_oracle"}
    ns.update(extra)
    exec(compile(ast.Module(body=keep, type_ignores=[]), relpath, "exec"), ns)
    return types.SimpleNamespace(**{k: ns[k] for k in names})
