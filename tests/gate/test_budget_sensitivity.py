"""The budgets table is made of rules, and every entry can fail.

- The committed table loads: every entry is fp32 / ratio / rounding / contract / drift; every contract names its
  source, and none is a self-declared floor; no approximate backend has an entry for a layer it does not compute. The loader refuses a fitted number in each
  disguise (tested one by one).
- Each entry, at the verdict level (the code the gate runs for every comparison): 1.5x its limit fails, 0.5x passes.
- Each rule, at the gate level on the committed fixtures: a perturbation just over the limit fails the gate and is
  named; the same comparison passes unperturbed.
"""

from __future__ import annotations

import math
import shutil
from functools import cache

import pytest

from h3direct.traces.format import Trace, load_trace
from parity_tests.budgets import (
    RULES,
    Budget,
    BudgetError,
    Measured,
    load_budgets,
    product_unit,
    table_of,
    unit_roundoff,
    verdict,
)
from parity_tests.discovery import FIXTURES, find_dit_cases, find_generate_cases, find_vae_cases

TABLE = load_budgets()
ABOVE, BELOW = 1.5, 0.5
EXACT_KINDS = {"teacher", "free", "vae", "e2e"}


def _id(b: Budget) -> str:
    m = b.match
    return f"{b.order}-{m['mode']}-{m['kind']}-{m['compute']}-{m['weights']}-{m['attention']}".replace("*", "any")


# ------------------------------------------------------------------ the table is rules

def test_committed_table_is_made_of_rules():
    assert TABLE.entries
    for b in TABLE.entries:
        assert b.rule in RULES, _id(b)
        if b.rule in ("fp32", "ratio"):  # no number of their own
            assert all(getattr(b, f) is None for f in ("rel_l2", "cosine", "sqnr_db", "psnr_db")), _id(b)
        if b.rule == "contract":
            assert b.source and "product quality contract" not in b.source, _id(b)
            assert b.match["mode"] in ("kernel", "quality") or b.match["weights"] == "nvfp4_w4a4", _id(b)
        if b.match["mode"] in EXACT_KINDS:  # what an approximate backend does not compute: the exact rules
            assert b.match["attention"] in ("exact", "*"), _id(b)
        assert len(b.provenance) <= 200 and "LOG.md" in b.provenance, _id(b)
    assert TABLE.rules["fp32_limit"] == 1e-5 and TABLE.rules["ratio_k_max"] == 1.5


GOOD = {"mode": "teacher", "kind": "*", "compute": "bf16", "weights": "*", "attention": "exact", "twin": "yes",
        "rule": "ratio", "k": 1.5, "provenance": "test: LOG.md"}


@pytest.mark.parametrize("change, why", [
    ({"rule": "fp32", "k": None, "rel_l2": 2e-5}, "carries no number"),
    ({"rel_l2": 4e-3}, "carries no number"),
    ({"rule": None}, "every limit is a rule"),
    ({"rule": "measured"}, "every limit is a rule"),
    ({"k": 2.0}, "k ≤ 1.5"),
    ({"rule": "rounding", "k": None, "rel_l2": 8e-3}, "derives its limit from the arithmetic"),
    ({"rule": "contract", "k": None, "rel_l2": 1e-2}, "names its source"),
    ({"rule": "contract", "k": None, "rel_l2": 1e-2, "source": "a paper"}, "approximate mode's kernel"),
    ({"attention": "sage2"}, "named only by its kernel contract"),
    ({"compute": "*", "attention": "*"}, "catch-all"),
    ({"provenance": "x" * 201}, "one line"),
    ({"mode": "calibrated"}, "unknown mode"),
    ({"mode": "drift", "rule": "drift", "k": 1.2, "sqnr_db": 20.0}, "carries no number"),
    ({"mode": "drift", "rule": "drift", "k": 3.0}, "the exact rule's"),
    ({"mode": "drift", "rule": "ratio"}, "judged by the drift rule"),
    ({"rule": "drift"}, "governs mode drift only"),
    ({"mode": "class", "attention": "exact"}, "against ComfyUI's fast mode"),
    ({"mode": "class", "attention": "sage2", "rule": "contract", "k": None, "rel_l2": 0.1, "source": "x"},
     "a contract may only govern"),
    ({"mode": "class", "kind": "output", "attention": "sage2"}, "states no k"),
], ids=["fp32-number", "ratio-number", "no-rule", "unknown-rule", "k-over-1.5", "rounding-number",
        "contract-no-source", "contract-exact-layer", "approx-exact-layer", "catch-all", "long-provenance",
        "unknown-mode", "drift-number", "drift-k", "drift-mode-other-rule", "drift-rule-other-mode",
        "class-exact", "class-contract", "class-k"])
def test_loader_refuses_what_is_not_a_rule(change, why):
    e = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(BudgetError, match=re_escape(why)):
        table_of([e])


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_an_approximate_backend_gets_the_exact_rule_for_what_it_does_not_compute():
    """The lookups the gate makes for a non-attention layer under an approximate backend are the exact ones; the
    class rule's k is the class tier's bound, stated once in the runtime's tiers."""
    from h3direct.app.tiers import CLASS_BOUND

    for backend in ("sage2", "ck_int8", "fa3_fp8", "sol_attn"):
        kernel = TABLE.lookup(mode="kernel", kind="attention", compute="*", weights="*", attention=backend, twin="*")
        assert kernel.rule == "contract" and kernel.match["attention"] == backend
        klass = TABLE.find(mode="class", kind="output", compute="bf16", weights="bf16", attention=backend, twin="yes")
        assert (klass is not None and klass.rule == "ratio" and klass.k == CLASS_BOUND) == \
            (backend != "sol_attn")  # the quantized class against ComfyUI+sage; sol_attn has no ComfyUI counterpart
        drift = TABLE.lookup(mode="drift", kind="*", compute="*", weights="*", attention=backend, twin="*")
        assert drift.rule == "drift"
        for twin, rule in (("yes", "ratio"), ("no", "rounding")):
            b = TABLE.lookup(mode="teacher", kind="linear", compute="bf16", weights="bf16", attention="exact",
                             twin=twin)
            assert b.rule == rule and b.match["attention"] == "exact"
        with pytest.raises(Exception, match="no rule for"):
            TABLE.lookup(mode="teacher", kind="linear", compute="bf16", weights="bf16", attention=backend, twin="yes")


# ------------------------------------------------------------------ every entry bites (verdict level)

def _limit_measurements(b: Budget, factor: float) -> tuple[Measured, int | None]:
    """A measurement at `factor` x the entry's limit (its own scale), and the roundings count it needs."""
    floor = b.floor
    if b.rule == "fp32":
        return Measured(factor * floor), None
    if b.rule == "ratio":
        comfy = 1e-2
        return Measured(0.0, twin=(factor * (b.k * comfy + floor), comfy)), None
    if b.rule == "drift":  # a baseline of 3e-2 at a rounding scale r of 1e-2 over 2 paths
        base, r, n = 3e-2, 1e-2, 2
        limit = math.sqrt(base ** 2 + n * (b.k * r) ** 2)
        return Measured(base + factor * (limit - base) if factor < 1 else factor * limit, baseline=base, scale=r,
                        paths=n), None
    if b.rule == "rounding":
        if b.dtype:
            rho = 40.0
            limit = b.k * product_unit(b.dtype) * rho
            return Measured(factor * limit, gemm_rho=rho), None
        n = 2
        return Measured(factor * 2 * n * unit_roundoff("bfloat16"), produced="bfloat16"), n
    # contract: each stated limit at factor x (error scale: rel-L2, 1 - cos, RMS error for dB floors)
    err = b.rel_l2 * factor if b.rel_l2 is not None else 0.0
    cos = None
    if b.cosine is not None:
        cos = 1.0 - (1.0 - b.cosine) * factor
    if b.sqnr_db is not None:
        err = max(err, 10.0 ** (-(b.sqnr_db - 20.0 * math.log10(factor)) / 20.0))
    frames = None
    if b.psnr_db is not None or b.ssim_mean is not None:
        frames = {"psnr_mean": 200.0, "psnr_min": 200.0, "ssim_mean": 1.0, "ssim_min": 1.0}
        for fld, metric in (("psnr_db", "psnr_mean"), ("psnr_min_db", "psnr_min"), ("ssim_mean", "ssim_mean"),
                            ("ssim_min", "ssim_min")):
            floor_v = getattr(b, fld)
            if floor_v is not None:
                frames[metric] = (floor_v - 20.0 * math.log10(factor) if fld.startswith("psnr")
                                  else 1.0 - (1.0 - floor_v) * factor)
    twin = None
    if b.k is not None:
        ref_err = 1e-2
        twin = (factor * (b.k * ref_err + floor), ref_err)
    return Measured(err, cos=cos, frames=frames, twin=twin), None


@pytest.mark.parametrize("b", TABLE.entries, ids=_id)
def test_every_entry_fails_over_its_limit_and_passes_under_it(b):
    for factor, want in ((ABOVE, False), (BELOW, True)):
        m, n = _limit_measurements(b, factor)
        v = verdict(b, m, roundings=n)
        assert v.passed is want, f"{_id(b)} at {factor}x its limit: {v.text}"
    assert not verdict(b, Measured(math.nan), roundings=2).passed  # NaN never passes


# ------------------------------------------------------------------ every rule bites at the gate

@cache
def _cases():
    cases, problems = find_dit_cases([FIXTURES])
    assert not problems, problems
    return cases


def _scaled(trace: Trace, name: str, factor: float) -> Trace:
    tensors = dict(trace.tensors)
    tensors[name] = (tensors[name].double() * factor).to(tensors[name].dtype)
    return Trace(trace.path, tensors, trace.manifest, trace.stored)


def _same_tensor(trace: Trace, name: str) -> set[str]:
    target = trace.aliases.get(name, name)
    return {name, target} | {a for a, t in trace.aliases.items() if t == target}


@pytest.mark.parametrize("mode", ["teacher", "free"])
def test_fp32_rule_bites_at_the_gate(mode):
    from parity_tests.gate import run_dit_case

    case = next(c for c in _cases() if c.compute == "fp32" and c.weights == "bf16")
    trace = load_trace(case.trace)
    name = "blocks.1.mlp.fc2.out"
    assert run_dit_case(case, mode=mode).passed
    result = run_dit_case(case, mode=mode, trace=_scaled(trace, name, 1.0 + ABOVE * TABLE.rules["fp32_limit"]))
    assert result.first_failure is not None and result.first_failure.name in _same_tensor(trace, name), \
        result.report()


@pytest.mark.parametrize("mode, layer", [("teacher", "blocks.1.mlp.fc2"), ("free", "blocks.1.mlp.fc2")])
def test_ratio_rule_bites_on_an_h3direct_layer(mode, layer):
    """A bf16 case with its fp32 twin: h3direct's bf16 layer perturbed just over what the ratio rule allows fails
    there; teacher-forced, the rule measures each side's own rounding error at the layer (not the twin's drift)."""
    from parity_tests.gate import run_dit_case
    from parity_tests.models import model as load_model

    case = next(c for c in _cases() if c.compute == "bf16" and c.twin_fp32 is not None)
    base = run_dit_case(case, mode=mode)
    assert base.passed, base.report()
    row = next(r for r in base.layers if r.name == f"{layer}.out")
    ours, comfy = row.vs_fp32
    b = TABLE.lookup(mode=mode, kind="linear" if mode == "teacher" else "*", compute="bf16", weights=case.weights,
                     attention="exact", twin="yes")
    eps = math.sqrt(max((ABOVE * (b.k * comfy + b.floor)) ** 2 - ours**2, 0.0)) * 1.05
    module = load_model(str(case.checkpoint), case.compute, "w4a16", "cpu").get_submodule(layer)
    handle = module.register_forward_hook(lambda m, a, out: (out.float() * (1.0 + eps)).to(out.dtype))
    try:
        result = run_dit_case(case, mode=mode)
    finally:
        handle.remove()
    assert result.first_failure is not None and result.first_failure.name == f"{layer}.out", result.report()


def test_without_a_twin_low_precision_is_refused_unless_asked_then_rounding_bounds_bite(tmp_path):
    from parity_tests.gate import NoTwin, run_dit_case

    case = next(c for c in _cases() if c.compute == "bf16" and c.twin_fp32 is not None)
    for p in case.trace.parent.iterdir():  # the case alone, without its twin
        if p.suffix in (".json", ".safetensors") and p.stem != case.twin_fp32.stem:
            shutil.copy(p, tmp_path / p.name)
    cases, problems = find_dit_cases([tmp_path])
    alone = next(c for c in cases if c.trace.stem == case.trace.stem)
    assert alone.twin_fp32 is None
    with pytest.raises(NoTwin, match="--no-twin"):
        run_dit_case(alone, mode="teacher")
    base = run_dit_case(alone, mode="teacher", no_twin=True)
    assert base.passed, base.report()
    assert any("not gated" in n for n in base.notes), base.notes  # blocks have no rounding bound: said so
    name = "blocks.1.mlp.fc2.out"
    bound = 2 * TABLE.roundings("linear") * unit_roundoff("bfloat16")
    trace = load_trace(alone.trace)
    result = run_dit_case(alone, mode="teacher", no_twin=True, trace=_scaled(trace, name, 1.0 + ABOVE * bound))
    assert result.first_failure is not None and result.first_failure.name in _same_tensor(trace, name), \
        result.report()
    free = run_dit_case(alone, mode="free", no_twin=True)
    assert not free.layers and any("free run not gated" in n for n in free.notes)


def test_vae_rules_bite():
    from parity_tests.vae_gate import _trace, run_vae_case

    cases, problems = find_vae_cases([FIXTURES])
    assert not problems
    for case in cases:
        trace = _trace(str(case.trace))
        name = next(n for n in trace.names_in_order() if not n.endswith((".vae_decode.out", ".vae_encode.out")))
        base = run_vae_case(case)
        assert base.passed, base.report()
        row = next(r for r in base.layers if r.name == name)
        if case.dtype == "fp32":
            factor = 1.0 + ABOVE * TABLE.rules["fp32_limit"]
            result = run_vae_case(case, trace=_scaled(trace, name, factor))
        else:  # ratio rule against the fp32 twin: perturb h3direct's side
            from parity_tests.vae_gate import h3direct_trace

            ours_err, comfy_err = row.vs_fp32
            eps = math.sqrt(max((ABOVE * (1.5 * comfy_err + 1e-5)) ** 2 - ours_err**2, 0.0)) * 1.05
            ours = h3direct_trace(str(case.weights), str(case.config), str(case.inputs), case.dtype,
                                  case.kind.split("_")[1])
            result = run_vae_case(case, ours=_scaled(ours, name, 1.0 + eps))
        assert result.first_failure is not None and result.first_failure.name == name, result.report()


def test_e2e_rule_bites():
    from parity_tests.e2e import run_e2e_case

    cases, _ = find_generate_cases([FIXTURES])
    case = cases[0]
    name = f"sampler.step{int(case.manifest['steps']) // 2}.denoised.video"
    trace = load_trace(case.trace)
    result = run_e2e_case(case, attention="sdpa", budgets=TABLE,
                          trace=_scaled(trace, name, 1.0 + ABOVE * TABLE.rules["fp32_limit"]))
    assert result.first_failure is not None and result.first_failure.name == name, result.report()
