"""h3direct.traces.metrics against hand-computed values and textbook identities."""

from __future__ import annotations

import math

import pytest
import torch

from h3direct.traces.metrics import bit_mismatch, compare, cosine, max_abs, psnr, rel_l2, sqnr_db


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32])
def test_bit_mismatch_sees_one_ulp_and_says_where(dtype) -> None:
    """The bitwise check the GPU tests use: equal bits pass; one value moved by one ulp (one code) is caught with its
    index and both values."""
    ref = (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7 - 1.5).to(dtype)
    assert bit_mismatch(ref.clone(), ref) is None
    raw = ref.clone().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[ref.element_size()])
    raw[2, 5] += 1
    msg = bit_mismatch(raw.view(dtype), ref)
    assert msg is not None and msg.startswith("1 of 24 values differ, first at [2, 5]: got ")


def test_bit_mismatch_signed_zero_nan_payload_shape_dtype() -> None:
    assert bit_mismatch(torch.tensor([0.0]), torch.tensor([-0.0])) is not None  # numerically equal, other bits
    nan = torch.tensor([float("nan")])
    assert bit_mismatch(nan, nan.clone()) is None
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert bit_mismatch(other_nan, nan) is not None
    assert "reference torch.bfloat16" in bit_mismatch(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))
    assert "[2, 1]" in bit_mismatch(torch.zeros(2, 1), torch.zeros(2))
