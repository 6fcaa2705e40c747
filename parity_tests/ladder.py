"""How far an approximate mode's outputs are from fp32, next to ComfyUI's own: the ladder and the class rule.

Every free-running approximate mode is measured where ComfyUI measured itself: its error against ComfyUI's fp32
trace of the case (the twin), tensor by tensor, in units of ComfyUI's own low-precision error there (`× ComfyUI
bf16`). ComfyUI's fast mode of the same class (`--use-sage-attention`, recorded beside the case by `oracle record
--sage-twin`) is measured the same way, and a backend of that class (budgets.toml, mode "class") is held to the ratio
rule against it at every output; every other tensor is reported. The ladder of a case puts the rows side by side:
ComfyUI bf16 (1 by definition), ComfyUI+sage, h3direct's exact path, the mode of this run, and every mode whose
baseline lies beside the case (`drift.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h3direct.traces import metrics
from h3direct.traces.format import Trace
from h3direct.traces.quality import X0
from parity_tests.budgets import Measured, verdict
from parity_tests.discovery import DitCase, low_case
from parity_tests.models import trace
from parity_tests.results import LayerResult, command

OUTPUTS = ("dit_inner.out.", "dit_forward.out.", "sampler.denoised.", "sample_out.")  # what the class rule gates
LADDER = X0  # the columns of the ladder: the step's x0


@dataclass(frozen=True)
class References:
    """ComfyUI's recordings of one case: fp32 (the reference), its own low-precision run and its fast mode."""

    fp32: Trace | None
    low: Trace | None
    low_dtype: str | None
    sage: Trace | None

    @property
    def usable(self) -> bool:
        return self.fp32 is not None and self.low is not None


@dataclass(frozen=True)
class Point:
    err: float  # rel-L2 against ComfyUI's fp32 trace
    comfy: float  # ComfyUI's low-precision run against the same (nan without it)
    sage: float  # ComfyUI+sage against the same (nan without it)

    @property
    def x(self) -> float:
        """× ComfyUI's own low-precision error."""
        return self.err / self.comfy if self.comfy > 0 else math.nan


def references(case: DitCase) -> References:
    low = low_case(case)
    fp32 = case.trace if case.compute == "fp32" else case.twin_fp32
    return References(trace(str(fp32)) if fp32 else None, trace(str(low.trace)) if low else None,
                      low.compute if low else None,
                      trace(str(low.sage_twin)) if low is not None and low.sage_twin else None)


def _rel(t: Trace | None, name: str, ref: torch.Tensor) -> float:
    if t is None or name not in t or tuple(t.get(name).shape) != tuple(ref.shape):
        return math.nan
    return metrics.rel_l2(t.get(name), ref)


def measure(tensors: dict[str, torch.Tensor], refs: References) -> dict[str, Point]:
    """Every tensor of a run that ComfyUI's fp32 trace recorded, in its order: the run's error, ComfyUI's own and
    ComfyUI+sage's, all against that trace."""
    out = {}
    if refs.fp32 is None:
        return out
    for name in refs.fp32.names_in_order():
        if name not in tensors or name.startswith("sampler.x_in."):
            continue
        ref = refs.fp32.get(name)
        ours = tensors[name].detach().float().cpu()
        if tuple(ours.shape) != tuple(ref.shape):
            continue
        out[name] = Point(metrics.rel_l2(ours, ref), _rel(refs.low, name, ref), _rel(refs.sage, name, ref))
    return out


def class_rows(gate, points: dict[str, Point], ours: dict[str, torch.Tensor], budget, request) -> None:
    """Part "class": each output held to the ratio rule against ComfyUI+sage (both against the fp32 twin); every
    other tensor reported with its ratio. `request`: how `oracle replay` re-runs the mode's free step (a
    ReplayRequest)."""
    for name, p in points.items():
        if math.isnan(p.sage):
            continue
        a, ref = ours[name].detach().float().cpu(), gate.refs.fp32.get(name)
        if name.startswith(OUTPUTS):
            v = verdict(budget, Measured(p.err, twin=(p.err, p.sage)))
            passed, text, error, limit = v.passed, f"{v.text} (ComfyUI+sage)", v.error, v.limit
        else:
            passed, text, error, limit = True, "reported (the class rule gates the outputs)", p.err, math.inf
        gate.result.layers.append(LayerResult(
            name, "output" if name.startswith(OUTPUTS) else "*", "free", p.err, metrics.sqnr_db(a, ref),
            metrics.max_abs(a, ref), passed, text, budget.provenance,
            command(request, name, budget if name.startswith(OUTPUTS) else None, limit),
            (p.err, p.sage), error, limit, "class",
            _times(p.err, p.sage, "ComfyUI+sage") + _times(p.err, p.comfy, f"ComfyUI {gate.refs.low_dtype}", ", ")))


def _times(err: float, ref: float, what: str, sep: str = "") -> str:
    if math.isnan(ref):
        return ""
    return f"{sep}×{err / ref:.2f} {what}" if ref > 0 else f"{sep}{what} exact here"


def row(mode: str, points: dict[str, Point], key: str = "err", **extra) -> dict:
    """One ladder row: {mode, x: {output: × ComfyUI's own error}} (+ margins)."""
    x = {}
    for name in LADDER:
        p = points.get(name)
        if p is not None and p.comfy > 0:
            x[name] = getattr(p, key) / p.comfy
    return {"mode": mode, "x": x, **extra}


def reference_rows(points: dict[str, Point], low_dtype: str | None) -> list[dict]:
    rows = [row(f"ComfyUI {low_dtype or 'bf16'}", points, "comfy")]
    if any(not math.isnan(p.sage) for p in points.values()):
        rows.append(row("ComfyUI --use-sage-attention", points, "sage"))
    return rows
