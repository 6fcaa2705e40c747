"""budget_attn's block selection (`h3direct/dit/budget_attention.py`) against dense attention on the CPU: the masses
it estimates against the true ones, the budget it holds for every sampled row, and how it follows the input."""

from __future__ import annotations

import math

import torch

from h3direct.dit.budget_attention import block_masses, sample_rows, select
from h3direct.dit.budget_options import BUDGET_BLOCK, BUDGET_SUB, BudgetOptions


def local_qk(s: int, d: int = 64, heads: int = 2, width: float = 16.0, seed: int = 0,
             logit: float = 12.0) -> tuple[torch.Tensor, ...]:
    """q, k [1, H, S, D] whose attention is local along the sequence: both are the same Fourier features of the
    position (q·k a sum of cosines of the distance, largest at 0: `logit` nats there), about `width` tokens wide,
    plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(s, dtype=torch.float64).view(s, 1)
    omega = torch.randn(heads, 1, d // 2, generator=g, dtype=torch.float64) / width  # a Gaussian kernel of the distance
    amplitude = math.sqrt(2.0 * logit / math.sqrt(d))  # q·k / sqrt(d) = amplitude² · (d/2) / sqrt(d) at distance 0
    feats = torch.cat([torch.cos(pos * omega), torch.sin(pos * omega)], -1) * amplitude
    noise = 0.1 * amplitude * torch.randn(2, heads, s, d, generator=g, dtype=torch.float64)
    q, k = ((feats + n).float().unsqueeze(0) for n in noise)
    return q, k


def uniform_subblocks(k: torch.Tensor) -> torch.Tensor:
    """k with every 16-token sub-block's keys made equal (the first key of each): where pooling loses nothing."""
    s = k.shape[2]
    first = torch.arange(s) // BUDGET_SUB * BUDGET_SUB
    return k[:, :, first]


def dense_block_masses(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The true masses: each row's softmax over every key, summed per 64-token key block, in float64."""
    h, s, d = k.shape
    n = -(-s // BUDGET_BLOCK)
    p = torch.softmax((q[:, rows].double() @ k.double().transpose(1, 2).unsqueeze(1)) * d ** -0.5, dim=-1)
    return torch.nn.functional.pad(p, (0, n * BUDGET_BLOCK - s)).view(h, *rows.shape, n, BUDGET_BLOCK).sum(-1)


def test_the_estimate_is_the_true_block_mass_where_sub_blocks_are_uniform():
    """Pooling a 16-token sub-block into its mean key, weighed by its length, is exact when its keys are equal:
    then every sampled row's estimated mass on every key block is its true mass (a partial last block included)."""
    q, k = local_qk(1000)
    k = uniform_subblocks(k)
    rows = sample_rows(1000, 8, "cpu")
    est = block_masses(q[0], k[0], 8)
    true = dense_block_masses(q[0], k[0], rows)
    assert est.shape == true.shape == (2, 16, 8, 16)
    torch.testing.assert_close(est.double(), true, rtol=1e-5, atol=1e-6)


def test_every_sampled_row_keeps_all_but_the_budget_of_its_true_mass():
    """On uniform sub-blocks (the estimate exact), every sampled row's true mass outside the kept key blocks is at
    most the budget, and the selection's own figure for it (`dropped`) is that true mass."""
    q, k = local_qk(1500)
    k = uniform_subblocks(k)
    for mass in (0.01, 0.05, 0.2):
        sel = select(q, k, None, BudgetOptions(mass=mass))
        rows = sample_rows(1500, 8, "cpu")
        true = dense_block_masses(q[0], k[0], rows)  # [H, NQ, R, NK]
        outside = (true * (~sel.keep[0]).unsqueeze(2)).sum(-1)  # [H, NQ, R]
        assert float(outside.max()) <= mass + 1e-5, (mass, float(outside.max()))
        torch.testing.assert_close(sel.dropped[0].double(), outside.amax(-1), rtol=0, atol=1e-5)


def test_a_larger_budget_never_keeps_more_and_zero_keeps_every_block_with_mass():
    q, k = local_qk(1200)
    counts = [select(q, k, None, BudgetOptions(mass=m)).keep.sum(-1) for m in (0.0, 0.01, 0.05, 0.2)]
    for denser, sparser in zip(counts, counts[1:], strict=False):
        assert bool((sparser <= denser).all())
    assert bool((counts[-1] < counts[0]).any()), "a budget of 20 % dropped nothing"
    n = -(-1200 // BUDGET_BLOCK)
    assert bool((counts[0] == n).all()), "a zero budget keeps every key block"


def test_the_forced_blocks_and_the_rows_before_the_video_are_kept():
    q, k = local_qk(1300)
    prefix = 150  # the conditioning rows: 3 blocks
    sel = select(q, k, prefix, BudgetOptions(mass=0.5))
    n = sel.keep.shape[-1]
    i = torch.arange(n)
    assert bool(sel.keep[:, :, i, i].all() and sel.keep[:, :, i[1:], i[:-1]].all())  # diagonal and neighbours
    assert bool(sel.keep[..., :3].all()), "the sink blocks of the conditioning rows"
    assert bool(sel.keep[:, :, :3].all()) and float(sel.dropped[:, :, :3].max()) == 0.0, "the conditioning rows"
    none = select(q, k, prefix, BudgetOptions(mass=0.5, sinks="none", exact_rows=False))
    assert int(none.keep.sum()) < int(sel.keep.sum())


def test_the_budget_follows_the_input_not_a_global_threshold():
    """The same budget keeps more key blocks where attention is wide than where it is sharp: the density is the
    input's, the held mass the budget's."""
    sharp = select(*local_qk(2000, width=16.0), None, BudgetOptions(mass=0.05))
    wide = select(*local_qk(2000, width=256.0), None, BudgetOptions(mass=0.05))
    assert float(wide.keep.float().mean()) > 1.5 * float(sharp.keep.float().mean())
    assert float(sharp.dropped.max()) <= 0.05 + 1e-6 and float(wide.dropped.max()) <= 0.05 + 1e-6


def test_a_planted_sparsity_regression_fails_the_drift_rule_naming_the_case(tmp_path, monkeypatch):
    """budget_attn for real on the CPU (its selection and its kernel's reference) in the e2e frames gate, on a small
    DiT with local attention: its decoded frames recorded as its baseline, then the budget doubled inside every call
    (the kernel keeps fewer blocks): the drift rule fails at the frames, naming the case; unplanted, it holds."""
    import dataclasses

    import numpy as np

    from h3direct.dit import budget_attention as BA
    from parity_tests import e2e_frames as E
    from parity_tests.budgets import load_budgets
    from parity_tests.drift import Store, data, judge

    E.build(tmp_path / "model", preset="small", dit_args=("--attention-structure", "local"), width=256, height=256,
            frames=22, steps=2, text_len=32)
    model = E.E2EModel.load(tmp_path / "model")
    options = {"budget_min_tokens": 0}  # the model's 1,700 tokens: above it, the selection and kernel run
    first = E.compare_paths(model, "budget_attn", options=options)
    assert first.attention_calls["budget_attn"].get("reference", 0) > 0, first.attention_calls
    store = Store(tmp_path / "baselines", "cpu", model.id)
    store.folder.mkdir(parents=True)
    np.savez(store.path(first.approx), **data(first.approx, first.measured))
    again = E.compare_paths(model, "budget_attn", options=options)
    judge(again, store, load_budgets())
    assert again.passed, again.report()
    select = BA.select
    monkeypatch.setattr(BA, "select", lambda q, k, prefix, opts: select(
        q, k, prefix, dataclasses.replace(opts, mass=min(0.99, 2 * opts.mass))))
    planted = E.compare_paths(model, "budget_attn", options=options)
    judge(planted, store, load_budgets())
    first_failure = planted.first_failure
    assert first_failure is not None and first_failure.name.startswith("drift.") and "drift rule" in first_failure.rule
    assert planted.report().startswith(model.id), planted.report()


def test_a_short_call_runs_the_documented_fallback_counted_and_strict_refuses():
    """A call shorter than budget_min_tokens runs budget_fallback (its output that backend's), counted as
    "fallback to sdpa: short"; a long one runs the selection and the kernel's reference, counted as such;
    budget_strict turns the fallback into a one-line error."""
    import pytest

    from h3direct.counts import counting
    from h3direct.dit import attention as A
    from h3direct.dit.attention import AttentionOptions, BackendUnavailable

    opts = AttentionOptions("budget_attn", budget_attn=BudgetOptions(min_tokens=256))
    short = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    long = torch.randn(1, 2, 320, 64, dtype=torch.bfloat16)
    with counting() as calls:
        assert torch.equal(A.attention(short, short, short, opts),
                           A.attention(short, short, short, AttentionOptions("sdpa")))
        A.attention(long, long, long, opts)
    assert calls.as_dict()["attention"] == {"budget_attn": {"fallback to sdpa: short": 1, "reference": 1}}
    strict = AttentionOptions("budget_attn", budget_attn=BudgetOptions(min_tokens=256, strict=True))
    with pytest.raises(BackendUnavailable, match="would fall back to 'sdpa' .*budget_strict forbids it"):
        A.attention(short, short, short, strict)


def test_a_mean_mass_falls_in_the_bucket_of_the_edges_above_it():
    """bucket e holds [2^(-(e+1)/2), 2^(-e/2)): an edge belongs to the bucket it closes from below; everything under the
    last edge falls in the last bucket; the search equals counting the edges above each mass."""
    from h3direct.dit.budget_attention import MASS_BUCKETS, mass_bucket, mass_edges

    edges = mass_edges()
    probe = torch.tensor([1.0, 0.75, 2 ** -0.5, 0.6, 0.5, 2 ** -31.5, 1e-12, 0.0])
    assert mass_bucket(probe, edges).tolist() == [0, 0, 0, 1, 1, 62, 63, 63]
    x = torch.rand(10_000) ** 8
    assert torch.equal(mass_bucket(x, edges), (x.unsqueeze(-1) < edges[1:]).sum(-1))
    assert MASS_BUCKETS == edges.numel() == 64
