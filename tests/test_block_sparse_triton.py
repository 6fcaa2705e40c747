"""The eager reference of block-sparse attention with its pooled tail (`h3direct/dit/block_sparse_triton.py`).

It is held to the definition written out independently (every (b, h)'s whole [S, S + NK] logit matrix, block by
block, in float64); a planted error fails that check (`*_catches_*`).
"""

from __future__ import annotations

import math

import pytest
import torch

from h3direct.dit import block_sparse_triton as bs

# ---- tolerances -------------------------------------------------------------------------------------------------
FP32_UNIT = 2.0 ** -24


def fp32_bound(d: int, s: int, n: int) -> float:
    """The fp32 reference vs float64 (rel-L2 and absolute tail mass): Higham's γ_m for its longest chain of roundings,
    m = a q·k product's D terms plus a softmax row's at most S + NK."""
    return (d + s + n) * FP32_UNIT


# ---- inputs and checks ------------------------------------------------------------------------------------------

def _qkv(s: int, d: int, dtype=torch.bfloat16, heads: int = 2, seed: int = 0, device="cpu"):
    """q, k, v [1, H, S, D] as the DiT hands them: strided views of one packed [S, 3, H, D] projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, s, 3, heads, d, generator=g).to(device, dtype)
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))


def _keep(kind: str, n: int, heads: int = 2, seed: int = 1) -> torch.Tensor:
    """bool [1, H, n, n]: diag_random (the diagonal and 30 % of the rest), all, diagonal, or empty_row (diag_random
    with query block 1 keeping nothing: that row block is all tail)."""
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(n, dtype=torch.bool).expand(1, heads, n, n)
    if kind == "all":
        return torch.ones(1, heads, n, n, dtype=torch.bool)
    if kind == "diagonal":
        return eye.clone()
    keep = eye | (torch.rand(1, heads, n, n, generator=g) < 0.3)
    if kind == "empty_row":
        keep[:, :, 1] = False
    return keep


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def assert_close(got: torch.Tensor, ref: torch.Tensor, bound: float, what: str, *, relative: bool = True):
    """rel-L2 (or the largest absolute error) within `bound`; the message names the worst element and both values."""
    err = (got.double() - ref.double()).abs()
    value = _rel(got, ref) if relative else float(err.max())
    if not value <= bound:
        at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(f"{what}: {'rel-L2' if relative else 'max |error|'} {value:.3g} > {bound:.3g}; worst at "
                             f"{at}: {float(got[at]):.6g} vs {float(ref[at]):.6g}")


def _dense(q, k, v, keep, tail: bool):
    """The definition, written out: per (b, h) the whole [S, S + NK] logit matrix block by block (exact scores of
    kept blocks, a pooled logit scale·q·k̄_j + log n_j per dropped block), softmax, times [v; v̄], float64."""
    bsz, heads, s, d = q.shape
    n = -(-s // bs.BLOCK)
    out = torch.zeros(bsz, heads, s, d, dtype=torch.float64)
    mass = torch.zeros(bsz, heads, s, dtype=torch.float64)
    spans = [range(j * bs.BLOCK, min(s, (j + 1) * bs.BLOCK)) for j in range(n)]
    for b in range(bsz):
        for h in range(heads):
            qh, kh, vh = (x[b, h].double() for x in (q, k, v))
            logits = torch.full((s, s + n), float("-inf"), dtype=torch.float64)
            values = torch.cat([vh, torch.stack([sum(vh[t] for t in span) / len(span) for span in spans])])
            for i, rows in enumerate(spans):
                for j, keys in enumerate(spans):
                    r, c = slice(rows.start, rows.stop), slice(keys.start, keys.stop)
                    if keep[b, h, i, j]:
                        logits[r, c] = qh[r] @ kh[c].T / math.sqrt(d)
                    elif tail:
                        k_mean = sum(kh[t] for t in keys) / len(keys)
                        logits[r, s + j] = qh[r] @ k_mean / math.sqrt(d) + math.log(len(keys))
            live = logits.isfinite().any(1)  # a row with no term: zeros
            w = torch.zeros_like(logits)
            w[live] = torch.softmax(logits[live], 1)
            out[b, h] = w @ values
            mass[b, h] = w[:, s:].sum(1)
    return out, mass


# ---- the reference against the definition -----------------------------------------------------------------------

REF_CASES = [(130, "diag_random", True), (200, "empty_row", False), (200, "empty_row", True), (130, "all", True)]


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunked"])
@pytest.mark.parametrize("s,kind,tail", REF_CASES, ids=[f"S{s}-{k}-{'tail' if t else 'no_tail'}" for s, k, t in REF_CASES])
def test_reference_is_the_definition(s, kind, tail, chunked, monkeypatch):
    """fp32 eager reference vs the dense definition in float64; `chunked`: one query block per reference step."""
    if chunked:
        monkeypatch.setattr(bs, "_REFERENCE_LOGITS", 1)
    q, k, v = (x.float() for x in _qkv(s, 64))
    keep = _keep(kind, -(-s // bs.BLOCK))
    out, mass = bs.block_sparse_reference(q, k, v, keep, tail=tail)
    want, want_mass = _dense(q, k, v, keep, tail)
    bound = fp32_bound(64, s, keep.shape[-1])
    assert out.dtype == torch.float32 and mass.dtype == torch.float32
    assert_close(out, want, bound, "reference output")
    assert_close(mass, want_mass, bound, "reference tail mass", relative=False)
    if kind == "empty_row":  # all tail, or (no tail) no term at all: zeros
        assert torch.allclose(mass[:, :, 64:128], torch.full((1, 2, 64), float(tail)))
        assert tail or torch.equal(out[:, :, 64:128], torch.zeros(1, 2, 64, 64))


def test_reference_check_catches_a_wrong_block_length(monkeypatch):
    """The check above can fail: a reference that counts the partial last block as BLOCK tokens is far outside it."""
    q, k, v = (x.float() for x in _qkv(130, 64))
    keep = _keep("diagonal", 3)
    want, _ = _dense(q, k, v, keep, True)
    monkeypatch.setattr(bs, "block_lengths", lambda s, device=None: torch.full((3,), float(bs.BLOCK), device=device))
    with pytest.raises(AssertionError, match="rel-L2"):
        assert_close(bs.block_sparse_reference(q, k, v, keep)[0], want, fp32_bound(64, 130, 3), "reference output")


def test_reference_rounds_to_the_input_dtype_and_refuses_a_wrong_keep():
    q, k, v = _qkv(130, 64)
    out, mass = bs.block_sparse_reference(q, k, v, _keep("diagonal", 3))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and mass.shape == (1, 2, 130)
    with pytest.raises(ValueError, match=r"keep must be bool \[B, H, NQ, NK\] = \(1, 2, 3, 3\)"):
        bs.block_sparse_reference(q, k, v, _keep("diagonal", 2))
