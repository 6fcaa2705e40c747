"""Every attention backend on the GPU against exact fp32 attention, under the contract the gate holds it to.

The exact backends (sdpa, cudnn_sdpa, fa3) are held to the attention rounding bound; the approximate ones to their
kernel contracts in parity_tests/budgets.toml (mode "kernel"), measured by the code the gate measures an attention
site with (`h3direct.traces.kernels`). Inputs: `h3direct.dit.attention_inputs.structured_qkv` (per-head shared directions,
a smooth random field over the Ref2VA packed positions, RMSNorm and H3's rope: attention that falls off with distance
in time and space, as in a video DiT), at three lengths: below sol_attn's minimum (its documented fallback runs and
is held to the fallback's contract), and two above it. Random q/k are used only for the quantized backends: a sparse
method has no locality to exploit there, and its error on them says nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from h3direct.dit import attention as A
from h3direct.dit.attention_inputs import positions, random_qkv, structured_qkv
from parity_tests.budgets import Measured, load_budgets, verdict

pytestmark = pytest.mark.gpu

TABLE = load_budgets()
EXACT = ["sdpa", "cudnn_sdpa", "fa3"]
APPROXIMATE = ["sage2", "ck_int8", "fa3_fp8", "sol_attn", "kj_head_sliced", "budget_attn"]
LENGTHS = [2048, 6144, 20050]  # sol_attn's minimum is 4,096 tokens
HEADS = 8


def _judge(backend: str, q, k, v, prefix: int | None):
    """One call of `backend` on q, k, v, measured as the gate measures an attention site (`h3direct.traces.kernels`:
    against exact fp32 attention or the reference its contract names) and judged by its contract."""
    from types import SimpleNamespace

    from h3direct.traces import kernels as K

    call = K.attention_call(SimpleNamespace(operands=lambda: (q, k, v, prefix)), backend, q.device)
    key = "exact" if A.is_exact(call.ran) else call.ran
    b = TABLE.lookup(mode="kernel", kind="attention", compute="*", weights="*", attention=key, twin="*")
    m = K.measure_attention(call, b.reference or "exact", backend)
    if b.rule == "rounding":
        return verdict(b, Measured(m.err, produced="bfloat16"), roundings=TABLE.roundings("attention")), call.ran
    if b.reference == "emulation":
        return verdict(b, Measured(m.err, twin=m.errs)), call.ran
    return verdict(b, Measured(m.err, cos=m.cos)), call.ran


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("backend", EXACT + APPROXIMATE)
def test_backend_within_its_contract_on_structured_attention(backend, seq, lane_backend):
    like = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    lane_backend(backend, like)
    pos, prefix = positions(seq)
    q, k, v = structured_qkv(pos, HEADS, 128, "cuda", seed=seq)
    with torch.no_grad():
        v_, ran = _judge(backend, q, k, v, prefix)
    assert v_.passed, f"{backend} (ran {ran}) at S = {seq}: {v_.text}"
    if backend in ("sol_attn", "budget_attn"):
        assert (ran == backend) == (seq >= 4096), f"S = {seq}: {backend} ran {ran}"


@pytest.mark.parametrize("backend", ["sage2", "ck_int8", "fa3_fp8"])
def test_quantized_backend_within_its_contract_on_random_attention(backend, lane_backend):
    like = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    lane_backend(backend, like)
    q, k, v = random_qkv(4096, HEADS, 128, "cuda", seed=3)
    with torch.no_grad():
        v_, ran = _judge(backend, q, k, v, None)
    assert v_.passed, f"{backend} (ran {ran}) on random q/k: {v_.text}"


def test_a_degraded_kernel_is_caught(lane_backend):
    """The same judging, fed sage2's output plus a relative error of 5e-2 (past cos 0.999), fails."""
    like = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    lane_backend("sage2", like)
    pos, prefix = positions(2048)
    q, k, v = structured_qkv(pos, HEADS, 128, "cuda", seed=7)
    real = A._REGISTRY["sage2"]

    def worse(q, k, v):
        out = real.fn(q, k, v)
        noise = torch.randn_like(out, dtype=torch.float32)
        return (out.float() + 5e-2 * noise * (out.float().norm() / noise.norm())).to(out.dtype)

    A._REGISTRY["sage2"] = A.Backend("sage2", worse, real.available, exact=False)
    try:
        with torch.no_grad():
            v_, _ = _judge("sage2", q, k, v, prefix)
    finally:
        A._REGISTRY["sage2"] = real
    assert not v_.passed and math.isfinite(v_.error)


@pytest.mark.parametrize("rows_backend", ["fa3", "sdpa", "kernel"])
def test_sol_reads_strided_views_and_writes_its_exact_rows(rows_backend, lane_backend):
    """sol_attn takes q, k, v as the DiT hands them over (strided views into one qkv projection output, v
    included) with the same bits as dense copies; with an exact rows backend its first query blocks are that
    backend's rows over every key and the rest are the kernel's with every block routed, bit for bit."""
    from h3direct.dit.options import AttentionOptions
    from h3direct.dit.sol_options import SolOptions

    like = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    opts = AttentionOptions("sol_attn", sol_attn=SolOptions(rows_backend=rows_backend, fallback="sdpa"))
    lane_backend(opts, like)
    pos, prefix = positions(6144)
    q, k, v = structured_qkv(pos, HEADS, 128, "cuda", seed=11)
    qkv = torch.stack([x[0].transpose(0, 1) for x in (q, k, v)], dim=1)  # [S, 3, H, D], as the projection's rows
    views = [qkv[:, i].unsqueeze(0).transpose(1, 2) for i in range(3)]  # [1, H, S, D], row stride 3·H·D
    dense = [A.dense_rows(x) for x in views]  # the same values in dense [B, S, H, D] storage
    assert views[2].stride(2) == 3 * HEADS * 128 and dense[2].stride(2) == HEADS * 128
    with torch.no_grad(), A.sequence_hints(prefix):
        strided_out = A.attention(*views, opts)
        dense_out = A.attention(*dense, opts)
    assert torch.equal(strided_out, dense_out)
    if rows_backend == "kernel":
        return
    import comfy_kitchen as ck

    rows = SolOptions().exact_query_rows(prefix, 6144)
    with torch.no_grad():
        exact_rows = A._REGISTRY[rows_backend].run(views[0][:, :, :rows], views[1], views[2], opts)
        routed = ck.sol_attn(*(x.transpose(1, 2) for x in dense),
                             **SolOptions(exact_rows=False).kernel_kwargs(prefix))
    out = strided_out[0].view(6144, HEADS, 128)
    assert torch.equal(out[:rows], exact_rows[0].transpose(0, 1))
    assert torch.equal(out[rows:], routed[0, rows:])
