"""The Triton GEMM of `h3direct/dit/gemm_triton.py` and its fused epilogues, run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1), against fp64 references of the same math (blocks.py / rope.py definitions).

Each fused result is rounded once from fp32, so it must lie within one bf16 rounding of the fp64 reference
(rel-L2 ≤ 1.05x that of rounding the reference itself) and closer to it than the eager bf16 chain (GEMM output
rounded, then the elementwise ops rounding again). Every load path runs: TMA descriptors and plain pointers,
one program per tile and persistent. Each check also gets a wrong input and must fail it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3direct.checkpoint.quant import nvfp4
from h3direct.dit import blocks, fused, gemm_triton, rope
from h3direct.dit.timesteps import ModRun

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs Triton (the `test` extra installs it on x86_64 "
                                                              "Linux) to run the kernels in its CPU interpreter")

Config = gemm_triton.Config
# small tiles so that the test shapes span several tiles and partial ones; every load path / loop kind
CONFIGS = [pytest.param(Config(bm=32, bn=64, bk=32, group_m=2, tma=tma, persistent=pers), id=f"{kind}-{name}")
           for tma, kind in ((True, "tma"), (False, "ptr")) for pers, name in ((False, "tiles"), (True, "persistent"))]
CONFIGS.append(pytest.param(Config(bm=32, bn=64, bk=32, tma_store=False), id="tma-loads-pointer-stores"))
RUNS = [ModRun(0, 10, 1), ModRun(10, 45, 0), ModRun(45, 60, 2)]  # rows 60.. are outside every run


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _one_rounding(ref) -> float:
    return _rel(ref.bfloat16(), ref)


def _randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(70, 160, 96), (33, 64, 256)], ids=["partial-tiles", "one-column"])
def test_linear_rounds_once(cfg, m, n, k):
    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2, scale=0.1)
    ref = x.double() @ w.double().T
    y = gemm_triton.linear(x, w, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) <= 1.05 * _one_rounding(ref), (_rel(y, ref), _one_rounding(ref))


def test_linear_k_not_a_multiple_of_the_tile():
    """Pointer loads mask the K tail (K = 100: 3 full tiles of 32 and a partial one)."""
    x, w = _randn(40, 100, seed=3), _randn(70, 100, seed=4)
    ref = x.double() @ w.double().T
    y = gemm_triton.linear(x, w, Config(bm=32, bn=64, bk=32, tma=False))
    assert _rel(y, ref) <= 1.05 * _one_rounding(ref)
    with pytest.raises(ValueError, match="16-byte"):  # 200-byte rows: no TMA descriptor
        gemm_triton.linear(x, w, Config(bm=32, bn=64, bk=32, tma=True))


def test_linear_catches_a_wrong_operand():
    x, w = _randn(40, 64, seed=5), _randn(64, 64, seed=6)
    ref = x.double() @ w.double().T
    w_bad = w.clone()
    w_bad[3, 7] += 4.0
    y = gemm_triton.linear(x, w_bad, Config(bm=32, bn=64, bk=32))
    assert _rel(y, ref) > 5 * _one_rounding(ref)


# ---- fc1 + SwiGLU ---------------------------------------------------------------------------------------------

def _swiglu_ref(x, w):
    a = x.double() @ w.double().T
    gate, up = a.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("cfg", CONFIGS)
def test_linear_swiglu_matches_blocks_mlp(cfg):
    f = 96  # 2F = 192 = 3 tiles of 64
    x, w = _randn(70, 64, seed=7), _randn(2 * f, 64, seed=8, scale=0.2)
    ref = _swiglu_ref(x, w)
    ours = gemm_triton.linear_swiglu(x, gemm_triton.interleave_gate_up(w), cfg)
    assert ours.shape == (70, f) and ours.is_contiguous()
    # the eager chain of blocks.MLP: fc1 output rounded, silu rounded, product rounded
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    eager = F.silu(gate) * up
    assert _rel(ours, ref) <= 1.05 * _one_rounding(ref), (_rel(ours, ref), _one_rounding(ref))
    assert _rel(ours, ref) < _rel(eager, ref)


def test_linear_swiglu_needs_the_interleaved_weight():
    x, w = _randn(40, 64, seed=9), _randn(128, 64, seed=10, scale=0.2)
    ref = _swiglu_ref(x, w)
    assert _rel(gemm_triton.linear_swiglu(x, w, Config(bm=32, bn=64, bk=32)), ref) > 0.5


def test_gate_up_interleave_of_nvfp4_rows_is_exact():
    """Permuting the packed rows and (through the unswizzled layout) their block-scale rows before dequantisation
    gives exactly the interleaved dense weight."""
    f, k = 80, 64  # 160 rows: two swizzle row tiles of 128, the second partial
    q = nvfp4.quantize_nvfp4(_randn(2 * f, k, seed=11).float())
    packed, scales = gemm_triton.interleave_gate_up_nvfp4(q.packed, q.block_scale, 2 * f)
    assert scales.shape == q.block_scale.shape and scales.dtype == q.block_scale.dtype
    dense = nvfp4.dequantize_nvfp4(q.packed, q.block_scale, q.global_scale)
    permuted = nvfp4.dequantize_nvfp4(packed, scales, q.global_scale)
    assert torch.equal(permuted, gemm_triton.interleave_gate_up(dense))
    assert torch.equal(permuted[1::2], dense[f:])  # odd rows: up
    # the raw swizzled scale rows permuted as if row-major would not be
    wrong = q.block_scale.view(torch.uint8)[gemm_triton.gate_up_order(f)[:128]]
    assert not torch.equal(wrong, scales.view(torch.uint8)[:128])


# ---- out_proj / fc2 + gated residual --------------------------------------------------------------------------

def _gated_inputs(m=70, n=64, k=128, seed=12):
    stream = _randn(m, n, seed=seed, scale=3.0)
    gate = torch.randn(3, 6, n, generator=torch.Generator().manual_seed(seed + 1))[:, 2]  # rows of a wider table
    # fc2's input as the block hands it: the SwiGLU result written over fc1's gate half (row stride 2k)
    a = _randn(m, 2 * k, seed=seed + 2)[:, :k]
    w = _randn(n, k, seed=seed + 3, scale=0.1)
    return stream, gate, a, w


def _gated_ref(stream, gate, a, w, runs):
    ref = stream.double().clone()
    upd = a.double() @ w.double().T
    for r in runs:
        ref[r.start:r.stop] += upd[r.start:r.stop] * gate[r.row].double()
    return ref


@pytest.mark.parametrize("cfg", CONFIGS)
def test_linear_gated_residual_rounds_once(cfg):
    stream, gate, a, w = _gated_inputs()
    ref = _gated_ref(stream, gate, a, w, RUNS)
    eager = blocks.gated_residual_(stream.clone(), gate, F.linear(a, w), RUNS)
    ours = stream.clone()
    assert gemm_triton.linear_gated_residual_(ours, a, w, gate, RUNS, cfg) is ours
    assert torch.equal(ours[60:], stream[60:])  # rows outside every run: untouched
    live = slice(0, 60)
    assert _rel(ours[live], ref[live]) <= 1.05 * _one_rounding(ref[live]), (_rel(ours[live], ref[live]),
                                                                             _one_rounding(ref[live]))
    assert _rel(ours[live], ref[live]) < _rel(eager[live], ref[live])


def test_linear_gated_residual_catches_a_wrong_row():
    stream, gate, a, w = _gated_inputs()
    ref = _gated_ref(stream, gate, a, w, RUNS)
    ours = gemm_triton.linear_gated_residual_(stream.clone(), a, w, gate, [ModRun(0, 10, 2), *RUNS[1:]],
                                              Config(bm=32, bn=64, bk=32))
    assert _rel(ours[:60], ref[:60]) > 5 * _one_rounding(ref[:60])


# ---- qkv + q/k RMSNorm + rope ---------------------------------------------------------------------------------

def _qk_inputs(s, heads, dim, rot_pairs, k=64, seed=20):
    x, w = _randn(s, k, seed=seed), _randn(3 * heads * dim, k, seed=seed + 1, scale=0.2)
    qw, kw = (1 + 0.3 * _randn(dim, seed=seed + 2).float()).bfloat16(), (1 + 0.3 * _randn(dim, seed=seed + 3)
                                                                         .float()).bfloat16()
    if rot_pairs % 3 == 0:  # the model's 3-axis angles
        pos = torch.stack([torch.arange(s) // 12, (torch.arange(s) // 4) % 3, torch.arange(s) % 4], 1).double()
        inv_freq = 1.0 / (100.0 ** (torch.arange(rot_pairs // 3) / (rot_pairs // 3)))
        angles = rope.rope_angles(pos, inv_freq.float())
    else:  # any R (e.g. the whole head rotating)
        angles = 6 * torch.rand(s, 2 * rot_pairs, generator=torch.Generator().manual_seed(seed + 4))
    table = rope.rotation_table(angles, torch.bfloat16)
    assert table.shape[-3] == rot_pairs
    return x, w, qw, kw, table


def _qk_ref(x, w, qw, kw, table, eps, heads, dim):
    out = (x.double() @ w.double().T).view(1, x.shape[0], 3 * heads, dim)
    q = rope.rms_norm_rope(out[:, :, :heads], qw.double(), table.double(), eps)
    k = rope.rms_norm_rope(out[:, :, heads:2 * heads], kw.double(), table.double(), eps)
    return torch.cat([q, k, out[:, :, 2 * heads:]], dim=2).view(x.shape[0], -1)


@pytest.mark.parametrize("cfg", [pytest.param(Config(bm=32, bn=32, bk=32, group_m=2, tma=True), id="tma"),
                                 pytest.param(Config(bm=32, bn=32, bk=32, tma=False, persistent=True),
                                              id="ptr-persistent")])
@pytest.mark.parametrize("dim,rot_pairs", [(32, 12), (32, 16)], ids=["partial-rotation", "full-rotation"])
@pytest.mark.parametrize("paired", [False, True], ids=["gather", "paired-rows"])
def test_linear_qk_norm_rope_matches_rope_module(cfg, dim, rot_pairs, paired):
    s, heads, eps = 45, 2, 1e-6
    x, w, qw, kw, table = _qk_inputs(s, heads, dim, rot_pairs)
    ref = _qk_ref(x, w, qw, kw, table, eps, heads, dim)
    w_in = w[gemm_triton.qk_pair_order(heads, dim, rot_pairs)] if paired else w
    ours = gemm_triton.linear_qk_norm_rope(x, w_in, qw, kw, table, eps, heads, cfg, paired=paired)
    # eager: the projection rounded, then the norm + rope (fp32 inside, one rounding)
    eager = F.linear(x, w)
    q, k, _ = eager.view(1, s, 3 * heads, dim).split(heads, dim=2)
    rope.rms_norm_rope_(q, k, qw, kw, table, eps)
    for part in (slice(0, heads * dim), slice(heads * dim, 2 * heads * dim), slice(2 * heads * dim, None)):
        assert _rel(ours[:, part], ref[:, part]) <= 1.05 * _one_rounding(ref[:, part]), part
    assert _rel(ours[:, :2 * heads * dim], ref[:, :2 * heads * dim]) < _rel(eager[:, :2 * heads * dim],
                                                                           ref[:, :2 * heads * dim])


@pytest.mark.parametrize("paired", [False, True], ids=["gather", "paired-rows"])
def test_linear_qk_norm_rope_head_dim_128(paired):
    """The real head geometry: 128 dims, 48 rotated pairs (96 of 128 rotate), one head per tile."""
    s, heads, dim, eps = 20, 1, 128, 1e-6
    x, w, qw, kw, table = _qk_inputs(s, heads, dim, 48)
    ref = _qk_ref(x, w, qw, kw, table, eps, heads, dim)
    w_in = w[gemm_triton.qk_pair_order(heads, dim, 48)] if paired else w
    ours = gemm_triton.linear_qk_norm_rope(x, w_in, qw, kw, table, eps, heads, Config(bm=32, bn=128, bk=64),
                                           paired=paired)
    assert _rel(ours, ref) <= 1.05 * _one_rounding(ref)


def test_qk_pair_order_on_nvfp4_rows_is_exact():
    heads, dim, r = 2, 32, 12  # 192 rows
    q = nvfp4.quantize_nvfp4(_randn(3 * heads * dim, 64, seed=13).float())
    order = gemm_triton.qk_pair_order(heads, dim, r)
    packed, scales = gemm_triton.permute_nvfp4_rows(q.packed, q.block_scale, order, 3 * heads * dim)
    dense = nvfp4.dequantize_nvfp4(q.packed, q.block_scale, q.global_scale)
    assert torch.equal(nvfp4.dequantize_nvfp4(packed, scales, q.global_scale), dense[order])


def test_qk_pair_order_moves_only_q_and_k_rows():
    order = gemm_triton.qk_pair_order(2, 8, 3)  # heads 2, dim 8, 3 rotated pairs
    assert sorted(order.tolist()) == list(range(48))
    assert order[:8].tolist() == [0, 3, 1, 4, 2, 5, 6, 7] and order[8:16].tolist() == [8, 11, 9, 12, 10, 13, 14, 15]
    assert order[32:].tolist() == list(range(32, 48))  # v heads


def test_paired_rope_needs_the_permuted_weight():
    s, heads, dim, eps = 45, 2, 32, 1e-6
    x, w, qw, kw, table = _qk_inputs(s, heads, dim, 12)
    ref = _qk_ref(x, w, qw, kw, table, eps, heads, dim)
    ours = gemm_triton.linear_qk_norm_rope(x, w, qw, kw, table, eps, heads, Config(bm=32, bn=32, bk=32), paired=True)
    assert _rel(ours[:, :2 * heads * dim], ref[:, :2 * heads * dim]) > 0.1


def test_linear_qk_norm_rope_catches_swapped_norm_weights():
    s, heads, dim, eps = 45, 2, 32, 1e-6
    x, w, qw, kw, table = _qk_inputs(s, heads, dim, 12)
    ref = _qk_ref(x, w, qw, kw, table, eps, heads, dim)
    ours = gemm_triton.linear_qk_norm_rope(x, w, kw, qw, table, eps, heads, Config(bm=32, bn=32, bk=32))
    assert _rel(ours[:, :2 * heads * dim], ref[:, :2 * heads * dim]) > 5 * _one_rounding(ref)


def test_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="power of two"):
        Config(bn=96)
    with pytest.raises(ValueError, match="persistent"):
        Config(ws=True)


@pytest.mark.parametrize("part", ["qkv", "fc1", "fc2"])
def test_bench_runs_every_variant_on_the_cpu(part, tmp_path, capsys):
    """benchmarks/tgemm_bench.py (the H200 script's steps) on tiny shapes in the interpreter: every config and
    fused variant runs and lands within one rounding of its fp64 reference; the summary reads the JSON."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tgemm_bench

    out = tmp_path / f"{part}.json"
    assert tgemm_bench.main(["--part", part, "--device", "cpu", "--rows", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["configs"] + res["fused"]
    assert res["fused"] and all("error" not in r and r["ok"] for r in rows), rows
    assert tgemm_bench.main(["--summary", str(tmp_path)]) == 0
    assert f"best {res['best']}" in capsys.readouterr().out


def _nvidia_backend() -> str | None:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as exc:
        return f"Triton's NVIDIA backend is not importable: {exc}"
    return None


_NO_BACKEND = "needs Triton" if fused.triton is None else _nvidia_backend()


@pytest.mark.skipif(_NO_BACKEND is not None, reason=str(_NO_BACKEND))
@pytest.mark.parametrize("cfg,epi", [
    pytest.param(Config(128, 256, 64, 8, 3, 8), gemm_triton.EPI_PLAIN, id="plain-tma-s3"),
    pytest.param(Config(128, 256, 64, 8, 4, 8, tma=False), gemm_triton.EPI_RESIDUAL, id="residual-ptr-s4"),
    pytest.param(Config(128, 256, 64, 8, 3, 8), gemm_triton.EPI_SWIGLU, id="swiglu-tma-s3"),
    pytest.param(Config(128, 128, 64, 8, 4, 8), gemm_triton.EPI_QK_ROPE, id="qk-rope-tma-s4"),
    pytest.param(Config(128, 128, 64, 8, 4, 8), gemm_triton.EPI_QK_ROPE_PAIRED, id="qk-rope-paired-tma-s4"),
])
def test_kernel_compiles_for_sm90_within_shared_memory(cfg, epi, monkeypatch):
    """The H200 configurations lower for sm_90 (offline, no GPU): warpgroup MMAs and a shared-memory footprint
    within the 227 KiB limit. (The GPU runs Triton 3.6, this is the venv's Triton: a check of the kernel's
    constructs, not of that exact compiler.)"""
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU default (silences 3.9's notice)
    info = gemm_triton.compile_offline(cfg, epi)
    assert info["wgmma"] and info["fits"], info


def test_offline_compile_sees_a_config_that_does_not_fit(monkeypatch):
    """The shared-memory check can fail: 128x256x64 at 4 stages with the TMA-store staging buffer needs 256 KiB."""
    if _NO_BACKEND is not None:
        pytest.skip(_NO_BACKEND)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU default (silences 3.9's notice)
    assert not gemm_triton.compile_offline(Config(128, 256, 64, 8, 4, 8))["fits"]
