"""ComfyUI's answers committed as fixtures (fixtures/comfy/<name>.npz), so CI checks the claims without ComfyUI.

A `comfy` test (live, needs H3_COMFY_ROOT) computes ComfyUI's answer and hands it, with the inputs it consumed, to
`record`: pytest-regressions' `ndarrays_regression` then checks it against the committed file bit for bit, or rewrites
it under `--force-regen` (fixtures/regenerate.sh). Only ComfyUI's side is ever written there. Its CI twin loads the
file with `load` and compares h3direct's answer on the same inputs, exactly as the live test does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures" / "comfy"


def record(ndarrays_regression, name: str, arrays: dict, rounding: dict[str, float] | None = None) -> None:
    """Bit for bit, except the keys of `rounding` (key -> a rel-L2 budget from budgets.toml): outputs of a float
    computation whose summation order depends on the thread count, held to that budget x their largest magnitude."""
    data = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in arrays.items()}
    tolerances = {k: dict(atol=float(rel * np.abs(data[k]).max()), rtol=0.0) for k, rel in (rounding or {}).items()}
    ndarrays_regression.check(data, fullpath=GOLDENS / f"{name}.npz", tolerances=tolerances,
                              default_tolerance=dict(atol=0.0, rtol=0.0))


def load(name: str) -> dict[str, torch.Tensor]:
    path = GOLDENS / f"{name}.npz"
    assert path.is_file(), f"{path}: ComfyUI golden missing (regenerate with fixtures/regenerate.sh)"
    with np.load(path) as z:
        return {k: torch.from_numpy(z[k].copy()) for k in z.files}
