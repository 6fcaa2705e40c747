"""The fused kernels on the GPU (the only place the DiT uses them; `pytest -m gpu`): SwiGLU bitwise equal to eager
silu·up; the adaLN kernels within one bf16 rounding of an fp64 reference and closer to it than eager; the block's
strided views (fc2 reading SwiGLU's output, FA3 reading v of the qkv output) bitwise equal to dense copies. The CPU
twins (Triton's interpreter) are in test_fused_kernels.py."""

import pytest
import torch
import torch.nn.functional as F

from h3direct.dit import blocks, fused
from h3direct.dit.timesteps import ModRun
from h3direct.traces.metrics import bit_mismatch
from parity_tests.budgets import load_budgets

RATIO_K = load_budgets().rules["ratio_k_max"]

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_swiglu_bitwise(dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.randn(3001, 2 * 1536, generator=g) * 4).to("cuda", dtype)
    gate, up = a.chunk(2, dim=-1)
    want = F.silu(gate).mul(up)
    assert (diff := bit_mismatch(fused.swiglu_(a.clone()), want)) is None, diff


def _rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _adaln_case(g):
    """A bf16 stream with modulation runs (99 rows outside every run), its norm weight and one adaLN table."""
    s, d = 4099, 5376
    runs = [ModRun(0, 1000, 1), ModRun(1000, 3000, 0), ModRun(3000, 4000, 2)]  # 99 rows outside
    x = (torch.randn(s, d, generator=g) * 3).to("cuda", torch.bfloat16)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to("cuda", torch.bfloat16)
    table = torch.randn(3, 6, d, generator=g).cuda()
    shift, scale, gate = table[:, 0], 0.2 * table[:, 1], table[:, 2]
    return s, d, runs, x, w, shift, scale, gate


def test_fused_adaln_kernels_round_once():
    g = torch.Generator(device="cpu").manual_seed(1)
    s, d, runs, x, w, shift, scale, gate = _adaln_case(g)
    ref = F.rms_norm(x.double(), (d,), w.double(), 1e-6)
    for r in runs:
        ref[r.start:r.stop] = ref[r.start:r.stop] * (1 + scale[r.row].double()) + shift[r.row].double()
    ours = fused.norm_modulate(x, w, 1e-6, shift, scale, runs)
    eager = blocks.modulate_(F.rms_norm(x, (d,), w, 1e-6), shift, scale, runs)
    assert _rel(ours, ref) <= 1.05 * _rel(ref.bfloat16(), ref) and _rel(ours, ref) < _rel(eager, ref)
    upd = torch.randn(s, d, generator=g).to("cuda", torch.bfloat16)
    want = x.double().clone()
    for r in runs:
        want[r.start:r.stop] += upd[r.start:r.stop].double() * gate[r.row].double()
    res = fused.gated_residual_(x.clone(), gate, upd, runs)
    assert _rel(res, want) <= 1.05 * _rel(want.bfloat16(), want)
    assert torch.equal(res[4000:], x[4000:])


def test_fused_qk_norm_rope_rounds_once():
    from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table

    g = torch.Generator(device="cpu").manual_seed(2)
    s, heads, hd = 3001, 56, 128
    qkv = (torch.randn(s, 3 * heads * hd, generator=g) * 2).to("cuda", torch.bfloat16)
    wq, wk = ((1 + 0.3 * torch.randn(hd, generator=g)).to("cuda", torch.bfloat16) for _ in range(2))
    pos = torch.stack([torch.arange(s) // 300, torch.arange(s) // 20 % 15, torch.arange(s) % 20], -1).double()
    table = rotation_table(rope_angles(pos, 1.0 / 10000 ** (torch.arange(16) / 16)).cuda(), torch.bfloat16)
    src = qkv.clone()
    q, k, _ = (t.view(1, s, heads, hd) for t in qkv.chunk(3, dim=-1))
    fused.qk_norm_rope_(q, k, wq, wk, table, 1e-6)
    for part, w, i in ((q, wq, 0), (k, wk, 1)):
        x = src.chunk(3, dim=-1)[i].reshape(1, s, heads, hd)
        ref = rms_norm_rope(x.double(), w.double(), table.double(), 1e-6)
        assert _rel(part, ref) <= 1.05 * _rel(ref.bfloat16(), ref)
        assert _rel(part, ref) < _rel(rms_norm_rope(x, w, table, 1e-6), ref)
    assert torch.equal(qkv[:, 2 * heads * hd:], src[:, 2 * heads * hd:])


def test_full_width_mlp_takes_the_fused_swiglu(monkeypatch):
    """fc1's output at the full model's width (2 x 14,336 features, over MAX_HIDDEN) still goes through the fused
    SwiGLU: its kernel tiles columns, so the one-row-per-program limit of the norm kernels does not apply."""
    calls = []
    real = fused.swiglu_
    monkeypatch.setattr(fused, "swiglu_", lambda a: calls.append(a.shape) or real(a))
    mlp = blocks.MLP(256, 14336).to("cuda", torch.bfloat16)
    for lin in (mlp.fc1, mlp.fc2):
        torch.nn.init.normal_(lin.weight, std=0.02)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert 2 * 14336 > fused.MAX_HIDDEN
    mlp(x)
    assert calls == [torch.Size([64, 2 * 14336])]


def test_fused_residual_norm_is_the_two_kernels_and_config_free():
    """The attention's gated residual + norm2 + modulation in one kernel: bitwise gated_residual_ then norm_modulate
    (x and h), and the same bits for every launch config of the sweep (the sums of squares are exact)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    s, d, runs, x, w, shift, scale, gate = _adaln_case(g)
    upd = (torch.randn(s, d, generator=g) * 2).to("cuda", torch.bfloat16)
    want_x = fused.gated_residual_(x.clone(), gate, upd, runs)
    want_h = fused.norm_modulate(want_x, w, 1e-6, shift, scale, runs)
    for cfg in fused.SWEEP["residual_norm_modulate"]:
        got_x = x.clone()
        got_h = fused.residual_norm_modulate_(got_x, gate, upd, w, 1e-6, shift, scale, runs, config=cfg)
        assert bit_mismatch(got_x, want_x) is None and bit_mismatch(got_h, want_h) is None, cfg
    for cfg in fused.SWEEP["norm_modulate"]:
        got = fused.norm_modulate(want_x, w, 1e-6, shift, scale, runs, config=cfg)
        assert (diff := bit_mismatch(got, want_h)) is None, (cfg, diff)


def test_fc2_reads_the_strided_swiglu_output_without_a_copy():
    """The MLP hands fc2 SwiGLU's output as a [S, F] view with row stride 2F: the same bits as a dense input, and no
    hidden copy of it (the call's peak is its output plus cuBLAS's workspace, far below the input's size)."""
    g = torch.Generator(device="cpu").manual_seed(4)
    s, d, f = 8192, 1024, 7168  # a copy of the view would be 112 MiB, well above any cuBLAS workspace
    a = torch.randn(s, 2 * f, generator=g).to("cuda", torch.bfloat16)
    w2 = (torch.randn(d, f, generator=g) * 0.02).to("cuda", torch.bfloat16)
    view = a[:, :f]
    dense = F.linear(view.contiguous(), w2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    strided = F.linear(view, w2)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - strided.numel() * strided.element_size()
    assert (diff := bit_mismatch(strided, dense)) is None, diff
    assert extra < view.numel() * view.element_size() / 2, f"{extra / 2**20:.1f} MiB beyond the output"


def test_fa3_reads_a_strided_v(lane_backend):
    """The block passes FA3 q, k, v as strided views of the qkv projection output (v no longer copied): bitwise the
    result with a dense v."""
    from h3direct.dit.attention import attention

    g = torch.Generator(device="cpu").manual_seed(5)
    s, heads, hd = 3001, 8, 128
    qkv = torch.randn(s, 3 * heads * hd, generator=g).to("cuda", torch.bfloat16)
    lane_backend("fa3", qkv)
    q, k, v = (t.view(s, heads, hd).permute(1, 0, 2)[None] for t in qkv.chunk(3, dim=-1))
    dense_v = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not v.is_contiguous() and dense_v.stride() != v.stride()
    assert (diff := bit_mismatch(attention(q, k, v, "fa3"), attention(q, k, dense_v, "fa3"))) is None, diff


# ---- e4m3 rows for the FP8 linears ------------------------------------------------------------------------------

def _assert_quantized_rows(got, plain: torch.Tensor, what: str) -> None:
    """`got` (E4M3Rows, on the GPU) holds exactly what the per-row quantizer makes of `plain`: the Triton quantizer
    the FP8 linears ran on the stored bf16 output before (GPU), and the torch reference (CPU)."""
    from h3direct.checkpoint.quant import w8a8, w8a8_triton

    assert got.dtype == plain.dtype and got.data.shape == plain.shape, what
    codes, scales = got.data.view(torch.uint8), got.scale
    for where, (q, s) in (("gpu quantizer", w8a8_triton.quantize_rows(plain)),
                          ("cpu reference", w8a8.quantize_rows(plain.cpu()))):
        assert (diff := bit_mismatch(codes.to(q.device), q.view(torch.uint8))) is None, f"{what} {where} codes {diff}"
        assert (diff := bit_mismatch(scales.to(s.device), s)) is None, f"{what} {where} scales {diff}"


def test_fused_e4m3_rows_are_the_quantized_outputs():
    """The kernels that feed qkv_proj, fc1 and fc2, compiled, at the full model's widths (hidden 5,376, SwiGLU 14,336),
    every config of their sweep: the e4m3 rows they write are bitwise the quantized bf16 output of the plain kernels
    (rows inside and outside the modulation runs, all-zero rows); the residual kernel's x is the plain kernel's."""
    g = torch.Generator(device="cpu").manual_seed(6)
    s, d, runs, x, w, shift, scale, gate = _adaln_case(g)
    x[4050] = 0  # outside every run: an all-zero output row
    upd = (torch.randn(s, d, generator=g) * 2).to("cuda", torch.bfloat16)
    h = fused.norm_modulate(x, w, 1e-6, shift, scale, runs)
    want_x = x.clone()
    want_h = fused.residual_norm_modulate_(want_x, gate, upd, w, 1e-6, shift, scale, runs)
    for cfg in fused.SWEEP["norm_modulate_e4m3"]:
        _assert_quantized_rows(fused.norm_modulate(x, w, 1e-6, shift, scale, runs, e4m3=True, config=cfg), h,
                               f"norm_modulate {cfg}")
    for cfg in fused.SWEEP["residual_norm_modulate_e4m3"]:
        got_x = x.clone()
        got = fused.residual_norm_modulate_(got_x, gate, upd, w, 1e-6, shift, scale, runs, e4m3=True, config=cfg)
        assert (diff := bit_mismatch(got_x, want_x)) is None, (cfg, diff)
        _assert_quantized_rows(got, want_h, f"residual_norm_modulate_ {cfg}")
    a = (torch.randn(3001, 2 * 14336, generator=g) * 4).to("cuda", torch.bfloat16)
    a[7, :14336] = 0  # silu(0) = 0: an all-zero row
    y = fused.swiglu_(a.clone())
    for cfg in fused.SWEEP["swiglu_e4m3"]:
        src = a.clone()
        got = fused.swiglu_e4m3(src, config=cfg)
        assert torch.equal(src, a), cfg
        _assert_quantized_rows(got, y, f"swiglu_e4m3 {cfg}")


def _cuda_block(fp8: bool):
    """A DiT block on the GPU in bf16, widths multiples of 16 (so every FP8 GEMM is torch._scaled_mm), head_dim 128;
    fp8: its four block linears FP8 (resident e4m3 weights). With its inputs: x, t_emb, runs, rope table."""
    from fp8_blocks import make_fp8

    from h3direct.dit.rope import rope_angles, rotation_table

    torch.manual_seed(0)
    blk = blocks.DiTBlock(512, 4, 128, 1024, 16, 1e-6, 1e-6, curve=True)
    for p in blk.parameters():
        p.data = torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0)
    blk = blk.to("cuda", torch.bfloat16)
    if fp8:
        make_fp8(blk)
    g = torch.Generator(device="cpu").manual_seed(7)
    s = 1000
    x = torch.randn(s, 512, generator=g).to("cuda", torch.bfloat16)
    t_emb = torch.randn(1, 16, generator=g).to("cuda", torch.bfloat16)
    runs = [ModRun(0, 100, 1), ModRun(100, 300, 0), ModRun(300, 950, 2)]  # 50 rows outside
    pos = torch.stack([torch.arange(s) // 100, torch.arange(s) // 10 % 10, torch.arange(s) % 10], -1).double()
    table = rotation_table(rope_angles(pos, 1.0 / 10000 ** (torch.arange(16) / 16)).cuda(), torch.bfloat16)
    return blk, (x, t_emb, runs, table)


def test_dit_block_fp8_linears_take_e4m3_rows_on_cuda(monkeypatch):
    """The FP8 path of a block on the GPU: qkv_proj, fc1 and fc2 run torch._scaled_mm on the e4m3 rows the fused
    kernels write, out_proj quantizes the attention output itself; the block's output is bitwise that of the same
    block with every activation handed over as a bf16 tensor (fp8_blocks.e4m3_path_is_the_tensor_path).
    The option `fused` off: the eager path, no e4m3 rows. Both FP8 paths against the exact block (same weights, no
    FP8): the fused one, which quantizes fp32 rows where the eager one quantizes bf16 tensors, is held to the ratio
    rule (budgets.toml [rules] ratio_k_max) against the eager one's own error."""
    from fp8_blocks import e4m3_path_is_the_tensor_path

    from h3direct.counts import counting
    from h3direct.dit.options import KernelOptions, Options

    blk, inputs = _cuda_block(fp8=True)
    with torch.no_grad():
        ours = e4m3_path_is_the_tensor_path(blk, inputs, "scaled_mm")
        with counting() as calls:
            eager = blk(inputs[0].clone(), *inputs[1:], options=Options(kernels=KernelOptions(fused=False)))
        stats = calls.fp8_linear
    assert stats == {"scaled_mm": 4}, stats
    exact_blk, _ = _cuda_block(fp8=False)
    with torch.no_grad():
        exact = exact_blk(inputs[0].clone(), *inputs[1:]).double()
    e_fused, e_eager = _rel(ours, exact), _rel(eager, exact)
    assert eager.isfinite().all() and 0 < e_eager and e_fused <= RATIO_K * e_eager, (e_fused, e_eager)


def test_exact_block_runs_no_e4m3_kernel(monkeypatch):
    """Plain linears (the exact path) on the GPU, fused: no e4m3 output is made."""
    from fp8_blocks import refuse_e4m3_outputs

    blk, (x, t_emb, runs, table) = _cuda_block(fp8=False)
    refuse_e4m3_outputs(monkeypatch)
    with torch.no_grad():
        out = blk(x, t_emb, runs, table)
    assert out.isfinite().all()
