"""Running the gate: compare h3direct with one ComfyUI trace, teacher-forced and free-running.

An exact path (sdpa, cudnn_sdpa, fa3; the checkpoint's own weights) is compared with ComfyUI at every site under the
exact entries of the budgets table. An approximate mode (an attention backend that is not exact, and/or the FP8
block linears of `--fp8-linear`) is judged in three parts, each reported per case:

- (a) **exact**: every site is also run on the exact path (the approximate backend replaced by `EXACT_REFERENCE`,
  the FP8 linears by the checkpoint's own) and held to the exact rule against ComfyUI, so a broken linear cannot
  hide behind an approximate attention;
- (b) **kernel**: at each attention site the backend runs on the recorded q/k/v and is compared with exact fp32
  attention on the same operands (or with the reference implementation its contract names); at each FP8 linear the
  FP8 product is compared with the exact fp32 product on the recorded input;
- (c) **outputs**, free-running: against ComfyUI's fp32 twin, in units of ComfyUI's own low-precision error (the
  ladder, `ladder.py`), held to the ratio rule against ComfyUI's fast mode (`--use-sage-attention`) where the mode
  is of its class and that recording lies beside the case; and the mode's measured quality (those outputs, and x0
  against h3direct's own exact path on the same inputs, device and dtype; decoded frames in
  `parity_tests/e2e_frames.py`) held to the mode's own recorded history (`drift.py`; the pytest gate does it).

Plain Python (no pytest) so tests, the sensitivity checks and people at a prompt use the same code:

    from parity_tests.gate import run_dit_case
    result = run_dit_case(case, mode="teacher")
    print(result.report())
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from h3direct.dit.options import AttentionOptions
from h3direct.errors import H3Error
from h3direct.traces import metrics
from h3direct.traces.format import Trace
from h3direct.traces.quality import EXACT_REFERENCE
from h3direct.traces.quality import exact_backend as exact_of
from parity_tests.budgets import BudgetTable, Measured, load_budgets, verdict
from parity_tests.discovery import DitCase, low_case
from parity_tests.models import compute_name, fp8_parts, model, nvfp4_mode, trace
from parity_tests.results import CaseResult, LayerResult, ReplayContext, command, replay_request, run_options

OUTPUT_PREFIXES = ("dit_inner.out.", "dit_forward.out.", "sampler.", "sample_out.")


class NoTwin(H3Error):
    """A low-precision case without ComfyUI's fp32 twin, gated without --no-twin."""


def _setup(case: DitCase, device: str, compute: str | None = None):
    from h3direct.traces.evaluate import conditioning_of
    from h3direct.traces.inputs import load_inputs

    loaded = model(str(case.checkpoint), compute or case.compute, nvfp4_mode(case), device)
    inputs = load_inputs(case.inputs)
    return trace(str(case.trace)), inputs, loaded, conditioning_of(inputs)


def _measure(name: str, ours: torch.Tensor, ref_trace: Trace, twin: Trace | None, low_key: bool,
             local: torch.Tensor | None = None) -> Measured:
    """The measurement of one exact comparison against ComfyUI's recorded tensor.

    twin errors: free-running, (h3direct, ComfyUI) against ComfyUI's fp32 twin. Teacher-forced (`local`: the fp32
    evaluation of the same layer on the same recorded inputs, by h3direct's fp32 path, which the fp32 rule holds to
    ComfyUI's twin at every layer), against that: each side's own rounding error at this layer, without the drift
    that the twin's different inputs carry. low_key: h3direct ran in another dtype than the trace (the twin is then
    ComfyUI's own trace in h3direct's dtype, and the trace is the fp32 reference)."""
    ref = ref_trace.get(name)
    rel = metrics.rel_l2(ours, ref)
    vs = None
    if local is not None and local.shape == ref.shape:
        vs = (metrics.rel_l2(ours, local), metrics.rel_l2(ref, local))
    elif twin is not None and name in twin and twin.get(name).shape == ref.shape:
        other = twin.get(name)
        vs = (rel, metrics.rel_l2(other, ref)) if low_key else (metrics.rel_l2(ours, other),
                                                                metrics.rel_l2(ref, other))
    identical = torch.equal(ours.to(ref.dtype), ref)
    return Measured(rel, identical=identical, twin=vs, produced=ref_trace.produced_dtype(name))


class Gate:
    """One case's comparisons under one budgets table: the keys every lookup shares, and the rows it appends."""

    def __init__(self, case: DitCase, result: CaseResult, budgets: BudgetTable, trace: Trace, twin: Trace | None,
                 compute_key: str, context: ReplayContext | None, no_twin: bool, *, exact_backend="sdpa",
                 device: str = "cpu"):
        from h3direct.counts import CallCounts

        self.case, self.result, self.budgets, self.trace, self.twin = case, result, budgets, trace, twin
        self.compute_key, self.context, self.no_twin = compute_key, context or ReplayContext(), no_twin
        self.exact_backend, self.device = exact_backend, device
        self.site_calls = CallCounts()  # the attention calls of the kernel sites (each counted on its own)
        self.sage_class = False  # run_dit_case(sage_class=True): the mode claims ComfyUI+sage's class

    def key(self, mode: str, kind: str, **over) -> dict:
        return {"mode": mode, "kind": kind, "compute": self.compute_key, "weights": self.case.weights,
                "attention": "exact", "twin": "yes" if self.twin is not None else "no", **over}

    def request(self, mode: str, *, options=None, fp8_linear: str = "off", **changes):
        """How `oracle replay` re-runs this case's comparisons of `mode` (teacher | free | kernel | drift), an
        `oracle.request.ReplayRequest`: h3direct's exact path unless `options` (the attention backend and its
        options, a name or AttentionOptions) and `fp8_linear` (`models.fp8_spec`'s value) say otherwise; in another
        dtype than the trace where the gate runs one; with the recording the ratio rule reads."""
        low = self.compute_key != self.case.compute  # h3direct in another dtype than the trace: "bf16@fp32"
        twin = self.twin.path if self.twin is not None and (mode == "free" or low) else None
        base = replay_request(self.case.trace, self.context, mode=mode,
                              options=run_options(options if options is not None else self.exact_backend,
                                                  fp8_linear),
                              compute=self.compute_key.split("@")[0] if low else None, device=self.device, twin=twin)
        return dataclasses.replace(base, **changes)

    def exact(self, name: str, kind: str, mode: str, ours: torch.Tensor, local: torch.Tensor | None = None) -> None:
        """Compare h3direct's exact-path tensor with ComfyUI's recorded one (part a); `local`: see `_measure`."""
        ref = self.trace.get(name)
        ours = ours.detach().cpu()
        replay = self.request(mode)
        if ours.shape != ref.shape:
            nan = metrics.MaxAbs(math.inf, (), math.nan, math.nan)
            self.result.layers.append(LayerResult(name, kind, mode, math.inf, -math.inf, nan, False,
                                                  f"shape {tuple(ours.shape)} != ComfyUI {tuple(ref.shape)}", "",
                                                  command(replay, name), error=math.inf, limit=0.0))
            return
        # a "model" site (the whole inner forward from its recorded inputs) accumulates drift like a free run
        b_mode, b_kind = ("free", "output") if kind == "model" else (mode, kind)
        b = self.budgets.lookup(**self.key(b_mode, b_kind))
        m = _measure(name, ours, self.trace, self.twin, self.compute_key != self.case.compute,
                     None if local is None else local.detach().cpu())
        n = self.budgets.roundings(kind) if b_mode == "teacher" else None
        v = verdict(b, m, roundings=n)
        self.result.layers.append(LayerResult(name, kind, mode, m.err, metrics.sqnr_db(ours, ref),
                                              metrics.max_abs(ours, ref), v.passed, v.text, b.provenance,
                                              command(replay, name, b, v.limit),
                                              m.twin, v.error, v.limit, "exact"))


def run_dit_case(case: DitCase, *, mode: str, attention: str | AttentionOptions = "sdpa", device: str = "cpu",
                 budgets: BudgetTable | None = None, trace: Trace | None = None,
                 replay: ReplayContext | None = None, compute: str | None = None, fp8_linear: str = "off",
                 no_twin: bool = False, sage_class: bool = False) -> CaseResult:
    """mode: teacher (every site fed recorded inputs) | free (whole step, every recorded tensor).

    attention: a backend's name (its options at their defaults) or AttentionOptions; an exact backend is gated at
    every site against ComfyUI, an approximate one in the three parts of the module docstring, run with its options.
    fp8_linear "stream"/"resident": the FP8 block linears, an approximate mode judged the same
    way. compute: run h3direct's exact path in this dtype instead of the trace's (a bf16-only exact backend against
    an fp32 trace): the budget key is then "<compute>@<trace compute>" and the ratio rule uses ComfyUI's own trace in
    that dtype. no_twin: gate a low-precision case without ComfyUI's fp32 twin by the rounding bounds (teacher sites
    only; what has no rounding bound is listed as not gated) instead of refusing it. sage_class: hold the approximate
    mode, whatever its backend and linears, to the class rule against ComfyUI+sage (what a tier that claims
    ComfyUI+sage's quality must meet; `--sage-class`)."""
    from h3direct.counts import counting
    from h3direct.dit.attention import as_options, is_exact
    from h3direct.dit.linear import W8A8_WEIGHTS_KEYS
    from h3direct.dit.options import describe

    budgets = budgets or load_budgets()
    fp8_linear = fp8_linear or "off"
    attention = as_options(attention)
    label = describe(attention)
    approx_attention = not is_exact(attention)
    exact_backend = exact_of(attention)
    low = compute is not None and compute != case.compute
    compute_key = f"{compute}@{case.compute}" if low else case.compute
    base_trace, inputs, loaded, cond = _setup(case, device, compute if low else None)
    given_trace = trace or base_trace  # `trace`: an in-memory ComfyUI trace given instead of the file
    if low:
        lp = low_case(case, compute)
        twin = _load(lp.trace) if lp else None
    else:
        twin = _load(case.twin_fp32) if case.twin_fp32 else None
    if compute_key != "fp32" and twin is None and not no_twin:
        what = f"ComfyUI's {compute} trace of this case" if low else "ComfyUI's fp32 twin of this case"
        raise NoTwin(f"{case.id}: {compute_key} is gated by the ratio rule, which needs {what}; record it "
                     f"(`python -m oracle record` records the twin by default) or pass --no-twin to gate by rounding "
                     f"bounds only")
    approx = approx_attention or fp8_linear != "off"
    weights_key = W8A8_WEIGHTS_KEYS[fp8_parts(fp8_linear)[2]]
    fp8_label = f" + {weights_key} ({fp8_linear})" if fp8_linear != "off" else ""
    title = (f"{case.id} [{mode}, h3direct {compute or case.compute} vs ComfyUI {case.compute}, {case.weights}"
             f"{fp8_label}, {label}]")
    result = CaseResult(case, mode, label, title=title if (low or approx) else "",
                        compute=compute_key if low else None,
                        weights=weights_key if fp8_linear != "off" else None,
                        approx=(label + (f" + fp8_linear ({fp8_linear})" if fp8_linear != "off" else ""))
                        if approx else "")
    gate = Gate(case, result, budgets, given_trace, twin, compute_key, replay, no_twin,
                exact_backend=exact_backend, device=device)
    gate.sage_class = sage_class and approx
    if twin is None and compute_key != "fp32":
        result.notes.append("no fp32 twin (--no-twin): teacher sites by rounding bounds; free runs and whole blocks "
                            "are not gated")
    with torch.no_grad(), counting() as calls:
        if mode == "teacher":
            _teacher(gate, loaded, inputs, cond, device, exact_backend, attention if approx_attention else None,
                     fp8_linear, low)
        elif mode == "free":
            _free(gate, loaded, inputs, device, exact_backend, attention, fp8_linear, approx)
        else:
            raise ValueError(f"unknown gate mode {mode!r}")
    calls.add(gate.site_calls.as_dict())
    result.attention_calls = calls.as_dict().get("attention")
    if fp8_linear != "off":
        result.fp8_linear_calls = dict(calls.fp8_linear)
    return result


def _load(path: Path) -> Trace:
    return trace(str(path))


def _teacher(gate: Gate, dit, inputs, cond, device, exact_backend, approx_backend, fp8_linear, low) -> None:
    from h3direct.traces.replay import available_sites
    from parity_tests import kernels

    case, text = gate.case, inputs["text_states"]
    sites = available_sites(dit, gate.trace, cond, text, backend=exact_backend, device=device,
                            dtypes_from=gate.twin if low else None, compute_dtype=dit.compute_dtype if low else None)
    local = {}
    if gate.twin is not None and gate.compute_key in ("bf16", "fp16"):  # each layer's fp32 evaluation, same inputs
        ref32 = model(str(case.checkpoint), "fp32", nvfp4_mode(case), device)
        local = {s.name: s for s in available_sites(ref32, gate.trace, cond, text, backend=EXACT_REFERENCE,
                                                    device=device, widen=True)}
    fp8_model, fp8_names = None, set()
    if fp8_linear != "off":
        fp8_model = model(str(case.checkpoint), compute_name(dit), nvfp4_mode(case), device, fp8_linear)
        fp8_names = kernels.fp8_linear_names(fp8_model)
    no_bound = []
    for s in sites:
        if gate.twin is None and gate.compute_key != "fp32" and gate.budgets.roundings(s.kind) is None:
            no_bound.append(s.name)
        else:
            gate.exact(s.name, s.kind, "teacher", s.run(), local[s.name].run() if s.name in local else None)
        if approx_backend is not None and s.operands is not None:
            kernels.attention_site(gate, s, approx_backend, device)
        if s.name.removesuffix(".out") in fp8_names:
            kernels.fp8_linear_site(gate, s, dit, fp8_model, fp8_linear)
    if no_bound:
        gate.result.notes.append(f"{len(no_bound)} sites without a rounding bound not gated (first: {no_bound[0]})")


def _free(gate: Gate, dit, inputs, device, exact_backend, attention, fp8_linear, approx) -> None:
    from h3direct.traces.evaluate import traced_step

    exact = traced_step(dit, inputs, backend=exact_backend, device=device)
    if gate.twin is None and gate.compute_key != "fp32":
        gate.result.notes.append("free run not gated: no fp32 twin (a free run has no rounding bound)")
    else:
        for name in gate.trace.names_in_order():
            if name not in exact:
                gate.result.skipped.append(name)
                continue
            kind = "output" if name.startswith(OUTPUT_PREFIXES) else "*"
            gate.exact(name, kind, "free", exact[name])
    if approx:
        from parity_tests import kernels

        kernels.free_approximate(gate, dit, inputs, device, exact_backend, attention, fp8_linear, exact)


def gate_tensors(case: DitCase, ours: dict[str, torch.Tensor], *, reference: Trace | None = None,
                 attention: str = "sdpa", budgets: BudgetTable | None = None, replay: ReplayContext | None = None,
                 title: str = "") -> CaseResult:
    """Free-mode gate of already computed tensors (e.g. a trace that `h3direct trace` wrote under torchrun)
    against `reference` (default: the case's ComfyUI trace), at every tensor the reference records."""
    ref = reference or trace(str(case.trace))
    twin = _load(case.twin_fp32) if case.twin_fp32 else None
    result = CaseResult(case, "free", attention, title=title)
    replay = replay or ReplayContext(unreplayable="tensors computed elsewhere (a trace written under torchrun): "
                                                  "rerun what wrote them")
    gate = Gate(case, result, budgets or load_budgets(), ref, twin, case.compute, replay, False,
                exact_backend=attention)
    for name in ref.names_in_order():
        if name not in ours:
            result.skipped.append(name)
            continue
        gate.exact(name, "output" if name.startswith(OUTPUT_PREFIXES) else "*", "free", ours[name])
    return result


def run_sharded_teacher(case: DitCase, sp, *, attention: str = "sdpa", device: str = "cpu",
                        budgets: BudgetTable | None = None) -> CaseResult:
    """Teacher-forced sites of the sequence-parallel DiT (`h3direct.traces.replay_sharded`); collective: every
    rank of `sp` calls it with the same case. The model is loaded attached to `sp` (`parallel.init_from_env`)."""
    from h3direct.traces.replay_sharded import available_sharded_sites

    budgets = budgets or load_budgets()
    recorded, inputs, dit, cond = _setup(case, device)
    sp.attach(dit)
    twin = _load(case.twin_fp32) if case.twin_fp32 else None
    result = CaseResult(case, "teacher", attention, title=f"{case.id} [teacher, sharded over {sp.world} ranks]")
    sharded = ReplayContext(unreplayable=f"a row of the DiT sharded over {sp.world} ranks: oracle replay runs one "
                                         f"process; rerun the gate's sequence-parallel test under torchrun")
    gate = Gate(case, result, budgets, recorded, twin, case.compute, sharded, False, exact_backend=attention,
                device=device)
    with torch.no_grad():
        for s in available_sharded_sites(dit, recorded, cond, sp, backend=attention, device=device):
            gate.exact(s.name, s.kind, "teacher", s.run())
    return result
