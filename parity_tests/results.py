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
import shlex
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


@dataclass(frozen=True)
class Replay:
    """How `python -m oracle replay` re-runs a comparison as the gate ran it: the trace, the mode (teacher: the one
    layer from its recorded inputs; free: the whole step from the inputs file, every recorded tensor up to the layer),
    h3direct's options (attention and its options, the 8-bit linears, its dtype where it differs from the trace's),
    the device, and the recordings the ratio rule reads (`twin`: ComfyUI's other recording of the case, its fp32 twin
    or its low-precision trace; `against`: the recording whose own error scales the limit, ComfyUI+sage for the class
    rule)."""

    trace: Path
    comfy_root: str | None = None
    mode: str = "teacher"
    attention: object = None  # a backend's name or AttentionOptions; None: sdpa
    device: str = "cpu"
    compute: str | None = None  # h3direct's dtype where it differs from the trace's (budget key "bf16@fp32")
    fp8_linear: str = "off"  # `models.fp8_spec`'s value
    twin: Path | None = None
    against: Path | None = None

    def command(self, layer: str, b=None, limit: float = math.inf) -> str:
        """The command for `layer` (a recorded tensor name), with the rule of entry `b` at `limit` when given."""
        q = shlex.quote
        cmd = f"python -m oracle replay --trace {q(str(self.trace))} --layer {q(layer)}"
        cmd += f" --comfy-root {q(self.comfy_root)}" if self.comfy_root else ""
        cmd += " --direct" + (f" --mode {self.mode}" if self.mode != "teacher" else "")
        cmd += attention_flags(self.attention) if self.attention is not None else ""
        cmd += f" --compute-dtype {self.compute}" if self.compute else ""
        cmd += fp8_flags(self.fp8_linear)
        cmd += f" --device {self.device}" if self.device != "cpu" else ""
        cmd += f" --twin {q(str(self.twin))}" if self.twin is not None and b is not None and b.rule == "ratio" else ""
        cmd += f" --against {q(str(self.against))}" if self.against is not None else ""
        return cmd + (rule_flags(b, limit) if b is not None else "")


def rule_flags(b, limit: float) -> str:
    """`oracle replay`'s flags for the rule an entry applied (`--ratio K --floor F` or `--budget REL`)."""
    if b.rule == "ratio":
        return f" --ratio {b.k:g} --floor {b.floor:g}"
    if b.rule == "fp32":
        return f" --budget {b.floor:g}"
    if math.isfinite(limit) and limit > 0:
        return f" --budget {limit:.3g}"
    return ""


def fp8_flags(spec: str) -> str:
    """`oracle replay`'s flags for the gate's 8-bit linears (`models.fp8_spec`'s value; "off": none)."""
    from parity_tests.models import fp8_parts

    if spec == "off":
        return ""
    mode, layers, fmt, rotate = fp8_parts(spec)
    return (f" --fp8-linear {mode}" + (f" --fp8-linear-layers {layers}" if layers else "")
            + (f" --fp8-linear-format {fmt}" if fmt != "e4m3" else "")
            + (f" --fp8-linear-rotate {rotate}" if rotate != "none" else ""))


def attention_flags(attention) -> str:
    """` --attention NAME` and ` --option NAME=VALUE` for each of its options off its default (sdpa: none)."""
    from h3direct.dit.attention import as_options
    from h3direct.dit.options import assignments, changed_options

    opts = as_options(attention)
    flags = f" --attention {opts.backend}" if opts.backend != "sdpa" else ""
    return flags + "".join(f" --option {a}" for a in assignments(changed_options(opts)))


def attention_key(backend) -> str:
    """The budgets key of an attention backend (a name or AttentionOptions): "exact" for every exact one, else the
    name of the approximate backend that computes its calls (kj_head_sliced: its inner backend)."""
    from h3direct.dit.attention import as_options, is_exact, slice_backend

    opts = as_options(backend)
    if is_exact(opts):
        return "exact"
    return slice_backend(opts) if opts.backend == "kj_head_sliced" else opts.backend
