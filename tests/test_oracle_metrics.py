"""h3direct.traces.metrics against hand-computed values and textbook identities."""

from __future__ import annotations

import math

import pytest
import torch

from h3direct.traces.metrics import compare, cosine, max_abs, psnr, rel_l2, sqnr_db


def test_rel_l2_hand_values() -> None:
    ref = torch.tensor([3.0, 4.0])  # norm 5
    assert rel_l2(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert rel_l2(ref, ref) == 0.0
    assert rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_l2(torch.ones(2), torch.zeros(2)) == math.inf


def test_max_abs_reports_index_and_both_values() -> None:
    ref = torch.zeros(2, 3)
    got = ref.clone()
    got[1, 2] = -0.5
    got[0, 1] = 0.25
    m = max_abs(got, ref)
    assert (m.value, m.index, m.got, m.ref) == (0.5, (1, 2), -0.5, 0.0)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert max_abs(nan, ref).index == (0, 0)


def test_sqnr_psnr_cosine_identities() -> None:
    ref = torch.tensor([1.0, -1.0, 1.0, -1.0])
    noisy = ref + torch.tensor([0.1, 0.1, -0.1, -0.1])  # noise power 0.01 per element, signal 1
    assert sqnr_db(noisy, ref) == pytest.approx(20.0)
    assert psnr(noisy, ref, peak=1.0) == pytest.approx(20.0)
    assert sqnr_db(ref, ref) == math.inf
    assert cosine(-ref, ref) == pytest.approx(-1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == pytest.approx(0.0)


def test_shape_mismatch_is_an_error_and_bf16_is_upcast() -> None:
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        rel_l2(torch.zeros(3), torch.zeros(2))
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    c = compare("x", a, torch.tensor([1.0, 2.0]))
    assert c.rel_l2 == 0.0 and "x: rel_l2" in c.line()
