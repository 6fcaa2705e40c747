"""Error metrics between a result and a reference tensor (plain torch, no pytest; float64 internally).

Conventions: `ref` is the ground truth (oracle); every function accepts any float/int dtype and shapes that
are equal (no broadcasting: a shape mismatch is a ValueError naming both shapes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _pair(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: got {tuple(x.shape)}, reference {tuple(ref.shape)}")
    return x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_2 / ||ref||_2 (0 when both are zero, inf when only ref is)."""
    a, b = _pair(x, ref)
    num = float(torch.linalg.vector_norm(a - b))
    den = float(torch.linalg.vector_norm(b))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclass(frozen=True)
class MaxAbs:
    value: float
    index: tuple[int, ...]
    got: float
    ref: float

    def __str__(self) -> str:
        return f"{self.value:.3e} at {list(self.index)} (got {self.got:.6g}, ref {self.ref:.6g})"


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> MaxAbs:
    """Largest |x - ref| with its index and both values (NaN anywhere counts as the worst element)."""
    a, b = _pair(x, ref)
    if a.numel() == 0:
        return MaxAbs(0.0, (), 0.0, 0.0)
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    flat = int(torch.argmax(diff))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    return MaxAbs(float(diff.reshape(-1)[flat]), idx, float(a.reshape(-1)[flat]), float(b.reshape(-1)[flat]))


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10·log10(||ref||² / ||x - ref||²); inf for an exact match."""
    a, b = _pair(x, ref)
    noise = float(((a - b) ** 2).sum())
    signal = float((b**2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1.0 when both are zero)."""
    a, b = _pair(x, ref)
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float((a.reshape(-1) @ b.reshape(-1)) / (na * nb))


def psnr(x: torch.Tensor, ref: torch.Tensor, peak: float = 1.0) -> float:
    """10·log10(peak² / MSE) in dB (pixels in [0, 1] → peak 1)."""
    a, b = _pair(x, ref)
    mse = float(((a - b) ** 2).mean()) if a.numel() else 0.0
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(peak * peak / mse)


@dataclass(frozen=True)
class Comparison:
    """All metrics of one (result, reference) pair, printable as one line."""

    name: str
    rel_l2: float
    max_abs: MaxAbs
    sqnr_db: float
    cosine: float

    def line(self) -> str:
        return (
            f"{self.name}: rel_l2 {self.rel_l2:.3e}  sqnr {self.sqnr_db:.1f} dB  cos {self.cosine:.8f}  "
            f"max_abs {self.max_abs}"
        )


def compare(name: str, x: torch.Tensor, ref: torch.Tensor) -> Comparison:
    return Comparison(name, rel_l2(x, ref), max_abs(x, ref), sqnr_db(x, ref), cosine(x, ref))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_mismatch(x: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when x is bit for bit ref (same shape and dtype; NaN payloads and signed zeros count), else one line
    saying how it differs: the count of differing values, the first one's index and both values."""
    if tuple(x.shape) != tuple(ref.shape) or x.dtype != ref.dtype:
        return f"got {x.dtype} {list(x.shape)}, reference {ref.dtype} {list(ref.shape)}"
    a, b = (t.detach().to("cpu").contiguous() for t in (x, ref))
    if a.dtype.is_floating_point:
        a, b = a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])
    differ = a != b
    n = int(differ.sum())
    if n == 0:
        return None
    first = tuple(int(i) for i in torch.unravel_index(torch.nonzero(differ.reshape(-1))[0, 0], differ.shape))
    got, want = (t.detach()[first].to("cpu", torch.float64).item() for t in (x, ref))
    return f"{n} of {differ.numel()} values differ, first at {list(first)}: got {got!r}, reference {want!r}"


# ---- the limits of the rules every comparison is judged by (the gate's budgets and `oracle replay` alike) -------

def ratio_limit(k: float, reference_err: float, floor: float) -> float:
    """The ratio rule: an error against the fp32 reference may be k times the reference's own error, plus a floor."""
    return k * reference_err + floor


def drift_limit(baseline: float, scale: float, paths: int, k: float, floor: float) -> float:
    """The drift rule: a recorded error may grow by what a correct change can add, k times the rounding scale r
    (at least the floor) on each of `paths` low-precision paths, in quadrature."""
    r = max(scale or 0.0, floor)
    return math.sqrt(baseline ** 2 + paths * (k * r) ** 2)
