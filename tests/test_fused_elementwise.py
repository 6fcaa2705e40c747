"""The compiled adaLN elementwise path (H3_COMPILE_ELEMENTWISE=1): its math, checked on the CPU in eager form against
the block's eager ops and an fp32 reference. One rounding instead of three: closer to fp32 than eager bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h3direct.dit import fused
from h3direct.dit.blocks import gated_residual_, modulate_
from h3direct.dit.timesteps import ModRun


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_norm_modulate_and_gated_residual_match_the_eager_block_math():
    g = torch.Generator().manual_seed(0)
    s, d = 130, 64
    x = torch.randn(s, d, generator=g).bfloat16()
    w = torch.randn(d, generator=g).bfloat16()
    shift, scale, gate = (torch.randn(3, d, generator=g) * f for f in (1.0, 0.1, 1.0))
    runs = [ModRun(0, 10, 1), ModRun(10, 60, 0), ModRun(60, 120, 2)]  # rows 120..129 unmodulated
    idx = fused.row_index(runs, s, 3, "cpu")
    assert idx[5] == 1 and idx[59] == 0 and idx[125] == 3
    ours = fused._norm_modulate_eager(x, w, 1e-6, fused._pad_zero_row(shift), fused._pad_zero_row(scale), idx)
    eager = modulate_(F.rms_norm(x, (d,), w, 1e-6), shift, scale, runs)
    ref = F.rms_norm(x.float(), (d,), w.float(), 1e-6)
    for r in runs:
        ref[r.start:r.stop] = ref[r.start:r.stop] * (1 + scale[r.row]) + shift[r.row]
    assert ours.dtype == torch.bfloat16
    assert _rel(ours, ref) < 2.5e-3 and _rel(ours, ref) <= _rel(eager, ref)
    assert torch.equal(ours[120:], eager[120:])  # rows outside every run: the plain norm, as in eager
    upd = torch.randn(s, d, generator=g).bfloat16()
    res = fused._gated_residual_eager(x, upd, fused._pad_zero_row(gate), idx)
    want = gated_residual_(x.clone(), gate, upd, runs)
    assert _rel(res, want) < 4e-3 and torch.equal(res[120:], x[120:])
