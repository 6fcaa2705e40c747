"""The Triton kernels of `h3direct/dit/fused.py`, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Each is checked against an fp64 reference of the same math: the fused kernels round once, so they must be at
least as close to it as ComfyUI's eager bf16 ops (three / two roundings) — and within one bf16 rounding of it.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from h3direct import triton_build
from h3direct.dit import blocks, fused
from h3direct.dit.timesteps import ModRun

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs Triton (the `test` extra installs it on x86_64 "
                                                              "Linux) to run the kernels in its CPU interpreter")

RUNS = [ModRun(0, 10, 1), ModRun(10, 45, 0), ModRun(45, 60, 2)]  # rows 60.. are outside every run


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _inputs(s, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(s, d, generator=g) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    # adaLN tensors as the block gets them: rows of a wider table (row stride 6·d), fp32 (curve adaLN) here
    table = torch.randn(3, 6, d, generator=g)
    shift, scale, gate = table[:, 0], 0.2 * table[:, 1], table[:, 2]
    return x, w, shift, scale, gate


def _ref_norm_modulate(x, w, eps, shift, scale, runs):
    ref = F.rms_norm(x.double(), (x.shape[-1],), w.double(), eps)
    for r in runs:
        ref[r.start:r.stop] = ref[r.start:r.stop] * (1 + scale[r.row].double()) + shift[r.row].double()
    return ref


def test_row_index_marks_rows_outside_every_run():
    idx = fused.row_index(RUNS, 70, "cpu")
    assert idx.dtype == torch.int32
    assert idx[0] == 1 and idx[9] == 1 and idx[10] == 0 and idx[59] == 2 and (idx[60:] == -1).all()
    assert fused.row_index(RUNS, 70, "cpu") is idx  # cached


@pytest.mark.parametrize("d", [64, 100, 5376])  # 100: a row shorter than its power-of-two block (masking)
def test_norm_modulate_rounds_once(d):
    x, w, shift, scale, _ = _inputs(70, d)
    ours = fused.norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    eager = blocks.modulate_(F.rms_norm(x, (d,), w, 1e-6), shift, scale, RUNS)
    ref = _ref_norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    one_rounding = _rel(ref.bfloat16(), ref)
    assert _rel(ours, ref) <= 1.05 * one_rounding, (_rel(ours, ref), one_rounding)
    assert _rel(ours, ref) < _rel(eager, ref)
    # rows outside every run: the plain norm (one rounding of it)
    assert _rel(ours[60:], ref[60:]) <= 1.05 * _rel(ref[60:].bfloat16(), ref[60:])


def test_norm_modulate_catches_a_wrong_row():
    """The check above can fail: the same kernel fed a wrong adaLN row for one run is far outside it."""
    x, w, shift, scale, _ = _inputs(70, 64)
    wrong = [ModRun(0, 10, 2), *RUNS[1:]]
    ref = _ref_norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    assert _rel(fused.norm_modulate(x, w, 1e-6, shift, scale, wrong), ref) > 20 * _rel(ref.bfloat16(), ref)


def test_norm_modulate_fp32():
    x, w, shift, scale, _ = _inputs(70, 96, dtype=torch.float32)
    ours = fused.norm_modulate(x, w, 1e-5, shift, scale, RUNS)
    assert ours.dtype == torch.float32
    assert _rel(ours, _ref_norm_modulate(x, w, 1e-5, shift, scale, RUNS)) < 1e-6


@pytest.mark.parametrize("d", [64, 100])
def test_gated_residual_in_place_rounds_once(d):
    x, _, _, _, gate = _inputs(70, d, seed=1)
    upd = torch.randn(70, d, generator=torch.Generator().manual_seed(2)).bfloat16()
    ref = x.double().clone()
    for r in RUNS:
        ref[r.start:r.stop] += upd[r.start:r.stop].double() * gate[r.row].double()
    eager = blocks.gated_residual_(x.clone(), gate, upd, RUNS)
    ours = x.clone()
    out = fused.gated_residual_(ours, gate, upd, RUNS)
    assert out.data_ptr() == ours.data_ptr()  # in place
    assert _rel(ours, ref) <= 1.05 * _rel(ref.bfloat16(), ref)
    assert _rel(ours, ref) <= _rel(eager, ref)
    assert torch.equal(ours[60:], x[60:])  # rows outside every run are not touched


def test_gated_residual_catches_a_wrong_row():
    x, _, _, _, gate = _inputs(70, 64, seed=1)
    upd = torch.randn(70, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    right = fused.gated_residual_(x.clone(), gate, upd, RUNS)
    wrong = fused.gated_residual_(x.clone(), gate, upd, [ModRun(0, 10, 0), *RUNS[1:]])
    assert _rel(wrong, right.double()) > 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_in_place_on_the_gate_half(dtype):
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(37, 2 * 1100, generator=g) * 4).to(dtype)  # F = 1100: a partial last block
    gate, up = a.clone().chunk(2, dim=-1)
    want = F.silu(gate).mul_(up)
    buf = a.clone()
    got = fused.swiglu_(buf)
    assert got.shape == want.shape and got.stride() == (2 * 1100, 1) and got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:, 1100:], a[:, 1100:])  # the up half is left as it was
    # the interpreter's exp is numpy's, not CUDA's expf: equal up to one rounding of the last op
    assert (got.float() - want.float()).abs().max() <= (want.float().abs() * 2 ** -7).max()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _block(hidden=64, heads=2, head_dim=32, ffn=96, t_dim=16, seed=0):
    torch.manual_seed(seed)
    blk = blocks.DiTBlock(hidden, heads, head_dim, ffn, t_dim, 1e-6, 1e-6, curve=True)
    for p in blk.parameters():
        p.data = torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0)
    return blk


def test_dit_block_fused_path_matches_eager(monkeypatch):
    """The whole block with the fused kernels (forced on for CPU tensors) vs its eager path and an fp64 run."""
    from h3direct.dit.rope import rope_angles, rotation_table

    blk = _block()
    s = 70
    x = torch.randn(s, 64, generator=torch.Generator().manual_seed(5))
    t_emb = torch.randn(1, 16, generator=torch.Generator().manual_seed(6))
    runs = [ModRun(0, 20, 1), ModRun(20, 50, 0), ModRun(50, 70, 2)]
    pos = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    angles = rope_angles(pos.reshape(-1, 3).double(), 1.0 / 100 ** (torch.arange(5) / 5))
    with torch.no_grad():
        ref = blk.double()(x.double(), t_emb.double(), runs, rotation_table(angles, torch.float64))
        blk = blk.bfloat16()
        table = rotation_table(angles, torch.bfloat16)
        eager = blk(x.bfloat16(), t_emb.bfloat16(), runs, table)
        monkeypatch.setattr(fused, "enabled", lambda t, whole_rows=True, on=True: True)
        ours = blk(x.bfloat16(), t_emb.bfloat16(), runs, table)
    assert _rel(ours, ref) < 1.25 * _rel(eager, ref), (_rel(ours, ref), _rel(eager, ref))
    assert _rel(ours, eager.double()) < 2e-2


def test_mlp_frees_its_input_after_fc1_and_keeps_eager_numbers():
    blk = _block()
    h = torch.randn(70, 64).bfloat16()
    blk = blk.bfloat16()
    with torch.no_grad():
        gate, up = blk.mlp.fc1(h).chunk(2, dim=-1)
        old = blk.mlp.fc2(F.silu(gate) * up)  # the out-of-place SwiGLU of before
        seen = []
        alive = weakref.ref(h)
        hook = blk.mlp.fc2.register_forward_pre_hook(lambda m, args: seen.append(gc.collect() >= 0 and alive()))
        box = [h]
        del h
        new = blk.mlp.forward_taking(box)
        hook.remove()
    assert box == [] and seen == [None]  # the input was gone before fc2 ran
    assert torch.equal(new, old)  # eager: the same two roundings, in place


def test_dense_rows_copies_only_strided_v():
    from h3direct.dit.attention import dense_rows

    qkv = torch.randn(10, 3 * 4 * 8)
    v = qkv[:, 64:].view(10, 4, 8).permute(1, 0, 2)[None]  # [1, H, S, D] view, row stride 3·H·D
    d = dense_rows(v)
    assert torch.equal(d, v) and d.stride() == (320, 8, 32, 1)
    assert dense_rows(d) is d


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_kernels_compile_for_hopper(dtype, monkeypatch):
    """Compiled mode (what the GPU runs), without a GPU: each kernel lowers to sm_90 code (catches Triton front-end
    and type errors that the interpreter lets through)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3direct.checkpoint.quant.w8a8_triton import device_functions

    monkeypatch.delenv("TRITON_INTERPRET")
    tr = fused.triton
    quant, encode = device_functions()
    plain = {"E4M3": False, "QUANT": None, "ENCODE": None}
    e4m3 = {"E4M3": True, "QUANT": quant, "ENCODE": encode}
    swiglu_sig = {"a_ptr": f"*{dtype}", "q_ptr": "*u8", "qs_ptr": "*fp32", "S": "i32", "F": "i32", "stride_a": "i32",
                  "ROWS": "constexpr", "BLOCK": "constexpr", "ROUND": "constexpr", "LIBDEVICE": "constexpr",
                  "E4M3": "constexpr", "QUANT": "constexpr", "ENCODE": "constexpr", "INTERPRET": "constexpr"}
    try:
        tr.compile(ASTSource(tr.jit(fused._swiglu_kernel), {**swiglu_sig, "a_ptr": "*bf16"},
                             {"ROWS": 1, "BLOCK": 1024, "ROUND": 2, "LIBDEVICE": True, "INTERPRET": False, **plain}),
                   target=GPUTarget("cuda", 90, 32), options=triton_build.FP_OPTIONS)
    except (RuntimeError, FileNotFoundError, ImportError) as exc:  # no CUDA toolchain in this Triton install
        if "ptxas" in str(exc) or "CUDA" in str(exc) or isinstance(exc, (FileNotFoundError, ImportError)):
            pytest.skip(f"Triton cannot compile for CUDA here: {str(exc).splitlines()[0]}")
        raise
    ptr = "i32"
    round_code = fused._ROUND[getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype])]
    norm_sig = {"x_ptr": f"*{dtype}", "w_ptr": "*bf16", "shift_ptr": "*fp32", "scale_ptr": "*fp32",
                "idx_ptr": "*i32", "out_ptr": f"*{dtype}", "u_ptr": f"*{dtype}", "g_ptr": "*fp32", "q_ptr": "*u8",
                "qs_ptr": "*fp32", "S": ptr, "D": ptr, "stride_x": ptr, "stride_o": ptr, "stride_u": ptr,
                "stride_shift": ptr, "stride_scale": ptr, "stride_g": ptr, "eps": "fp32", "ROWS": "constexpr",
                "BLOCK": "constexpr", "RESIDUAL": "constexpr", "EXACT": "constexpr", "BF16_INT": "constexpr",
                "INTERPRET": "constexpr", "E4M3": "constexpr", "QUANT": "constexpr", "ENCODE": "constexpr"}
    norm = {"BF16_INT": False, "INTERPRET": False}
    kernels = [
        (fused._norm_modulate_kernel, norm_sig,
         {"ROWS": 1, "BLOCK": 8192, "RESIDUAL": False, "EXACT": True, **norm, **plain}),
        (fused._norm_modulate_kernel, norm_sig,  # the fp32-sum variant the sweep times for comparison
         {"ROWS": 1, "BLOCK": 8192, "RESIDUAL": False, "EXACT": False, **norm, **plain}),
        (fused._norm_modulate_kernel, norm_sig,  # the residual + norm kernel, several rows per program
         {"ROWS": 2, "BLOCK": 8192, "RESIDUAL": True, "EXACT": True, **norm, **plain}),
        (fused._norm_modulate_kernel, norm_sig,  # both norm kernels writing e4m3 rows for the FP8 linears
         {"ROWS": 1, "BLOCK": 8192, "RESIDUAL": False, "EXACT": True, **norm, **e4m3}),
        (fused._norm_modulate_kernel, norm_sig,
         {"ROWS": 2, "BLOCK": 8192, "RESIDUAL": True, "EXACT": True, **norm, **e4m3}),
        (fused._gated_residual_kernel,
         {"x_ptr": f"*{dtype}", "u_ptr": f"*{dtype}", "g_ptr": "*bf16", "idx_ptr": "*i32", "S": ptr, "D": ptr,
          "stride_x": ptr, "stride_u": ptr, "stride_g": ptr, "ROWS": "constexpr", "BLOCK": "constexpr",
          "BF16_INT": "constexpr"},
         {"ROWS": 2, "BLOCK": 2048, "BF16_INT": False}),
        (fused._swiglu_kernel, swiglu_sig,
         {"ROWS": 2, "BLOCK": 1024, "ROUND": round_code, "LIBDEVICE": True, "INTERPRET": False, **plain}),
        (fused._swiglu_kernel, swiglu_sig,  # whole rows of the full model's 14,336 features, e4m3 rows out
         {"ROWS": 1, "BLOCK": 16384, "ROUND": round_code, "LIBDEVICE": True, "INTERPRET": False, **e4m3}),
        (fused._qk_norm_rope_kernel,
         {"x_ptr": f"*{dtype}", "wq_ptr": "*bf16", "wk_ptr": "*bf16", "t_ptr": f"*{dtype}", "H": ptr, "HQ": ptr,
          "R": ptr, "stride_xs": ptr, "stride_xh": ptr, "stride_ts": ptr, "stride_tj": ptr, "stride_ta": ptr,
          "stride_tb": ptr, "eps": "fp32", "D": "constexpr", "HB": "constexpr", "EXACT": "constexpr",
          "BF16_INT": "constexpr", "INTERPRET": "constexpr"},
         {"D": 128, "HB": 8, "EXACT": True, "BF16_INT": False, "INTERPRET": False}),
    ]
    for fn, sig, const in kernels:
        k = tr.compile(ASTSource(tr.jit(fn), sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8, **triton_build.FP_OPTIONS})
        assert ".target sm_90" in k.asm["ptx"]
        # e4m3 rows: the GPU's e4m3 conversion and IEEE division, as the FP8 linears' quantizer
        assert const.get("E4M3", False) == ("cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"] and "div.rn.f32" in k.asm["ptx"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,head_dim,rot_pairs", [(3, 32, 12), (9, 128, 48), (2, 64, 32)])
def test_qk_norm_rope_in_place(dtype, heads, head_dim, rot_pairs):
    """q/k RMSNorm + partial split-half rope in one pass on views of a qkv buffer, vs an fp64 run of the eager form;
    9 heads: a partial head block; 30 pairs of 64 dims: only 4 dims pass through."""
    from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table

    g = torch.Generator().manual_seed(7)
    s = 40
    qkv = (torch.randn(s, 3 * heads * head_dim, generator=g) * 2).to(dtype)
    wq, wk = ((1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2))
    pos = torch.stack([torch.arange(s) // 20, torch.arange(s) // 5 % 4, torch.arange(s) % 5], -1).double()
    inv = 1.0 / 1000 ** (torch.arange(rot_pairs // 3) / (rot_pairs // 3))
    angles = rope_angles(pos, inv.float())
    table = rotation_table(angles, dtype)
    before = qkv.clone()
    q, k, _ = (t.view(1, s, heads, head_dim) for t in qkv.chunk(3, dim=-1))
    fused.qk_norm_rope_(q, k, wq, wk, table, 1e-6)
    for part, w, i in ((q, wq, 0), (k, wk, 1)):
        src = before.chunk(3, dim=-1)[i].reshape(1, s, heads, head_dim)
        ref = rms_norm_rope(src.double(), w.double(), table.double(), 1e-6)  # the same table values, in fp64
        eager = rms_norm_rope(src, w, table, 1e-6)
        if dtype == torch.float32:
            assert _rel(part, ref) < 1e-6
        else:
            assert _rel(part, ref) <= 1.05 * _rel(ref.bfloat16(), ref)
            assert _rel(part, ref) < _rel(eager, ref)
    assert torch.equal(qkv[:, 2 * heads * head_dim:], before[:, 2 * heads * head_dim:])  # v untouched


def test_qk_norm_rope_catches_a_wrong_table_row():
    from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table

    s, heads, head_dim = 16, 2, 32
    qkv = torch.randn(s, 3 * heads * head_dim, generator=torch.Generator().manual_seed(8)).bfloat16()
    w = torch.ones(head_dim).bfloat16()
    pos = torch.stack([torch.zeros(s), torch.arange(s) / 2, torch.arange(s) % 3], -1).double()
    table = rotation_table(rope_angles(pos, torch.tensor([1.0, 0.5, 0.25, 0.125])), torch.bfloat16)
    ref = rms_norm_rope(qkv[:, :heads * head_dim].reshape(1, s, heads, head_dim).double(), w.double(),
                        table.double(), 1e-6)
    q, k, _ = (t.view(1, s, heads, head_dim) for t in qkv.chunk(3, dim=-1))
    fused.qk_norm_rope_(q, k, w, w, table.roll(1, dims=1), 1e-6)  # each row rotated by its neighbour's angles
    assert _rel(q, ref) > 20 * _rel(ref.bfloat16(), ref)


# ---- the attention's gated residual + norm2 + modulation in one pass; launch configs -----------------------------

def _tiles(kernel: str) -> list[dict]:
    """The distinct tile shapes of a kernel in the launch tables and the sweep (the interpreter ignores num_warps), the
    default table's first."""
    seen, out = set(), []
    for cfg in [fused.DEFAULT_LAUNCH[kernel], *(t[kernel] for t in fused.LAUNCH.values()), *fused.SWEEP[kernel]]:
        tile, _ = fused._split(cfg)
        key = tuple(sorted(tile.items()))
        if key not in seen:
            seen.add(key)
            out.append(tile)
    return out


@pytest.mark.parametrize("d", [64, 100, 5376])
def test_residual_norm_modulate_is_the_two_kernels_bitwise(d):
    x, w, shift, scale, gate = _inputs(70, d, seed=4)
    upd = (torch.randn(70, d, generator=torch.Generator().manual_seed(9)) * 2).bfloat16()
    want_x = fused.gated_residual_(x.clone(), gate, upd, RUNS)
    want_h = fused.norm_modulate(want_x, w, 1e-6, shift, scale, RUNS)
    got_x = x.clone()
    got_h = fused.residual_norm_modulate_(got_x, gate, upd, w, 1e-6, shift, scale, RUNS)
    assert torch.equal(got_x, want_x) and torch.equal(got_h, want_h)
    assert torch.equal(got_x[60:], x[60:])  # rows outside every run: x untouched, h = their plain norm
    # and against fp64 / eager as the single kernels are judged
    ref_x = x.double().clone()
    for r in RUNS:
        ref_x[r.start:r.stop] += upd[r.start:r.stop].double() * gate[r.row].double()
    assert _rel(got_x, ref_x) <= 1.05 * _rel(ref_x.bfloat16(), ref_x)
    ref_h = _ref_norm_modulate(got_x, w, 1e-6, shift, scale, RUNS)
    eager_x = blocks.gated_residual_(x.clone(), gate, upd, RUNS)
    eager_h = blocks.modulate_(F.rms_norm(eager_x, (d,), w, 1e-6), shift, scale, RUNS)
    assert _rel(got_h, ref_h) <= 1.05 * _rel(ref_h.bfloat16(), ref_h)
    assert _rel(got_h, ref_h) < _rel(eager_h, ref_h)


def test_residual_norm_modulate_catches_a_wrong_gate_row():
    x, w, shift, scale, gate = _inputs(70, 64, seed=4)
    upd = torch.randn(70, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    right = fused.residual_norm_modulate_(x.clone(), gate, upd, w, 1e-6, shift, scale, RUNS)
    wrong = fused.residual_norm_modulate_(x.clone(), gate.roll(1, dims=0), upd, w, 1e-6, shift, scale, RUNS)
    assert _rel(wrong, right.double()) > 0.05


def test_norm_sum_of_squares_is_order_free():
    """The sum of squares is exact: permuting a row's features (with the weight and the adaLN tables) permutes the
    output bit for bit — an fp32 sum in another order would move some roundings. Wide dynamic range on purpose."""
    x, w, shift, scale, _ = _inputs(70, 1000, seed=11)
    x = (x.float() * torch.logspace(-4, 3, 1000)[torch.randperm(1000, generator=torch.Generator().manual_seed(1))]
         ).bfloat16()
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(12))
    h = fused.norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    hp = fused.norm_modulate(x[:, perm].contiguous(), w[perm], 1e-6, shift[:, perm], scale[:, perm], RUNS)
    assert torch.equal(hp, h[:, perm])
    ref = _ref_norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    assert _rel(h, ref) <= 1.05 * _rel(ref.bfloat16(), ref)


def test_launch_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown key 'BLOK'"):
        fused.launch_config("swiglu", {"BLOK": 512})
    assert fused.launch_config("swiglu", {"num_warps": 2})["num_warps"] == 2
    for table in (fused.DEFAULT_LAUNCH, *fused.LAUNCH.values()):  # every table: every kernel, the same keys
        assert set(table) == set(fused.SWEEP)
        assert all(set(table[k]) == set(fused.DEFAULT_LAUNCH[k]) for k in table)


def test_launch_table_by_compute_capability(monkeypatch):
    """The Hopper entry on sm_90, the untuned default on any other GPU, on the CPU and without a device."""
    monkeypatch.setattr(triton_build, "capability", lambda index: (9, 0))
    assert fused.launch_table(torch.device("cuda", 0)) is fused.LAUNCH[(9, 0)]
    assert fused.launch_config("gated_residual", device=torch.device("cuda", 0)) == fused.LAUNCH[(9, 0)][
        "gated_residual"]
    monkeypatch.setattr(triton_build, "capability", lambda index: (12, 1))
    assert fused.launch_table(torch.device("cuda", 0)) is fused.DEFAULT_LAUNCH
    assert fused.launch_table(torch.device("cpu")) is fused.DEFAULT_LAUNCH
    assert fused.launch_table() is fused.DEFAULT_LAUNCH


def test_norm_kernels_give_the_same_bits_for_every_config():
    x, w, shift, scale, gate = _inputs(67, 100, seed=13)  # 67 rows: a partial row block for ROWS 2 and 4
    upd = torch.randn(67, 100, generator=torch.Generator().manual_seed(14)).bfloat16()
    runs = [ModRun(0, 10, 1), ModRun(10, 45, 0), ModRun(45, 60, 2)]
    tiles = _tiles("norm_modulate")
    assert len(tiles) >= 2
    outs = [fused.norm_modulate(x, w, 1e-6, shift, scale, runs, config=t) for t in tiles]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    tiles = _tiles("residual_norm_modulate")
    assert len(tiles) >= 2
    pairs = []
    for t in tiles:
        xx = x.clone()
        pairs.append((xx, fused.residual_norm_modulate_(xx, gate, upd, w, 1e-6, shift, scale, runs, config=t)))
    assert all(torch.equal(a, pairs[0][0]) and torch.equal(b, pairs[0][1]) for a, b in pairs[1:])


def test_gated_residual_and_swiglu_give_the_same_bits_for_every_config():
    x, _, _, _, gate = _inputs(67, 1100, seed=15)  # 1100 columns: partial column blocks of 1024 and 2048
    upd = torch.randn(67, 1100, generator=torch.Generator().manual_seed(16)).bfloat16()
    tiles = _tiles("gated_residual")
    assert len(tiles) >= 2
    outs = [fused.gated_residual_(x.clone(), gate, upd, RUNS, config=t) for t in tiles]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    a = (torch.randn(37, 2 * 1100, generator=torch.Generator().manual_seed(17)) * 4).bfloat16()
    tiles = _tiles("swiglu")
    assert len(tiles) >= 2
    outs = [fused.swiglu_(a.clone(), config=t) for t in tiles]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_qk_norm_rope_same_bits_for_every_config_and_either_launch():
    """Heads per program (HB) and one launch over q|k (views of one qkv buffer) vs one per tensor (separate
    tensors): the same bits."""
    from h3direct.dit.rope import rope_angles, rotation_table

    g = torch.Generator().manual_seed(18)
    s, heads, head_dim = 12, 9, 64
    qkv = (torch.randn(s, 3 * heads * head_dim, generator=g) * 2).bfloat16()
    wq, wk = ((1 + 0.3 * torch.randn(head_dim, generator=g)).bfloat16() for _ in range(2))
    pos = torch.stack([torch.arange(s) // 6, torch.arange(s) // 2 % 3, torch.arange(s) % 2], -1).double()
    table = rotation_table(rope_angles(pos, 1.0 / 100 ** (torch.arange(8) / 8)), torch.bfloat16)
    outs = []
    for t in _tiles("qk_norm_rope"):
        buf = qkv.clone()
        q, k, _ = (p.view(1, s, heads, head_dim) for p in buf.chunk(3, dim=-1))
        assert fused._k_follows_q(q, k)
        fused.qk_norm_rope_(q, k, wq, wk, table, 1e-6, config=t)
        outs.append(buf)
    assert len(outs) >= 2 and all(torch.equal(o, outs[0]) for o in outs[1:])
    q, k = (qkv[:, i * heads * head_dim:(i + 1) * heads * head_dim].clone().view(1, s, heads, head_dim)
            for i in range(2))
    assert not fused._k_follows_q(q, k)
    fused.qk_norm_rope_(q, k, wq, wk, table, 1e-6)
    assert torch.equal(q.view(s, -1), outs[0][:, :heads * head_dim])
    assert torch.equal(k.view(s, -1), outs[0][:, heads * head_dim:2 * heads * head_dim])


def test_dit_block_fused_residual_norm_is_the_two_kernels(monkeypatch):
    """The block's fused path (residual + norm2 in one kernel) gives the bits of the same block with that pass split
    back into gated_residual_ then norm_modulate."""
    from h3direct.dit.rope import rope_angles, rotation_table

    blk = _block().bfloat16()
    s = 70
    x = torch.randn(s, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    t_emb = torch.randn(1, 16, generator=torch.Generator().manual_seed(6)).bfloat16()
    runs = [ModRun(0, 20, 1), ModRun(20, 50, 0), ModRun(50, 70, 2)]
    pos = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(5.0), torch.arange(7.0), indexing="ij"), -1)
    table = rotation_table(rope_angles(pos.reshape(-1, 3).double(), 1.0 / 100 ** (torch.arange(5) / 5)),
                           torch.bfloat16)
    monkeypatch.setattr(fused, "enabled", lambda t, whole_rows=True, on=True: True)
    calls = []
    real = fused.residual_norm_modulate_

    def split(x, gate, update, weight, eps, shift, scale, runs, e4m3=False):
        assert not e4m3  # plain linears: the bf16 h
        calls.append(x.shape)
        fused.gated_residual_(x, gate, update, runs)
        return fused.norm_modulate(x, weight, eps, shift, scale, runs)

    with torch.no_grad():
        ours = blk(x.clone(), t_emb, runs, table)
        monkeypatch.setattr(fused, "residual_norm_modulate_", split)
        two = blk(x.clone(), t_emb, runs, table)
    monkeypatch.setattr(fused, "residual_norm_modulate_", real)
    assert calls == [(s, 64)]
    assert torch.equal(ours, two)


def test_tune_kernels_smoke(tmp_path):
    """tools/tune_kernels.py in the interpreter on tiny shapes: every candidate runs and gives the current config's
    bits, the best is reported per kernel; a bad flag is a one-line error, exit 2."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "tune.json"
    cmd = [sys.executable, str(root / "tools" / "tune_kernels.py"), "--device", "cpu", "--small", "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([*cmd, "--kernels", "gated_residual,nvfp4_dequant"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["kernels"]) == {"gated_residual", "nvfp4_dequant"}
    for r in res["kernels"].values():
        assert r["ok"] and all(c["bits"] == "same" for c in r["configs"]) and r["best"] in [c["config"]
                                                                                             for c in r["configs"]]
    assert len(res["kernels"]["gated_residual"]["configs"]) >= len(fused.SWEEP["gated_residual"])
    bad = subprocess.run([*cmd, "--kernels", "nope"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "nope" in bad.stderr


def test_norms_propagate_inf_and_nan_as_eager(recwarn):  # recwarn: numpy's cast warnings
    """A row with an inf: NaN there and 0 elsewhere (inf·0); a row with a NaN: all NaN — as an fp32 sum gives."""
    x, w, shift, scale, _ = _inputs(70, 64, seed=19)
    x[1, 3], x[12, 5], x[13, 7], x[13, 9] = float("inf"), float("nan"), float("-inf"), float("nan")
    ours = fused.norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    eager = blocks.modulate_(F.rms_norm(x, (64,), w, 1e-6), shift, scale, RUNS)
    assert torch.equal(ours.isnan(), eager.isnan()) and ours[12].isnan().all() and ours[13].isnan().all()
    assert ours[1].isnan().sum() == 1 and torch.equal(ours[1][~ours[1].isnan()], eager[1][~eager[1].isnan()])
    fine = ~ours.isnan().any(dim=1)
    assert _rel(ours[fine], eager[fine].double()) < 1e-2


# ---- e4m3 rows for the FP8 linears: bitwise the per-row quantizer on the output the plain kernel stores ----------

def _assert_quantized_rows(got, plain: torch.Tensor, what: str) -> None:
    """`got` (E4M3Rows) holds exactly the codes and scales `w8a8.quantize_rows` (the torch reference) makes of
    `plain`, and the Triton quantizer the linear would run on it gives the same."""
    from h3direct.checkpoint.quant import w8a8, w8a8_triton
    from h3direct.traces.metrics import bit_mismatch

    assert got.dtype == plain.dtype and got.data.shape == plain.shape and got.data.is_contiguous(), what
    for q, s in (w8a8.quantize_rows(plain), w8a8_triton.quantize_rows(plain)):
        assert (diff := bit_mismatch(got.data.view(torch.uint8), q.view(torch.uint8))) is None, f"{what} codes {diff}"
        assert (diff := bit_mismatch(got.scale, s)) is None, f"{what} scales {diff}"


@pytest.mark.parametrize("d, dtype", [(64, torch.bfloat16), (100, torch.bfloat16), (5376, torch.bfloat16),
                                      (100, torch.float32)], ids=["64-bf16", "100-bf16", "5376-bf16", "100-fp32"])
def test_norm_kernels_e4m3_rows_are_the_quantized_output(d, dtype):
    """norm_modulate / residual_norm_modulate_ with e4m3=True: the e4m3 rows of the tensor the plain kernel returns
    (rows inside and outside the modulation runs, a zero row: scale 1), x updated in place with the same bits; every
    launch tile of the tables and the sweep for one shape (the others: the default tile)."""
    x, w, shift, scale, gate = _inputs(70, d, seed=20, dtype=dtype)
    x[66] = 0  # outside every run: plain norm of zeros, an all-zero output row
    upd = (torch.randn(70, d, generator=torch.Generator().manual_seed(21)) * 2).to(dtype)
    h = fused.norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    want_x = x.clone()
    want_h = fused.residual_norm_modulate_(want_x, gate, upd, w, 1e-6, shift, scale, RUNS)
    assert not h[66].any()
    every = d == 100 and dtype == torch.bfloat16
    for tile in _tiles("norm_modulate_e4m3")[:None if every else 1]:
        _assert_quantized_rows(fused.norm_modulate(x, w, 1e-6, shift, scale, RUNS, e4m3=True, config=tile), h,
                               f"norm_modulate {tile}")
    for tile in _tiles("residual_norm_modulate_e4m3")[:None if every else 1]:
        got_x = x.clone()
        got = fused.residual_norm_modulate_(got_x, gate, upd, w, 1e-6, shift, scale, RUNS, e4m3=True, config=tile)
        assert torch.equal(got_x, want_x), tile
        _assert_quantized_rows(got, want_h, f"residual_norm_modulate_ {tile}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_swiglu_e4m3_rows_are_the_quantized_output(dtype):
    """swiglu_e4m3: the e4m3 rows of what swiglu_ writes (a zero row included), fc1's output left as it was; every
    launch tile; F = 1100: a row shorter than its power-of-two block."""
    a = (torch.randn(37, 2 * 1100, generator=torch.Generator().manual_seed(22)) * 4).to(dtype)
    a[5, :1100] = 0  # silu(0) = 0: an all-zero row
    want = fused.swiglu_(a.clone())
    assert not want[5].any()
    for tile in _tiles("swiglu_e4m3"):
        src = a.clone()
        got = fused.swiglu_e4m3(src, config=tile)
        assert torch.equal(src, a), tile
        _assert_quantized_rows(got, want, f"swiglu_e4m3 {tile}")
    with pytest.raises(ValueError, match="one row per program"):
        fused.swiglu_e4m3(torch.zeros(2, 2 * (fused.MAX_HIDDEN + 16), dtype=dtype))


def test_e4m3_rows_catch_a_wrong_row():
    """The bitwise checks above can fail: the kernel fed a wrong adaLN row for one run gives other codes there."""
    from h3direct.checkpoint.quant import w8a8

    x, w, shift, scale, _ = _inputs(70, 64, seed=23)
    h = fused.norm_modulate(x, w, 1e-6, shift, scale, RUNS)
    got = fused.norm_modulate(x, w, 1e-6, shift, scale, [ModRun(0, 10, 2), *RUNS[1:]], e4m3=True)
    q, _ = w8a8.quantize_rows(h)
    differs = (got.data.view(torch.uint8) != q.view(torch.uint8)).any(dim=1)
    assert differs[:10].all() and not differs[10:].any()


def _block_inputs(s=70, hidden=64):
    from h3direct.dit.rope import rope_angles, rotation_table

    frames = s // 35  # 35 rows a frame (5 x 7), s a multiple of 35
    x = torch.randn(s, hidden, generator=torch.Generator().manual_seed(5)).bfloat16()
    t_emb = torch.randn(1, 16, generator=torch.Generator().manual_seed(6)).bfloat16()
    runs = [ModRun(0, 10 * frames, 1), ModRun(10 * frames, 25 * frames, 0), ModRun(25 * frames, s, 2)]
    pos = torch.stack(torch.meshgrid(torch.arange(float(frames)), torch.arange(5.0), torch.arange(7.0),
                                     indexing="ij"), -1)
    table = rotation_table(rope_angles(pos.reshape(-1, 3).double(), 1.0 / 100 ** (torch.arange(5) / 5)),
                           torch.bfloat16)
    return x, t_emb, runs, table


def test_dit_block_fp8_linears_take_e4m3_rows_bitwise(monkeypatch):
    """The fused block with FP8 block linears: qkv_proj, fc1 and fc2 get e4m3 rows from the kernels, out_proj
    quantizes the attention output itself; the block's output is bitwise that of the same block with every
    activation handed over as a tensor (fp8_blocks.e4m3_path_is_the_tensor_path). A hook on the MLP, or row chunks,
    hand fc1 a tensor."""
    from fp8_blocks import e4m3_path_is_the_tensor_path, make_fp8

    from h3direct.counts import counting
    from h3direct.dit.options import KernelOptions, Options

    blk = make_fp8(_block().bfloat16())
    inputs = _block_inputs(35)  # one frame: three modulation runs all the same
    monkeypatch.setattr(fused, "enabled", lambda t, whole_rows=True, on=True: on)
    with torch.no_grad():
        ours = e4m3_path_is_the_tensor_path(blk, inputs, "emulated (cpu)")
        hook = blk.mlp.register_forward_hook(lambda m, args, out: None)
        try:
            with counting() as calls:
                mlp_hooked = blk(inputs[0].clone(), *inputs[1:])
            assert calls.fp8_linear == {"emulated (cpu), e4m3 input": 2, "emulated (cpu)": 2}
        finally:
            hook.remove()
        # row chunks of 16 (not 64: the interpreter's time grows with the rows): the 35 rows in two chunks, each fc1
        # call a tensor
        monkeypatch.setattr(blocks.MLP, "CHUNK_ALIGN", 16)
        with counting() as calls:
            chunked = blk(inputs[0].clone(), *inputs[1:], options=Options(kernels=KernelOptions(mlp_chunks=2)))
        assert calls.fp8_linear == {"emulated (cpu), e4m3 input": 3, "emulated (cpu)": 3}  # qkv, fc2 x 2; out, fc1 x 2
        assert chunked.isfinite().all()
        # the chunked MLP is the whole one, bit for bit (per-row scales: rows do not see each other)
        h = torch.randn(35, blk.mlp.fc1.in_features, generator=torch.Generator().manual_seed(9)).bfloat16()
        assert torch.equal(blk.mlp(h, chunks=2), blk.mlp(h))
    assert torch.equal(ours, mlp_hooked)


def test_plain_linears_never_see_e4m3_rows(monkeypatch):
    """The exact path (plain linears), fused: no e4m3 kernel runs, whatever else is on."""
    from fp8_blocks import refuse_e4m3_outputs

    blk = _block().bfloat16()
    x, t_emb, runs, table = _block_inputs()
    monkeypatch.setattr(fused, "enabled", lambda t, whole_rows=True, on=True: True)
    refuse_e4m3_outputs(monkeypatch)
    with torch.no_grad():
        out = blk(x, t_emb, runs, table)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
