"""The block-sparse attention kernel with its pooled tail (`h3direct/dit/block_sparse_triton.py`).

Its eager reference is held to the definition written out independently (every (b, h)'s whole [S, S + NK] logit
matrix, block by block, in float64); the kernel, run by Triton's CPU interpreter, is held to the reference within its
own roundings, and with every block kept to dense softmax attention; compiled for sm_90, sm_100 and sm_121 it runs on
the tensor cores within each target's shared memory per block. A planted error fails the reference's and the
kernel's checks (`*_catches_*`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from h3direct.dit import block_sparse_triton as bs
from parity_tests.budgets import load_budgets, unit_roundoff
from tests.triton_targets import assert_fits_and_uses, compile_for

needs_triton = pytest.mark.skipif(bs.triton is None, reason="needs Triton (the `test` extra installs it on x86_64 "
                                                            "Linux) to run the kernel in its CPU interpreter")

# ---- tolerances -------------------------------------------------------------------------------------------------
UNIT = {dt: unit_roundoff(str(dt).removeprefix("torch.")) for dt in (torch.bfloat16, torch.float16)}  # each input's u
# kernel vs the fp32 reference, rel-L2 of the output: the attention rounding bound the gate holds it to (budgets.toml,
# budget_attn's kernel row: 2·n·u for the n roundings of [roundings].attention). The kernel makes four roundings the
# reference does not, each about one unit of the input dtype relative to the output (the weights before the PV
# product: the row sums add the rounded weights, so the output stays their weighted mean; the pooled keys, a logit
# moving by unit·scale·Σ|q·k̄|, < 1 for these unit-variance inputs; the pooled values; the stored output): inside it.
OUT_UNITS = 2 * load_budgets().roundings("attention")
# tail mass vs the reference (absolute): a ratio (<= 1) of two sums of weights each within a unit: within 2 units
MASS_UNITS = 2
FP32_UNIT = unit_roundoff("float32")


def fp32_bound(d: int, s: int, n: int) -> float:
    """The fp32 reference vs float64 (rel-L2 and absolute tail mass): Higham's γ_m for its longest chain of roundings,
    m = a q·k product's D terms plus a softmax row's at most S + NK."""
    return (d + s + n) * FP32_UNIT


# the tensor-core product each target's PTX must hold: Hopper's warpgroup MMA, Blackwell datacenter's tcgen05 (the
# operand type sits in its instruction descriptor), and the warp-level mma.sync on sm_121
MMA = {(9, 0): r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{t}\.{t}", (10, 0): r"tcgen05\.mma\S*kind::f16",
       (12, 1): r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{t}\.{t}\.f32"}


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


def test_kept_lists_put_the_kept_blocks_first_in_order():
    keep = torch.tensor([[False, True, False, True], [False, False, False, False], [True, True, True, True]])
    index, count = bs.kept_lists(keep)
    assert index.dtype == count.dtype == torch.int32
    assert count.tolist() == [2, 0, 4]
    assert index[0, :2].tolist() == [1, 3] and index[2].tolist() == [0, 1, 2, 3]


# ---- the kernel under Triton's interpreter ----------------------------------------------------------------------

@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


KERNEL_CASES = [  # (S, D, keep, tail, dtype): partial last blocks (S = 130: 2 tokens, S = 200: 8)
    (130, 64, "diag_random", True, torch.bfloat16),
    (200, 128, "diag_random", True, torch.bfloat16),
    (200, 64, "empty_row", False, torch.bfloat16),  # its row block 1 has no term: zeros
    (130, 128, "diagonal", True, torch.bfloat16),
    (200, 64, "empty_row", True, torch.bfloat16),
    (130, 64, "diag_random", True, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("s,d,kind,tail,dtype", KERNEL_CASES,
                         ids=[f"S{s}-D{d}-{k}-{'tail' if t else 'no_tail'}-{str(dt)[6:]}"
                              for s, d, k, t, dt in KERNEL_CASES])
def test_kernel_matches_the_reference(s, d, kind, tail, dtype, interpret):
    q, k, v = _qkv(s, d, dtype)
    keep = _keep(kind, -(-s // bs.BLOCK))
    out, mass = bs.block_sparse_attention(q, k, v, keep, tail=tail)
    want, want_mass = bs.block_sparse_reference(q.float(), k.float(), v.float(), keep, tail=tail)
    assert out.dtype == dtype and out.shape == q.shape and mass.dtype == torch.float32 and mass.shape == (1, 2, s)
    assert_close(out, want, OUT_UNITS * UNIT[dtype], "kernel output")
    assert_close(mass, want_mass, MASS_UNITS * UNIT[dtype], "kernel tail mass", relative=False)
    if not tail:
        assert torch.equal(mass, torch.zeros_like(mass))
        assert kind != "empty_row" or torch.equal(out[:, :, 64:128], torch.zeros_like(out[:, :, 64:128]))


@needs_triton
@pytest.mark.parametrize("s,d", [(130, 64), (200, 128)])
def test_kernel_with_every_block_kept_is_dense_attention(s, d, interpret):
    """Every block kept: no tail term (tail mass exactly 0), and the output is softmax attention's."""
    q, k, v = _qkv(s, d, seed=2)
    out, mass = bs.block_sparse_attention(q, k, v, _keep("all", -(-s // bs.BLOCK)), tail=True)
    assert torch.equal(mass, torch.zeros_like(mass))
    assert_close(out, F.scaled_dot_product_attention(q.float(), k.float(), v.float()), OUT_UNITS * UNIT[q.dtype],
                 "kernel output vs SDPA")


@needs_triton
def test_kernel_check_catches_a_wrong_mask(interpret):
    """The check above can fail: the kernel given a mask with one block of one row block dropped is far outside it,
    in its output and in its tail mass."""
    q, k, v = _qkv(200, 64)
    keep = _keep("diag_random", 4)
    wrong = keep.clone()
    wrong[0, 0, 1, 1] = False  # query block 1's own block, of head 0, pooled instead of exact
    out, mass = bs.block_sparse_attention(q, k, v, wrong)
    want, want_mass = bs.block_sparse_reference(q.float(), k.float(), v.float(), keep)
    with pytest.raises(AssertionError, match="rel-L2"):
        assert_close(out, want, OUT_UNITS * UNIT[q.dtype], "kernel output")
    with pytest.raises(AssertionError, match="max"):
        assert_close(mass, want_mass, MASS_UNITS * UNIT[q.dtype], "kernel tail mass", relative=False)


@needs_triton
def test_kernel_refuses_inputs_it_is_not_built_for(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(130, 64)
    with pytest.raises(ValueError, match="runs on CUDA"):
        bs.block_sparse_attention(q, k, v, _keep("diagonal", 3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(130, 32)
    with pytest.raises(ValueError, match="head_dim 32"):
        bs.block_sparse_attention(q, k, v, _keep("diagonal", 3))
    q, k, v = (x.float() for x in _qkv(130, 64))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        bs.block_sparse_attention(q, k, v, _keep("diagonal", 3))


# ---- compiled for the GPUs, on the CPU --------------------------------------------------------------------------

def _compile(cap: tuple[int, int], dtype: str, config: dict):
    """The kernel at D = 128 for sm_<cap>, as a launch at the DiT's shapes specializes it: pointers and strides
    16-aligned, S, H, NQ, NK not."""
    from h3direct.triton_build import build

    const = {"D": 128, "BLOCK": bs.BLOCK, "CHUNK": config["CHUNK"], "TAIL": True, "BF16_INT": False,
             "INTERPRET": False, "ROUND": build(bs._round_to), "MMA": build(bs._mma), "MAX": build(bs._row_max),
             "SUM": build(bs._row_sum)}
    kinds = {"idx_ptr": "*i32", "cnt_ptr": "*i32", "keep_ptr": "*u8", "mass_ptr": "*fp32", "qk_scale": "fp32"}
    return compile_for(bs._block_sparse_kernel, cap, config, const, kinds, f"*{dtype}", r"s[qkvo]_[bhs]")


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("cap", list(MMA), ids=[f"sm_{a}{b}" for a, b in MMA])
def test_compiles_on_the_tensor_cores_within_shared_memory(cap, dtype, tmp_path, monkeypatch):
    """The launch config the table picks on each target: it compiles, its shared memory fits a block there, and its
    products are that target's tensor-core instruction."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = bs.LAUNCH.get(cap, bs.DEFAULT_LAUNCH)
    compiled = _compile(cap, dtype, config)  # a compile error fails (ptxas ships with Triton, as in test_kernel_targets)
    assert_fits_and_uses(compiled, cap, config, MMA[cap].format(t={"bf16": "bf16", "fp16": "f16"}[dtype]))


# ---- on a GPU (`pytest -m gpu`) ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tail", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16-tail", "bf16-no_tail", "fp16-tail"])
def test_compiled_kernel_matches_the_reference_on_cuda(dtype, tail):
    """S = 4,500 (a partial last block), 8 heads, D = 128, about 30 % of the blocks kept, launched with this GPU's
    config from the table."""
    q, k, v = _qkv(4500, 128, dtype, heads=8, seed=3, device="cuda")
    keep = _keep("diag_random", -(-4500 // bs.BLOCK), heads=8).cuda()
    out, mass = bs.block_sparse_attention(q, k, v, keep, tail=tail)
    want, want_mass = bs.block_sparse_reference(q.float(), k.float(), v.float(), keep, tail=tail)
    assert_close(out, want, OUT_UNITS * UNIT[dtype], "kernel output")
    assert_close(mass, want_mass, MASS_UNITS * UNIT[dtype], "kernel tail mass", relative=False)
