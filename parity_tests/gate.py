"""Running the gate: compare h3direct with one ComfyUI trace, teacher-forced and free-running.

Plain Python (no pytest) so tests, the sensitivity checks and people at a prompt use the same code:

    from parity_tests.gate import run_dit_case
    result = run_dit_case(case, mode="teacher")
    print(result.report())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from h3direct.traces import metrics
from h3direct.traces.budgets import BudgetTable, load_budgets, verdict
from h3direct.traces.discovery import DitCase
from h3direct.traces.format import Trace, load_trace

OUTPUT_PREFIXES = ("dit_inner.out.", "dit_forward.out.", "sampler.", "sample_out.")


@dataclass
class LayerResult:
    name: str
    kind: str
    mode: str
    rel_l2: float
    sqnr_db: float
    worst: metrics.MaxAbs
    passed: bool
    rule: str
    budget_provenance: str
    replay: str
    vs_fp32: tuple[float, float] | None = None  # (ours, comfy) error against the fp32 twin

    def line(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        return (f"{status} {self.mode:7s} {self.name}: rel_l2 {self.rel_l2:.3e}, sqnr {self.sqnr_db:.1f} dB, "
                f"worst {self.worst} [{self.rule}]")


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
    weights: str | None = None  # budget weights key when it is not the case's own ("fp8_w8a8")
    fp8_linear_calls: dict | None = None  # --fp8-linear: calls per GEMM path (scaled_mm / emulated (reason))

    @property
    def first_failure(self) -> LayerResult | None:
        return next((r for r in self.layers if not r.passed), None)

    @property
    def passed(self) -> bool:
        return self.first_failure is None and bool(self.layers)

    def report(self) -> str:
        f = self.first_failure
        c = self.case
        head = self.title or (f"{c.id} [{self.mode}, {getattr(c, 'compute', '?')}, {getattr(c, 'weights', '?')}, "
                              f"{self.attention}]")
        if f is None:
            return f"{head}: {len(self.layers)} {self.unit}s within budget"
        return (f"{head}: first failing {self.unit} in execution order: {f.name} ({f.kind})\n"
                f"  {f.line()}\n"
                f"  budget: {f.rule} — {f.budget_provenance}\n"
                f"  worst element: index {list(f.worst.index)}: h3direct {f.worst.got:.8g}, ComfyUI {f.worst.ref:.8g}\n"
                f"  {self.action}: {f.replay}")


def replay_command(trace: Path, layer: str, comfy_root: str | None = None) -> str:
    root = f" --comfy-root {comfy_root}" if comfy_root else ""
    return f"python -m oracle replay --trace {trace} --layer {layer}{root} --direct"


@lru_cache(maxsize=8)
def _model(checkpoint: str, compute: str, nvfp4_mode: str, device: str, fp8_linear: str = "off"):
    from h3direct.dit.loader import load_dit

    return load_dit(checkpoint, compute_dtype=compute, nvfp4_mode=nvfp4_mode, device=device, fp8_linear=fp8_linear)


class KeyedBudgets:
    """A budgets table whose lookups are made under one `weights` key (FP8 linears: "fp8_w8a8") and accept only
    entries that name that key: a run with approximate weights never falls back to an entry calibrated on the
    checkpoint's own weights (or on a `weights = "*"` entry); without one it fails as "no calibrated budget"."""

    def __init__(self, table: BudgetTable, weights: str):
        self.table, self.weights, self.path = table, weights, table.path

    def lookup(self, **key: str):
        from h3direct.errors import H3Error

        key = {**key, "weights": self.weights}
        b = self.table.lookup(**key)
        if b.match.get("weights") != self.weights:
            what = ", ".join(str(key.get(k, "*")) for k in ("mode", "compute", "weights", "attention"))
            raise H3Error(f"no calibrated budget for ({what}) (kind {key.get('kind', '*')}): the best match is not "
                          f"keyed weights = {self.weights!r} ({b.provenance[:60]}); add a calibrated entry",
                          path=self.path)
        return b


@lru_cache(maxsize=32)
def _trace(path: str) -> Trace:
    return load_trace(path)


def _compare(name, kind, mode, ours, ref_trace: Trace, budgets: BudgetTable, case: DitCase, attention: str,
             twin: Trace | None, comfy_root: str | None, compute: str | None = None) -> LayerResult:
    """compute: the budget key's compute value when h3direct ran in another dtype than the trace ("bf16@fp32":
    h3direct bf16 against ComfyUI's fp32 trace; `twin` is then ComfyUI's bf16 trace of the same case)."""
    ref = ref_trace.get(name)
    ours = ours.detach().cpu()
    if ours.shape != ref.shape:
        nan = metrics.MaxAbs(math.inf, (), math.nan, math.nan)
        return LayerResult(name, kind, mode, math.inf, -math.inf, nan, False,
                           f"shape {tuple(ours.shape)} != ComfyUI {tuple(ref.shape)}", "", replay_command(
                               case.trace, name, comfy_root))
    # a "model" site (the whole inner forward from its recorded inputs) accumulates drift like a free run
    b_mode, b_kind = ("free", "output") if kind == "model" else (mode, kind)
    compute = compute or case.compute
    b = budgets.lookup(mode=b_mode, kind=b_kind, compute=compute, weights=case.weights, attention=attention)
    rel = metrics.rel_l2(ours, ref)
    sq = metrics.sqnr_db(ours, ref)
    identical = torch.equal(ours.to(ref.dtype), ref)
    vs = None
    if twin is not None and name in twin and b.k is not None:
        other = twin.get(name)
        if other.shape == ref.shape:
            if compute == case.compute:  # twin = ComfyUI fp32: (ours vs fp32, ComfyUI vs fp32)
                vs = (metrics.rel_l2(ours, other), metrics.rel_l2(ref, other))
            else:  # ref = ComfyUI fp32, twin = ComfyUI in our dtype
                vs = (rel, metrics.rel_l2(other, ref))
    ok, rule = verdict(b, rel=rel, sqnr=sq, identical=identical, ours_vs_fp32=vs[0] if vs else None,
                       comfy_vs_fp32=vs[1] if vs else None)
    return LayerResult(name, kind, mode, rel, sq, metrics.max_abs(ours, ref), ok, rule, b.provenance,
                       replay_command(case.trace, name, comfy_root), vs)


def lowp_twin(case: DitCase, compute: str) -> Path | None:
    """ComfyUI's `compute` trace of the same checkpoint and inputs as the fp32 `case` (None if not recorded)."""
    from h3direct.traces.discovery import find_dit_cases

    cases, _ = find_dit_cases([case.trace.parent])
    return next((c.trace for c in cases if c.compute == compute and c.twin_fp32 is not None
                 and c.twin_fp32.name == case.trace.name), None)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def run_dtype(attention: str, compute: str, device: str) -> tuple[str, str | None]:
    """(the dtype h3direct runs a `compute` trace in with this backend, why it cannot run at all or None).

    Availability is probed with a tensor of that dtype on that device. A backend that runs only in bf16/fp16 runs an
    fp32 trace in bf16 (the ratio rule against ComfyUI's bf16 twin then applies): it never skips a case it can run."""
    from h3direct.dit.attention import unavailable_reason

    def probe(c):
        return unavailable_reason(attention, torch.empty(0, device=device, dtype=getattr(torch, DTYPES[c])))

    reason = probe(compute)
    if reason is not None and compute == "fp32" and probe("bf16") is None:
        return "bf16", None
    return compute, reason


def _setup(case: DitCase, device: str, compute: str | None = None, fp8_linear: str = "off"):
    from h3direct.traces.evaluate import conditioning_of
    from h3direct.traces.inputs import load_inputs

    trace = _trace(str(case.trace))
    inputs = load_inputs(case.inputs)
    mode = case.weights.split("_")[1] if case.weights.startswith("nvfp4") else "w4a16"
    key = (str(case.checkpoint), compute or case.compute, mode, device)
    # without fp8 the cache key stays the 4-tuple others use (`_model(...)` elsewhere gets the same instance)
    model = _model(*key) if fp8_linear == "off" else _model(*key, fp8_linear)
    return trace, inputs, model, conditioning_of(inputs)


def run_dit_case(case: DitCase, *, mode: str, attention: str = "sdpa", device: str = "cpu",
                 budgets: BudgetTable | None = None, trace: Trace | None = None,
                 comfy_root: str | None = None, compute: str | None = None, fp8_linear: str = "off") -> CaseResult:
    """mode: teacher (every site fed recorded inputs) | free (whole step, every recorded tensor).

    fp8_linear "stream"/"resident": h3direct's block linears run as FP8 W8A8 (`dit.linear.FP8Linear`); every
    comparison is then keyed weights = "fp8_w8a8" and only entries naming that key apply (`KeyedBudgets`).

    compute: run h3direct in this dtype instead of the trace's (a bf16/fp16-only backend against an fp32 trace):
    budgets are then looked up with compute "<compute>@<trace compute>" and the ratio rule uses ComfyUI's own
    trace in that dtype (when recorded) against the fp32 trace."""
    from h3direct.dit.linear import FP8_WEIGHTS_KEY
    from h3direct.dit.tracing import Tracer
    from h3direct.traces.evaluate import one_step
    from h3direct.traces.replay import available_sites

    budgets = budgets or load_budgets()
    fp8_linear = fp8_linear or "off"
    if fp8_linear != "off":
        budgets = KeyedBudgets(budgets, FP8_WEIGHTS_KEY)
    key = None
    if compute is not None and compute != case.compute:
        key = f"{compute}@{case.compute}"
    base_trace, inputs, model, cond = _setup(case, device, compute, fp8_linear)
    trace = trace or base_trace
    if key is None:
        twin = _trace(str(case.twin_fp32)) if case.twin_fp32 else None
    else:
        low = lowp_twin(case, compute)
        twin = _trace(str(low)) if low else None
    result = CaseResult(case, mode, attention, title=f"{case.id} [{mode}, h3direct {compute} vs ComfyUI "
                        f"{case.compute}, {case.weights}, {attention}]" if key else "", compute=key)
    if fp8_linear != "off":
        result.weights = FP8_WEIGHTS_KEY
        result.title = (f"{case.id} [{mode}, h3direct {compute or case.compute} vs ComfyUI {case.compute}, "
                        f"{case.weights} as {FP8_WEIGHTS_KEY} ({fp8_linear}), {attention}]")
    from h3direct.checkpoint.quant.w8a8 import fp8_linear_stats, reset_fp8_linear_stats
    from h3direct.dit.attention import attention_stats, reset_attention_stats

    reset_attention_stats()
    reset_fp8_linear_stats()
    with torch.no_grad():
        if mode == "teacher":
            sites = available_sites(model, trace, cond, inputs["text_states"], backend=attention, device=device,
                                    dtypes_from=twin if key else None,
                                    compute_dtype=model.compute_dtype if key else None)
            _gate_sites(result, sites, trace, budgets, case, attention, twin, comfy_root, key)
        elif mode == "free":
            with Tracer(model) as tracer:
                one_step(model, inputs, backend=attention, device=device)
            _gate_free(result, tracer.tensors, trace, budgets, case, attention, twin, comfy_root, key)
        else:
            raise ValueError(f"unknown gate mode {mode!r}")
    result.attention_calls = attention_stats() or None
    if fp8_linear != "off":
        result.fp8_linear_calls = fp8_linear_stats()
    return result


def _gate_sites(result: CaseResult, sites, trace: Trace, budgets: BudgetTable, case: DitCase, attention: str,
                twin: Trace | None, comfy_root: str | None, key: str | None = None) -> None:
    """Run every teacher-forced site (`replay.Site`) and compare it with `trace`, into `result`."""
    for s in sites:
        result.layers.append(_compare(s.name, s.kind, "teacher", s.run(), trace, budgets, case, attention, twin,
                                      comfy_root, key))


def _gate_free(result: CaseResult, ours: dict[str, torch.Tensor], trace: Trace, budgets: BudgetTable,
               case: DitCase, attention: str, twin: Trace | None, comfy_root: str | None,
               key: str | None = None) -> CaseResult:
    """Compare `ours` with `trace` at every tensor the trace records (free-running mode), into `result`."""
    for name in trace.names_in_order():
        if name not in ours:
            result.skipped.append(name)
            continue
        kind = "output" if name.startswith(OUTPUT_PREFIXES) else "*"
        result.layers.append(_compare(name, kind, "free", ours[name], trace, budgets, case, attention, twin,
                                      comfy_root, key))
    return result


def gate_tensors(case: DitCase, ours: dict[str, torch.Tensor], *, reference: Trace | None = None,
                 attention: str = "sdpa", budgets: BudgetTable | None = None, comfy_root: str | None = None,
                 title: str = "") -> CaseResult:
    """Free-mode gate of already computed tensors (e.g. a trace that `h3direct trace` wrote under torchrun)
    against `reference` (default: the case's ComfyUI trace), at every tensor the reference records."""
    trace = reference or _trace(str(case.trace))
    twin = _trace(str(case.twin_fp32)) if case.twin_fp32 else None
    return _gate_free(CaseResult(case, "free", attention, title=title), ours, trace, budgets or load_budgets(), case,
                      attention, twin, comfy_root)


def run_sharded_teacher(case: DitCase, sp, *, attention: str = "sdpa", device: str = "cpu",
                        budgets: BudgetTable | None = None) -> CaseResult:
    """Teacher-forced sites of the sequence-parallel DiT (`h3direct.traces.replay_sharded`); collective: every
    rank of `sp` calls it with the same case. The model is loaded attached to `sp` (`parallel.init_from_env`)."""
    from h3direct.traces.replay_sharded import available_sharded_sites

    budgets = budgets or load_budgets()
    trace, inputs, model, cond = _setup(case, device)
    sp.attach(model)
    result = CaseResult(case, "teacher", attention, title=f"{case.id} [teacher, sharded over {sp.world} ranks]")
    with torch.no_grad():
        _gate_sites(result, available_sharded_sites(model, trace, cond, sp, backend=attention, device=device), trace,
                    budgets, case, attention, None, None)
    return result
