"""Every GPU-calibrated budget entry (the H200 block at the end of budgets.toml) is reachable under its own key and
bites: an error 5 % above the entry's limit fails, 5 % below passes — for the rel-L2 rule and for the ratio rule
against an fp32 twin, and for the e2e frames entries each PSNR / SSIM floor (error in RMS pixels for PSNR, in
1 - SSIM for SSIM). Runs on the CPU (the rule, not the kernels)."""

from __future__ import annotations

import pytest
import torch

from h3direct.traces import metrics
from h3direct.traces.budgets import DEFAULT_PATH, load_budgets, verdict

pytestmark = pytest.mark.parity

MARKER = "# ---- GPU-calibrated per-backend entries (H200) ----"


def _gpu_entries():
    table = load_budgets()
    text = DEFAULT_PATH.read_text()
    assert MARKER in text, "the H200 block is missing from budgets.toml"
    first = text[:text.index(MARKER)].count("[[budget]]")
    return table, [b for b in table.entries if b.order >= first]


TABLE, ENTRIES = _gpu_entries()


def _with_error(base: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(base.shape, generator=g)
    return base + noise * (rel * base.norm() / noise.norm())


def _ids():
    return [f"{b.match['mode']}-{b.match['kind']}-{b.match['compute']}-{b.match['attention']}"
            + ("" if b.match["weights"] == "*" else f"-{b.match['weights']}") for b in ENTRIES]


@pytest.mark.parametrize("entry", ENTRIES, ids=_ids())
def test_entry_is_reachable_and_bites(entry):
    key = {k: ("bf16" if k == "weights" and v == "*" else v) for k, v in entry.match.items()}
    assert TABLE.lookup(**key) is entry, "shadowed by another entry"
    assert entry.provenance.startswith("measured on the H200")
    ref = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    if entry.rel_l2 is not None:  # no fp32 twin: rel-L2 against ComfyUI's trace
        for factor, want in ((1.05, False), (0.95, True)):
            ours = _with_error(ref, entry.rel_l2 * factor, 2)
            rel = metrics.rel_l2(ours, ref)
            ok, rule = verdict(entry, rel=rel, sqnr=99.0, identical=False)
            assert ok is want, f"rel {rel:.4g} vs {entry.describe()}: {rule}"
    if entry.k is not None:  # ratio rule: err(ours, fp32) <= k * err(ComfyUI, fp32) + floor
        comfy_err = 8e-3
        limit = entry.k * comfy_err + entry.floor
        for factor, want in ((1.05, False), (0.95, True)):
            ok, rule = verdict(entry, rel=0.0, sqnr=99.0, identical=False, ours_vs_fp32=limit * factor,
                               comfy_vs_fp32=comfy_err)
            assert ok is want, rule
    if entry.sqnr_db is not None:
        ok, _ = verdict(entry, rel=0.0, sqnr=entry.sqnr_db - 0.5, identical=False)
        assert not ok
    if entry.match["kind"] == "frames":  # e2e frames (PSNR / SSIM floors): 5 % more error than a floor allows fails
        from parity_tests.test_budget_sensitivity import frames_entry_bites

        frames_entry_bites(entry, above=1.05, below=0.95)


def test_exact_backends_use_the_ratio_rule_with_k_at_most_1_5():
    from h3direct.dit.attention import is_exact

    for b in ENTRIES:
        # FP8 W8A8 linears (weights "fp8_w8a8") make the path approximate even with exact attention: measured limits
        approximate_weights = b.match["weights"] == "fp8_w8a8"
        if (b.match["mode"] == "free" and is_exact(b.match["attention"]) and b.match["attention"] != "sdpa"
                and not approximate_weights):
            assert b.k is not None and b.k <= 1.5, b.match
