"""What an approximate mode's free-running step measures of its own quality, against ComfyUI's recordings and
h3direct's exact path: the quantities the gate records in a mode's baseline and holds to the drift rule
(`parity_tests/drift.py`), and that `oracle replay --mode drift` re-measures for one row.

- `out.<x0>`: the step's x0 (`X0`) against ComfyUI's fp32 recording of the case; its rounding scale is ComfyUI's
  own low-precision error there (where the mode runs in low precision too), one low-precision path;
- `x0.<stream>`: the step's `sample_out` against h3direct's exact path on the same device and dtype (the exact
  backend: `exact_backend`); two low-precision paths, the same scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h3direct.traces import metrics

X0 = ("sampler.denoised.video", "sampler.denoised.audio")  # the step's x0: the ladder's columns
STREAMS = ("video", "audio")
EXACT_REFERENCE = "sdpa"  # the exact backend that runs what an approximate attention does not compute


@dataclass(frozen=True)
class Quantity:
    err: float  # rel-L2 of the mode against the quantity's reference
    scale: float  # r: the reference's own low-precision rounding scale (0: none known; the rule's floor applies)
    paths: int  # low-precision paths in the comparison: 1 against an fp32 reference, 2 against the exact path


def exact_backend(attention):
    """The exact backend of a run with `attention` (a name or AttentionOptions): itself when exact, else
    EXACT_REFERENCE."""
    from h3direct.dit.attention import is_exact

    return attention if is_exact(attention) else EXACT_REFERENCE


def _err(t, name: str, ref: torch.Tensor) -> float:
    """rel-L2 of recording `t`'s tensor `name` against `ref` (nan where it lacks it or its shape differs)."""
    if t is None or name not in t or tuple(t.get(name).shape) != tuple(ref.shape):
        return math.nan
    return metrics.rel_l2(t.get(name), ref)


def quantities(ours: dict, exact: dict, fp32, low, low_run: bool) -> dict[str, Quantity]:
    """The mode's quantities from its traced step `ours` and the exact path's `exact` ({name: tensor}), ComfyUI's fp32
    and low-precision recordings of the case (`fp32`, `low`: traces or None) and whether the mode ran in low
    precision (`low_run`: ComfyUI's own error is then the rounding scale). `out.*` needs both recordings."""
    out: dict[str, Quantity] = {}
    usable = fp32 is not None and low is not None

    def scale(name: str) -> float:
        if not (low_run and usable and name in fp32):
            return 0.0
        r = _err(low, name, fp32.get(name))
        return 0.0 if math.isnan(r) else r

    for name in X0:
        if usable and name in fp32 and name in ours and tuple(ours[name].shape) == tuple(fp32.get(name).shape):
            out[f"out.{name}"] = Quantity(metrics.rel_l2(ours[name].float().cpu(), fp32.get(name)), scale(name), 1)
    for stream in STREAMS:
        name = f"sample_out.{stream}"
        out[f"x0.{stream}"] = Quantity(metrics.rel_l2(ours[name].float().cpu(), exact[name].float().cpu()),
                                       scale(name), 2)
    return out
