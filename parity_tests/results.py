"""What one gate comparison and one gated case are (`LayerResult`, `CaseResult`), and the commands that re-run them.

Every part of the gate appends `LayerResult` rows to a `CaseResult`, tagged with the part that judged them:

- exact: h3direct's exact path against ComfyUI under the exact rules (fp32 rule, ratio rule);
- kernel: an approximate mode's kernel against exact arithmetic on the recorded operands (its contract);
- class: an approximate mode's free-running outputs against ComfyUI's fast mode of the same class (ComfyUI with
  `--use-sage-attention`), both measured against ComfyUI's fp32 twin (the ratio rule);
- quality: what an approximate mode's outputs measure against h3direct's own exact path (reported, and recorded in
  the mode's baseline);
- drift: an approximate mode's measured quality against its own recorded history (`drift.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from h3direct.traces import metrics

PARTS = ("exact", "kernel", "class", "quality", "drift")


@dataclass
class LayerResult:
    name: str
    kind: str
    mode: str
    rel_l2: float  # against the reference of the comparison (ComfyUI's trace, exact attention, the exact path)
    sqnr_db: float
    worst: metrics.MaxAbs
    passed: bool
    rule: str
    budget_provenance: str
    replay: str
    vs_fp32: tuple[float, float] | None = None  # (ours, ComfyUI) error against the fp32 twin
    error: float = math.nan  # what the rule judged, on its own scale (rel-L2), and its limit: the report's plot
    limit: float = math.inf
    part: str = "exact"  # one of PARTS
    info: str = ""  # what else was measured (a kernel's error against exact attention, the fallback it ran)

    def line(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        extra = f" ({self.info})" if self.info else ""
        return (f"{status} {self.mode:7s} {self.name}: rel_l2 {self.rel_l2:.3e}, sqnr {self.sqnr_db:.1f} dB, "
                f"worst {self.worst} [{self.rule}]{extra}")


@dataclass
class CaseResult:
    """All compared tensors of one case (DiT trace, VAE trace or generation), in execution order."""

    case: object
    mode: str
    attention: str
    layers: list[LayerResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    title: str = ""  # default: "<case> [mode, compute, weights, attention]"
    unit: str = "layer"  # what one comparison is called: layer | key | tensor
    action: str = "replay"  # label of the command that re-runs it
    compute: str | None = None  # budget compute key when h3direct ran in another dtype ("bf16@fp32")
    attention_calls: dict | None = None  # backends that count their calls (sol_attn: kernel vs fallback)
    weights: str | None = None  # "fp8_w8a8" when the FP8 block linears ran
    fp8_linear_calls: dict | None = None  # --fp8-linear: calls per GEMM path (scaled_mm / emulated (reason))
    notes: list[str] = field(default_factory=list)  # what was not gated, and why
    approx: str = ""  # the approximate mode's label (attention and its options, + fp8_linear); "" on an exact path
    measured: dict = field(default_factory=dict)  # the approximate mode's quality: drift.py's quantities
    ladder: dict = field(default_factory=dict)  # ladder.py: {"comfy": {output: r}, "rows": [every mode's × r]}
    recording: str = ""  # the recording its trace belongs to (a low-precision trace and its fp32 twin are one)
    judges: str = ""  # what this trace's rows judge (`discovery.recording`)
    drift_request: object = None  # how its drift rows are re-measured (`drift._replay`); None: no approximate run
    # why the case cannot pass though nothing failed: its baseline was created by this run, it was not run, what it
    # compares is missing, or it raised (the report shows this text in place of a failure)
    pending: str = ""

    @property
    def first_failure(self) -> LayerResult | None:
        return next((r for r in self.layers if not r.passed), None)

    @property
    def passed(self) -> bool:
        """Nothing failed, something was compared or a note says what was not gated and why, nothing pending."""
        return self.first_failure is None and bool(self.layers or self.notes) and not self.pending

    def worst(self, part: str) -> LayerResult | None:
        """The comparison of `part` closest to (or furthest past) its limit."""
        rows = [r for r in self.layers if r.part == part and 0 < r.limit < math.inf and not math.isnan(r.error)]
        return max(rows, key=lambda r: r.error / r.limit, default=None)

    def report(self) -> str:
        f = self.first_failure
        c = self.case
        head = self.title or (f"{c.id} [{self.mode}, {getattr(c, 'compute', '?')}, {getattr(c, 'weights', '?')}, "
                              f"{self.attention}]")
        notes = "".join(f"\n  note: {n}" for n in self.notes)
        if f is None and self.pending:
            return f"{head}: {self.pending}{notes}"
        if f is None:
            return f"{head}: {len(self.layers)} {self.unit}s within their rules{notes}"
        return (f"{head}: first failing {self.unit} in execution order: {f.name} ({f.kind}, {f.part})\n"
                f"  {f.line()}\n"
                f"  rule: {f.rule} — {f.budget_provenance}\n"
                f"  worst element: index {list(f.worst.index)}: h3direct {f.worst.got:.8g}, "
                f"reference {f.worst.ref:.8g}\n"
                f"  {self.action}: {f.replay}{notes}")


def run_options(attention, fp8_linear: str = "off"):
    """h3direct's options of a gated run as the runtime types them (`Options`): the attention backend (a name or
    AttentionOptions) and the 8-bit block linears of `models.fp8_spec`'s value."""
    from h3direct.dit.attention import as_options
    from h3direct.dit.options import Options
    from parity_tests.models import fp8_parts

    mode, layers, fmt, rotate = fp8_parts(fp8_linear or "off")
    fp8 = {"fp8_linear": mode, "fp8_linear_format": fmt, "fp8_linear_rotate": rotate}
    return Options.from_flat({**fp8, **({"fp8_linear_layers": layers} if layers else {})},
                             base=Options(as_options(attention)))


@dataclass(frozen=True)
class ReplayContext:
    """What every replay command of a gate run shares: ComfyUI's side as the run was given it (its checkout, the
    Python of its own environment) and, where the run's recordings do not outlive it, why no row can be re-run."""

    comfy_root: str | None = None
    comfy_python: str | None = None
    unreplayable: str = ""


def replay_request(trace: Path, context: ReplayContext | None = None, **fields):
    """The `oracle.request.ReplayRequest` of a case's trace under the run's `context`. Without the Python of
    ComfyUI's environment, the Python that recorded the trace (its manifest's `environment.python`) where it is on
    this machine, so that the printed command runs ComfyUI where it runs."""
    from oracle.request import ReplayRequest

    context = context or ReplayContext()
    python = context.comfy_python
    if context.comfy_root and not python:
        python = recorded_python(Path(trace))
    return ReplayRequest(Path(trace), comfy_root=context.comfy_root, comfy_python=python,
                         unreplayable=context.unreplayable, **fields)


def recorded_python(trace: Path) -> str | None:
    """The Python a trace was recorded with (`environment.python`), where it is on this machine and not this one."""
    import json
    import os
    import sys

    try:
        python = json.loads(trace.with_suffix(".json").read_text()).get("environment", {}).get("python")
    except (OSError, ValueError, AttributeError):
        return None
    if not python or not os.access(python, os.X_OK) or os.path.abspath(python) == os.path.abspath(sys.executable):
        return None
    return python


def command(request, layer: str, b=None, limit: float = math.inf) -> str:
    """The command that re-runs one row: `request` (an `oracle.request.ReplayRequest`, the case's) at `layer` with
    the rule of entry `b` at `limit`; a row that cannot be replayed says why in its place (`request.unreplayable`)."""
    if request.unreplayable:
        return f"not replayable: {request.unreplayable}"
    return request.at(layer, rule_of(b, limit) if b is not None else None).command()


def rule_of(b, limit: float):
    """The replay's rule for budget entry `b` applied at `limit` (`oracle.request.Rule`): fp32 and rounding rules and
    a contract's rel-L2 as `--budget`, the ratio rule (and a contract held k times a reference implementation's
    error) as `--ratio K --floor F`, a contract's cosine as `--cosine`, the drift rule as `--drift K --floor F`."""
    from oracle.request import Rule

    if b.rule == "ratio" or (b.rule == "contract" and b.k is not None):
        return Rule(ratio=b.k, floor=b.floor)
    if b.rule == "drift":
        return Rule(drift=b.k, floor=b.floor)
    if b.rule == "fp32":
        return Rule(budget=b.floor)
    if b.rule == "contract" and b.cosine is not None:
        return Rule(cosine=b.cosine)
    if math.isfinite(limit) and limit > 0:
        return Rule(budget=limit)
    return Rule()


def attention_key(backend) -> str:
    """The budgets key of an attention backend (a name or AttentionOptions): "exact" for every exact one, else the
    name of the approximate backend that computes its calls (kj_head_sliced: its inner backend)."""
    from h3direct.dit.attention import as_options, is_exact, slice_backend

    opts = as_options(backend)
    if is_exact(opts):
        return "exact"
    return slice_backend(opts) if opts.backend == "kj_head_sliced" else opts.backend
