"""One replay request: which recorded comparison `python -m oracle replay` re-runs, with what, and by which rule.

The gate builds a `ReplayRequest` for every row it compares (`parity_tests.results.command`) and prints it as a
command (`command()`); `oracle replay` parses the same flags back into one (`from_args`) and runs it: one request
type, one set of flags (`add_arguments`), whoever makes it.

Modes (what one row compared, re-run the same way):

- `teacher`: one layer of h3direct fed its recorded inputs (a teacher-forced row; `h3direct.traces.replay`'s site);
- `free`: the whole denoiser evaluation from the trace's inputs file (`h3direct.traces.evaluate.traced_step`), the
  named tensor compared (a free-running row, a class row), and where the drift starts;
- `kernel`: an approximate kernel at one site on the recorded operands, against exact arithmetic or the reference
  implementation its contract names (`--reference`; `h3direct.traces.kernels`);
- `drift`: a quantity an approximate mode measured against its recorded baseline (`--baseline`; the drift rule).

VAE and generation traces re-run their recorded operation whole (`oracle.replay_ops`).

The rule is the one the gate applied to the row, spelled as flags: `--budget REL` (rel-L2 at most REL; the fp32 rule,
a rounding bound, a contract's rel-L2), `--ratio K --floor F` (the ratio rule: the error against the fp32 reference
at most K times the reference error plus F; in kernel mode the reference implementation's error, FlashAttention's FP8
test rule), `--cosine C` (a contract's cosine), `--drift K --floor F` (the drift rule against `--baseline`).
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from h3direct.dit.options import DEFAULT_OPTIONS, FP8_LINEAR_FORMATS, FP8_LINEAR_MODES, KernelOptions, Options
from h3direct.traces.metrics import drift_limit, ratio_limit

MODES = ("teacher", "free", "kernel", "drift")
COMFY_MODES = ("teacher", "free")  # the modes with a ComfyUI side; a kernel or drift row is h3direct's alone
REFERENCES = ("exact", "emulation", "algorithm")  # what a kernel row measures the kernel against
FP8_FLAGS = ("fp8_linear", "fp8_linear_layers", "fp8_linear_format", "fp8_linear_rotate")  # KernelOptions fields


@dataclass(frozen=True)
class Figures:
    """What one re-run measured, on each scale a rule reads: rel-L2 against the recording (or the kernel's
    reference), bitwise equality, (ours, the reference's) error against the fp32 reference, the cosine, and the
    drift rule's recorded baseline, rounding scale and low-precision paths."""

    rel: float
    identical: bool = False
    errs: tuple[float, float] | None = None
    cos: float | None = None
    baseline: float | None = None
    scale: float = 0.0
    paths: int = 1


@dataclass(frozen=True)
class Verdict:
    passed: bool | None  # None: no rule given
    error: float  # what the rule judged (the gate's figure of the row)
    limit: float
    text: str


@dataclass(frozen=True)
class Rule:
    budget: float | None = None
    ratio: float | None = None
    floor: float = 0.0
    cosine: float | None = None
    drift: float | None = None

    @property
    def given(self) -> bool:
        return any(x is not None for x in (self.budget, self.ratio, self.cosine, self.drift))

    def flags(self) -> list[str]:
        out = []  # each number as Python writes it back exactly (a rounded limit could flip a verdict)
        if self.budget is not None:
            out += ["--budget", repr(float(self.budget))]
        if self.cosine is not None:
            out += ["--cosine", repr(float(self.cosine))]
        if self.ratio is not None:
            out += ["--ratio", repr(float(self.ratio)), "--floor", repr(float(self.floor))]
        if self.drift is not None:
            out += ["--drift", repr(float(self.drift)), "--floor", repr(float(self.floor))]
        return out

    def describe(self) -> str:
        if self.drift is not None:
            return f"drift rule: err ≤ sqrt(baseline² + n·({self.drift:g}·r)²), r ≥ {self.floor:g}"
        if self.ratio is not None:
            return f"err vs fp32 ≤ {self.ratio:g}×the reference's + {self.floor:g}"
        if self.cosine is not None:
            return f"cosine ≥ {self.cosine:g}"
        if self.budget is not None:
            return f"rel_l2 ≤ {self.budget:g}"
        return "no rule given"

    def judge(self, m: Figures) -> Verdict:
        """As the gate's `budgets.verdict` judges the same figures (bitwise equal passes the budget and the cosine, as
        the fp32 and rounding rules pass it); a rule that needs a figure not measured fails, saying so."""
        if self.drift is not None:
            if m.baseline is None:
                return Verdict(False, m.rel, 0.0, "the drift rule needs the baseline (--baseline)")
            limit = drift_limit(m.baseline, m.scale, m.paths, self.drift, self.floor)
            return self._out(m.rel, limit, m.rel <= limit, f"baseline {m.baseline:.4e}, r {m.scale:.3e}, "
                                                           f"n {m.paths}")
        if self.ratio is not None:
            if m.errs is None:
                return Verdict(False, m.rel, 0.0, "the ratio rule needs the fp32 reference (--twin)")
            ours, ref = m.errs
            limit = ratio_limit(self.ratio, ref, self.floor)
            return self._out(ours, limit, ours <= limit, f"the reference's {ref:.3e}")
        if self.cosine is not None:
            cos = m.cos if m.cos is not None else math.nan
            return self._out(m.rel, math.sqrt(2.0 * (1.0 - self.cosine)), m.identical or cos >= self.cosine,
                             f"cosine {cos:.6f}")
        if self.budget is not None:
            return self._out(m.rel, self.budget, m.identical or m.rel <= self.budget, "")
        if m.identical:
            return Verdict(True, m.rel, math.inf, "bitwise equal")
        return Verdict(None, m.rel, math.inf, "no rule given")

    def _out(self, error: float, limit: float, ok: bool, extra: str) -> Verdict:
        sign = "≤" if ok else ">"
        return Verdict(ok, error, limit, f"error {error:.4e} {sign} limit {limit:.4e}: {self.describe()}"
                                         + (f"; {extra}" if extra else ""))


@dataclass(frozen=True)
class ReplayRequest:
    """One comparison of the gate, re-run as the gate ran it (module docstring)."""

    trace: Path
    layer: str = ""
    mode: str = "teacher"
    options: Options = DEFAULT_OPTIONS  # h3direct's attention and its options, its 8-bit block linears
    compute: str | None = None  # h3direct's dtype where it is not the trace's
    device: str = "cpu"
    twin: Path | None = None  # ComfyUI's other recording of the case (its fp32 twin, or its low-precision trace)
    against: Path | None = None  # the recording whose own error scales the ratio rule (ComfyUI+sage)
    reference: str = "exact"  # kernel mode
    baseline: Path | None = None  # drift mode
    rule: Rule = field(default_factory=Rule)
    comfy_root: str | None = None
    comfy_python: str | None = None
    checkpoint: str | None = None
    direct: bool = True
    no_comfy: bool = False
    # why the row this request is for cannot be re-run (its recordings are not kept, say): then no command is printed
    unreplayable: str = ""

    def at(self, layer: str, rule: Rule | None = None, **changes) -> ReplayRequest:
        return replace(self, layer=layer, rule=rule or Rule(), **changes)

    def argv(self) -> list[str]:
        from h3direct.dit.options import assignments, changed_options

        a = ["--trace", str(self.trace), "--layer", self.layer]
        if self.mode in COMFY_MODES:
            a += ["--comfy-root", self.comfy_root] if self.comfy_root else []
            a += ["--comfy-python", self.comfy_python] if self.comfy_python else []
        a += ["--checkpoint", self.checkpoint] if self.checkpoint else []
        a += ["--direct"] if self.direct else []
        a += ["--no-comfy"] if self.no_comfy else []
        a += ["--mode", self.mode] if self.mode != "teacher" else []
        attention = self.options.attention
        a += ["--attention", attention.backend] if attention.backend != DEFAULT_OPTIONS.attention.backend else []
        for item in assignments(changed_options(attention)):
            a += ["--option", item]
        defaults = KernelOptions()
        if self.options.kernels.fp8_linear != "off":
            for name in FP8_FLAGS:
                value = getattr(self.options.kernels, name)
                if name == "fp8_linear" or value != getattr(defaults, name):
                    a += ["--" + name.replace("_", "-"), str(value)]
        a += ["--compute-dtype", self.compute] if self.compute else []
        a += ["--device", self.device] if self.device != "cpu" else []
        a += ["--twin", str(self.twin)] if self.twin is not None else []
        a += ["--against", str(self.against)] if self.against is not None else []
        a += ["--reference", self.reference] if self.mode == "kernel" and self.reference != "exact" else []
        a += ["--baseline", str(self.baseline)] if self.baseline is not None else []
        return a + self.rule.flags()

    def command(self) -> str:
        return "python -m oracle replay " + shlex.join(self.argv())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayRequest:
        """The request `add_arguments`' flags spell; a bad option or option set is one line (H3Error)."""
        from h3direct.dit.options import check_in_effect, fp8_flags_problem, parse_assignments
        from h3direct.errors import H3Error

        given = parse_assignments(args.option, only="attention")
        fp8 = {"fp8_linear": args.fp8_linear, "fp8_linear_format": args.fp8_linear_format,
               "fp8_linear_rotate": args.fp8_linear_rotate,
               **({"fp8_linear_layers": args.fp8_linear_layers} if args.fp8_linear_layers else {})}
        problem = fp8_flags_problem(args.fp8_linear, args.fp8_linear_layers, args.fp8_linear_format,
                                    args.fp8_linear_rotate)
        if problem is not None:
            raise H3Error(problem)
        options = Options.from_flat({"attention": args.attention, **given, **fp8})
        check_in_effect(options, given, spell=lambda n: f"--option {n}")
        if args.fp8_linear != "off" and args.mode not in ("free", "kernel", "drift"):
            raise H3Error("--fp8-linear replays a free run, a kernel site or a drift row (--mode free | kernel | "
                          "drift): a teacher-forced layer runs the checkpoint's own linears")
        rule = Rule(args.budget, args.ratio, args.floor, args.cosine, args.drift)
        if sum(x is not None for x in (args.budget, args.ratio, args.cosine, args.drift)) > 1:
            raise H3Error("give one rule: --budget, --ratio, --cosine or --drift")
        if args.against is not None and args.ratio is None:
            raise H3Error("--against scales the ratio rule's limit: give --ratio K too")
        if args.reference != "exact" and args.mode != "kernel":
            raise H3Error("--reference names what a kernel row is measured against: give --mode kernel")
        if args.mode == "drift" and (args.baseline is None or args.drift is None):
            raise H3Error("--mode drift re-measures a quantity against its baseline: give --baseline FILE and "
                          "--drift K (the gate's printed command has them)")
        return cls(Path(args.trace), args.layer, args.mode, options, args.compute_dtype, args.device,
                   Path(args.twin) if args.twin else None, Path(args.against) if args.against else None,
                   args.reference, Path(args.baseline) if args.baseline else None, rule, args.comfy_root,
                   getattr(args, "comfy_python", None), args.checkpoint, args.direct, args.no_comfy)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of one request (`--comfy-python` is `oracle.elsewhere`'s, added by the command)."""
    parser.add_argument("--trace", required=True, help="trace .safetensors (any trace the parity gate accepts)")
    parser.add_argument("--layer", required=True,
                        help="a recorded tensor name as the gate prints it (blocks.1.in.0, blocks.1.mlp.fc2.out, "
                             "drift.x0.video), or a module path (blocks.1, blocks.1.attn): its outputs")
    parser.add_argument("--comfy-root", help="ComfyUI checkout (default: $H3_COMFY_ROOT)")
    parser.add_argument("--checkpoint",
                        help="checkpoint file (default: the manifest's, looked up beside the trace and in "
                             "$H3_ORACLE_DIR)")
    parser.add_argument("--direct", action="store_true", help="re-run the layer with h3direct")
    parser.add_argument("--no-comfy", action="store_true",
                        help="only h3direct (with --direct), even with a ComfyUI root")
    parser.add_argument("--mode", choices=MODES, default="teacher",
                        help="teacher (default): the layer alone, fed its recorded inputs; free: the whole step from "
                             "the inputs file, with where the drift starts; kernel: an approximate kernel on the "
                             "site's recorded operands against exact arithmetic (--reference); drift: a measured "
                             "quantity of an approximate mode against its baseline (--baseline)")
    parser.add_argument("--attention", default=DEFAULT_OPTIONS.attention.backend,
                        help="h3direct's attention backend (default sdpa)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an option of the attention backends by its flat name (repeatable), e.g. sol_tau=2.0")
    parser.add_argument("--fp8-linear", choices=FP8_LINEAR_MODES, default="off",
                        help="h3direct's 8-bit block linears (free, kernel and drift modes), as the gate's "
                             "--fp8-linear")
    parser.add_argument("--fp8-linear-layers", help="with --fp8-linear: which linears of every block (comma list)")
    parser.add_argument("--fp8-linear-format", choices=FP8_LINEAR_FORMATS, default="e4m3",
                        help="with --fp8-linear: the 8-bit number format")
    parser.add_argument("--fp8-linear-rotate", default="none",
                        help="with --fp8-linear-format int8: which int8 linears rotate (none, or a comma list)")
    parser.add_argument("--compute-dtype", choices=("fp32", "bf16", "fp16"),
                        help="h3direct's dtype where the gate ran it in another than the trace's (default: the "
                             "trace's)")
    parser.add_argument("--device", default="cpu", help="where h3direct runs (cpu or cuda)")
    parser.add_argument("--twin", help="ComfyUI's other recording of the case for the ratio rule: the fp32 twin of a "
                                       "low-precision trace, or ComfyUI's low-precision trace of an fp32 case run in "
                                       "--compute-dtype")
    parser.add_argument("--against", help="with --ratio: the ComfyUI recording whose own error against fp32 scales "
                                          "the limit (default: ComfyUI's low-precision recording of the case; the "
                                          "class rule's is ComfyUI --use-sage-attention's)")
    parser.add_argument("--reference", choices=REFERENCES, default="exact",
                        help="kernel mode: what the kernel is measured against (exact fp32 attention; emulation: "
                             "h3direct's torch emulation of the same FP8 scaling; algorithm: comfy-kitchen's eager "
                             "Sol-Attn)")
    parser.add_argument("--baseline", help="drift mode: the mode's recorded baseline (.npz) the gate held it to")
    parser.add_argument("--budget", type=float, help="rule: rel-L2 at most REL")
    parser.add_argument("--ratio", type=float, metavar="K",
                        help="rule: the error against the fp32 reference at most K times the reference error, "
                             "plus --floor")
    parser.add_argument("--cosine", type=float, metavar="C", help="rule (a kernel contract): cosine at least C")
    parser.add_argument("--drift", type=float, metavar="K",
                        help="rule: the drift rule against --baseline, sqrt(baseline² + n·(K·r)²)")
    parser.add_argument("--floor", type=float, default=0.0, help="the ratio or drift rule's floor (default 0)")
