"""FP8 e4m3 W8A8 block linears (`--fp8-linear`): quantizers against fp64 math, the Triton kernels against the torch
reference (Triton's interpreter), the emulated linear's error, the loader switch, option errors, the gate's keying."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from interpreted import run_interpreted

from h3direct.checkpoint.quant import w8a8
from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from h3direct.counts import counting
from h3direct.dit.linear import FP8Linear, Linear, NVFP4Linear
from h3direct.dit.loader import apply_load_time, load_dit
from h3direct.errors import ConfigError, RequestError

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
E4M3_MAX = 448.0


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 200, generator=g, dtype=torch.float64) * torch.logspace(-5, 4, 40, dtype=torch.float64)[:, None]
    x[3] = 0.0  # a zero row
    x[7] = 0.0
    x[7, 11] = -448.0  # amax exactly 448 (scale 1), one element
    x[8] = 448.0  # every element at amax
    x[9, :] = x[9, :].clamp(-1, 1)
    x[9, 0] = 448.0  # scale 1: the other elements keep e4m3's own grid
    return x.to(torch.float32)


# ---------------------------------------------------------------- quantizers vs fp64 math

def test_per_row_quantization_error_bounds():
    x = _rows()
    q, s = w8a8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (40,)
    x64 = x.to(torch.float64)
    amax = x64.abs().amax(dim=1)
    want_s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.allclose(s.to(torch.float64), want_s, rtol=2 ** -23, atol=0)
    back = q.to(torch.float64) * s.to(torch.float64)[:, None]
    err = (back - x64).abs()
    # normal range (|x| >= 2^-6 s): relative error <= 2^-4 (3 mantissa bits, round to nearest); below: half a quantum
    normal = x64.abs() >= 2.0 ** -6 * s.to(torch.float64)[:, None]
    assert bool((err[normal] <= 2.0 ** -4 * x64.abs()[normal] * (1 + 2 ** -20)).all())
    assert bool((err[~normal] <= 2.0 ** -10 * s.to(torch.float64)[:, None].expand_as(x64)[~normal] * 1.0001).all())
    assert float(err[normal].max() / x64.abs()[normal].max()) > 0  # it did round
    # zero rows: scale 1, all codes zero; amax-448 rows: scale exactly 1, the max encodes to ±448 exactly
    assert s[3].item() == 1.0 and not q[3].to(torch.float32).any()
    assert s[7].item() == 1.0 and q[7, 11].to(torch.float32).item() == -448.0
    assert s[8].item() == 1.0 and bool((q[8].to(torch.float32) == 448.0).all())
    # the largest element of every nonzero row maps to ±448 (never past it: no NaN code)
    nz = amax > 0
    top = q.to(torch.float32).abs().amax(dim=1)
    assert bool((top[nz] == 448.0).all())
    assert not torch.isnan(q.to(torch.float32)).any()


def test_round_to_nearest_even_on_e4m3_grid():
    # scale 1 rows: the codes must be torch's own float8 cast of the (clamped) values
    vals = torch.tensor([448.0, 0.0, 1.0625, 1.1875, 240.0, 248.0, 2 ** -9, 1.5 * 2 ** -9, 2 ** -10, -3 * 2 ** -10,
                         447.0, 1e-30, -0.0])
    q, s = w8a8.quantize_rows(vals[None])
    assert s.item() == 1.0
    want = torch.tensor([448.0, 0.0, 1.0, 1.25, 240.0, 256.0, 2 ** -9, 2 ** -8, 0.0, -2 ** -8, 448.0, 0.0, 0.0])
    assert torch.equal(q.to(torch.float32)[0], want)


def test_codes_are_the_rounded_product_with_the_row_reciprocal():
    """The rule, from numpy's fp32 arithmetic: codes = e4m3(clamp(x · fl(1 / s))), the reciprocal and the product
    each rounded once (not the quotient x / s, which differs from it in the last fp32 bit for some x); rows whose
    amax / 448 is not a normal fp32 number take s = 1 (no overflowing reciprocal, no NaN code)."""
    x = _rows(5)
    x[11] = torch.tensor([1e-37, -3e-38] * 100)  # amax / 448 is subnormal: s = 1, every code 0
    x[12] = 0.0  # s = 3136 / 448 = 7: 1.3671875 / 7 = 0.1953125 is a tie of e4m3 (to even: 0.1875), but
    x[12, :2] = torch.tensor([3136.0, 1.3671875])  # 1.3671875 · fl(1 / 7) rounds to the fp32 just above it
    q, s = w8a8.quantize_rows(x)
    x32 = x.numpy().astype(np.float32)
    amax = np.abs(x32).max(axis=1)
    want_s = (amax / np.float32(448.0)).astype(np.float32)
    want_s = np.where(want_s >= np.float32(2.0 ** -126), want_s, np.float32(1.0)).astype(np.float32)
    assert np.array_equal(s.numpy(), want_s)
    inverse = (np.float32(1.0) / want_s).astype(np.float32)
    product = np.clip((x32 * inverse[:, None]).astype(np.float32), -448.0, 448.0)
    want = torch.from_numpy(product).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert s[11].item() == 1.0 and not q[11].to(torch.float32).any()
    assert s[12].item() == 7.0 and q[12, 1].to(torch.float32).item() == 0.203125  # the product's, not 0.1875


# ---------------------------------------------------------------- the W8A8 product (CPU emulation)

def test_emulated_linear_vs_fp64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 256, generator=g)
    w = torch.randn(96, 256, generator=g) * 0.05
    b = torch.randn(96, generator=g)
    q, s = w8a8.quantize_rows(w)
    with counting() as calls:
        y = w8a8.linear_w8a8(x, q, s, b)
    assert y.shape == (3, 50, 96) and y.dtype == torch.float32
    assert calls.as_dict() == {"fp8_linear": {"emulated (cpu)": 1}}
    ref = x.double() @ w.double().T + b.double()
    rel = float((y.double() - ref).norm() / ref.norm())
    assert 1e-3 < rel < 0.05, rel  # quantized (not exact) and well inside e4m3's error
    # the emulation is the product of the dequantized operands (fp32 accumulation)
    xq, xs = w8a8.quantize_rows(x.reshape(-1, 256))
    exact = w8a8.dequantize_rows(xq, xs).double() @ w8a8.dequantize_rows(q, s).double().T + b.double()
    assert float((y.reshape(-1, 96).double() - exact).abs().max()) < 1e-4
    # bf16 activations: same math, output in bf16
    yb = w8a8.linear_w8a8(x.bfloat16(), q, s, None)
    assert yb.dtype == torch.bfloat16
    assert float((yb.double() - (ref - b.double())).norm() / (ref - b.double()).norm()) < 0.05


def test_prequantized_rows_give_the_same_product():
    """An activation handed over already quantized (`E4M3Rows`, what the fused kernels write) gives bitwise the
    product of the tensor it was made from, is counted as such, and malformed rows are refused."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 256, generator=g).bfloat16()
    w8, sw = w8a8.quantize_rows(torch.randn(96, 256, generator=g) * 0.05)
    b = torch.randn(96, generator=g)
    with counting() as calls:
        want = w8a8.linear_w8a8(x, w8, sw, b)
        got = w8a8.linear_w8a8(w8a8.E4M3Rows(*w8a8.quantize_rows(x), x.dtype), w8, sw, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert calls.fp8_linear == {"emulated (cpu)": 1, "emulated (cpu), e4m3 input": 1}
    q, s = w8a8.quantize_rows(x)
    with pytest.raises(ValueError, match="E4M3Rows"):
        w8a8.E4M3Rows(q, s[:-1], x.dtype)
    with pytest.raises(ValueError, match="E4M3Rows"):
        w8a8.E4M3Rows(q.view(torch.uint8), s, x.dtype)


# ---------------------------------------------------------------- Triton kernels (interpreter) vs torch, bitwise

_KERNEL_CHECK = textwrap.dedent("""
    import json, torch
    from h3direct.checkpoint.quant import nvfp4_triton, w8a8, w8a8_triton
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4
    out = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-6, 3, 37)[:, None]
    x[3] = 0
    x[5, 7] = 448.0
    x[6] = torch.tensor([1e-30, -0.0] * 150)
    x[8] = 0
    x[8, :2] = torch.tensor([3136.0, 1.3671875])  # x / s on an e4m3 tie, x · fl(1 / s) just above it
    x[9] = torch.tensor([1e-37, -3e-38] * 150)  # amax / 448 is not a normal fp32: s = 1
    sweep = torch.cat([torch.tensor([448.0]), torch.linspace(-448, 448, 40001), torch.logspace(-12, 2.65, 20001),
                       -torch.logspace(-12, 2.65, 2001), torch.tensor([2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875])])
    for name, t in (("fp32", x), ("bf16", x.bfloat16()), ("sweep", sweep[None]), ("strided", x[:, ::1][:, :256])):
        q1, s1 = w8a8_triton.quantize_rows(t)
        q2, s2 = w8a8.quantize_rows(t)
        out[name] = [int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum()), bool(torch.equal(s1, s2))]
    for n, k in ((200, 96), (130, 48), (256, 512)):
        t = quantize_nvfp4(torch.randn(n, k, generator=g).bfloat16())
        s = w8a8.nvfp4_channel_scales(*t)
        a = nvfp4_triton.nvfp4_to_e4m3_triton(*t, s)
        b = w8a8.nvfp4_to_e4m3_reference(*t, s)
        out[f"nvfp4_{n}x{k}"] = [int((a.view(torch.uint8) != b.view(torch.uint8)).sum()), list(a.shape)]
    print("RESULT " + json.dumps(out))
""")


def test_triton_kernels_bitwise_under_interpreter():
    res = run_interpreted(_KERNEL_CHECK)
    for name in ("fp32", "bf16", "sweep", "strided"):
        assert res[name] == [0, True], (name, res[name])
    assert res["nvfp4_200x96"] == [0, [208, 96]]
    assert res["nvfp4_130x48"] == [0, [144, 48]]
    assert res["nvfp4_256x512"] == [0, [256, 512]]


def test_nvfp4_conversion_matches_decode():
    # the torch reference conversion is e4m3(fp32 decode / per-row scale); scales come from the fp32 decode
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    t = quantize_nvfp4(w)
    dense = w8a8.decode_nvfp4_fp32(*t)
    # the fp32 decode is the project's own NVFP4 dequantization (ComfyUI-bitwise, tested there) in fp32
    assert torch.equal(dense, dequantize_nvfp4(*t, torch.float32))
    s = w8a8.nvfp4_channel_scales(*t)
    assert torch.equal(s, w8a8.row_scales(dense))
    q = w8a8.nvfp4_to_e4m3_reference(*t, s)
    assert torch.equal(q.view(torch.uint8), w8a8.encode_rows(dense, s).view(torch.uint8))
    back = w8a8.dequantize_rows(q, s)
    assert float((back - dense).abs().max()) <= float(2 ** -4 * dense.abs().max())


# ---------------------------------------------------------------- the loader switch

BLOCK_LEAVES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


@pytest.mark.parametrize("ckpt,mode,source", [("h3_fx_bf16.safetensors", "stream", "float32"),
                                               ("h3_fx_curve_nvfp4.safetensors", "stream", "nvfp4"),
                                               ("h3_fx_curve_nvfp4.safetensors", "resident", "nvfp4")])
def test_loader_replaces_exactly_the_block_linears(ckpt, mode, source):
    plain = load_dit(FIX / ckpt)
    model = load_dit(FIX / ckpt, fp8_linear=mode)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    want = {f"blocks.{i}.{leaf}" for i in range(len(model.blocks)) for leaf in BLOCK_LEAVES}
    assert len(model.blocks) == 2 and fp8 == want and len(fp8) == 8  # tiny preset: 4 per block
    assert model.fp8_linear == mode and plain.fp8_linear == "off"
    for name in fp8:
        m = model.get_submodule(name)
        assert m.source == source and m.mode == (mode if source == "nvfp4" else "resident")
    # everything else is untouched: same module types at the same names
    others = {n: type(m) for n, m in plain.named_modules() if n not in want}
    assert others == {n: type(m) for n, m in model.named_modules() if n not in want}
    assert any(t in (Linear, NVFP4Linear) for t in others.values())


def test_accumulation_option_reaches_every_fp8_linear():
    """fp8_accum (fixed at load) is held by every FP8 block linear and shown in its repr; fast by default. Its effect
    on the GEMM is a GPU test (test_scaled_mm_path_is_its_cpu_emulation_at_the_block_shapes)."""
    for asked, want in ((None, "fast"), ("fp32", "fp32")):
        kw = {} if asked is None else {"fp8_accum": asked}
        model = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="stream", **kw)
        accums = {m.accum for m in model.modules() if isinstance(m, FP8Linear)}
        assert accums == {want} and f"{want} accumulation" in repr(model.blocks[0].mlp.fc1)
    apply_load_time(model, fp8_linear="stream", fp8_accum="fast")  # a model that has FP8 linears takes the new one
    assert {m.accum for m in model.modules() if isinstance(m, FP8Linear)} == {"fast"}
    resident = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="resident")
    for other in ("stream", "off"):  # a resident model's own linears are gone: no other mode without a reload
        with pytest.raises(ConfigError, match=f"fp8_linear '{other}': this model's block linears were made FP8 "
                                              "'resident'"):
            apply_load_time(resident, fp8_linear=other)


def test_a_stream_model_changes_its_fp8_layers_and_format_and_gives_its_own_linears_back():
    """fp8_linear_layers / fp8_linear_format on a loaded stream model: the linears are put back and made again,
    `off` restores the checkpoint's own modules (the same objects, so the output is bitwise the plain model's)."""
    plain = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors")
    model = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors")
    own = {n: m for n, m in model.named_modules() if n.startswith("blocks.") and n.endswith(("proj", "fc1", "fc2"))}
    x = torch.randn(17, model.blocks[0].mlp.fc1.in_features, generator=torch.Generator().manual_seed(5))
    for layers, fmt in ((None, "e4m3"), ("fc1,fc2", "e4m3"), ("qkv_proj", "int8"), ("fc2,fc1", "int8")):
        apply_load_time(model, fp8_linear="stream", fp8_linear_layers=layers, fp8_linear_format=fmt)
        fp8 = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
        leaves = BLOCK_LEAVES if layers is None else tuple(p for p in BLOCK_LEAVES if p.split(".")[1] in layers)
        assert set(fp8) == {f"blocks.{i}.{leaf}" for i in range(2) for leaf in leaves}, (layers, sorted(fp8))
        assert {m.fmt for m in fp8.values()} == {fmt}
        dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
        assert all(m.fp8_weight()[0].dtype == dtype for m in fp8.values())
    apply_load_time(model, fp8_linear="off")
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert all(model.get_submodule(n) is m for n, m in own.items())
    assert torch.equal(model.blocks[1].mlp.fc1(x), plain.blocks[1].mlp.fc1(x))


def test_converted_8bit_linears_do_not_keep_the_checkpoints_modules():
    """A layer converted to 8-bit weights (resident, or any layer of a bf16/fp32 checkpoint) holds only those: the
    module it replaced is not kept (it would hold the checkpoint's weights a second time), so such a model cannot
    take other layers or formats without a reload. A stream layer keeps its source, which shares its tensors."""
    for ckpt, mode in (("h3_fx_curve_nvfp4.safetensors", "resident"), ("h3_fx_bf16.safetensors", "stream")):
        model = load_dit(FIX / ckpt, fp8_linear=mode)
        assert "fp8_sources" not in vars(model), (ckpt, mode)
        with pytest.raises(ConfigError, match="converted: its own linears are gone"):
            apply_load_time(model, fp8_linear=mode, fp8_linear_layers="fc1")
    stream = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="stream")
    sources = vars(stream)["fp8_sources"]
    assert len(sources) == 8 and all(src.weight is stream.get_submodule(n).packed for n, src in sources.items())


def test_the_options_layer_names_are_the_checkpoints_block_linears():
    """options.FP8_LINEAR_LEAVES (torch-free, for the command line) names each of keys.BLOCK_LINEARS, in order."""
    from h3direct.checkpoint.keys import BLOCK_LINEARS
    from h3direct.dit.options import FP8_LINEAR_LEAVES

    assert FP8_LINEAR_LEAVES == tuple(p.rpartition(".")[2] for p in BLOCK_LINEARS)


@pytest.mark.parametrize("value", ["", "fc3", "fc1,fc1", "qkv_proj;fc2"])
def test_a_bad_fp8_layer_list_is_one_line(value):
    from h3direct.dit.options import KernelOptions

    with pytest.raises(RequestError, match="fp8_linear_layers"):
        KernelOptions(fp8_linear_layers=value)


def test_stream_and_resident_give_the_same_product():
    a = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="stream")
    b = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="resident")
    x = torch.randn(33, a.blocks[1].mlp.fc1.in_features, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.blocks[1].mlp.fc1(x), b.blocks[1].mlp.fc1(x))
    plain = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors").blocks[1].mlp.fc1
    ref = x.double() @ plain.dequantized_weight(torch.float64).T
    rel = float((b.blocks[1].mlp.fc1(x).double() - ref).norm() / ref.norm())
    assert rel < 0.05


# ---------------------------------------------------------------- option errors

def test_bad_option_values():
    with pytest.raises(RequestError, match="fp8_linear 'fast' is not supported"):
        load_dit(FIX / "h3_fx_bf16.safetensors", fp8_linear="fast")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "h3direct", "generate", "--fp8-linear=fast", "-o", "/tmp/never.mp4"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--fp8-linear" in proc.stderr


def test_triton_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The kernels go through Triton's whole compiler to an sm_90 cubin (no GPU needed: Triton ships ptxas), so a
    construct the interpreter accepts but the compiler refuses (e.g. a non-constexpr global) fails here, not on
    the GPU."""
    triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86_64 Linux)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3direct.triton_build import FP_OPTIONS

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from h3direct.checkpoint.quant import nvfp4_triton, w8a8_triton
    from h3direct.triton_build import build

    quant, encode = w8a8_triton.device_functions()
    rows = {"q_ptr": "*u8", "s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_x": "i32", "ROWS": "constexpr",
            "BLOCK": "constexpr", "QUANT": "constexpr", "ENCODE": "constexpr", "INTERPRET": "constexpr"}
    fns = {"QUANT": quant, "ENCODE": encode, "INTERPRET": False}
    conv = {"words_ptr": "*i32", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*u8", "rs_ptr": "*fp32",
            "total": "i32", "NB": "i32", "TILES_PER_ROW": "i32", "BLK": "constexpr", "OUT": "constexpr",
            "EVEN": "constexpr", "INTERPRET": "constexpr", "ENCODE": "constexpr"}
    for fn, sig, consts in ((build(w8a8_triton._quant_rows_kernel), {"x_ptr": "*bf16", **rows},
                             {"ROWS": 1, "BLOCK": 8192, **fns}),
                            (build(w8a8_triton._quant_rows_kernel), {"x_ptr": "*fp32", **rows},
                             {"ROWS": 1, "BLOCK": 16384, **fns}),
                            (build(nvfp4_triton._dequant_kernel), conv,
                             {"BLK": 256, "OUT": nvfp4_triton.E4M3_OUT, "EVEN": False, "INTERPRET": False,
                              "ENCODE": encode})):
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options=FP_OPTIONS)  # as every launch compiles them
        ptx = compiled.asm["ptx"]
        assert "div.rn.f32" in ptx  # IEEE division, as the torch reference divides
        assert "div.full.f32" not in ptx and "div.approx" not in ptx  # and no approximate one
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the GPU's e4m3 encoding (test_e4m3_encoding_instruction_...)
        assert compiled.asm["cubin"]


def _fx_case(name):
    from parity_tests.discovery import find_dit_cases

    cases, _ = find_dit_cases([FIX])
    return next(c for c in cases if c.trace.name == name)


def test_gate_passes_fp8_within_its_budget_and_catches_a_wrong_scale(monkeypatch):
    from parity_tests import gate, models

    case = _fx_case("trace_fx_bf16_ref2va_bf16.safetensors")
    ok = gate.run_dit_case(case, mode="teacher", fp8_linear="stream")
    assert ok.passed, ok.report()
    assert "fp8_w8a8" in ok.report() and ok.weights == "fp8_w8a8"
    assert set(ok.fp8_linear_calls) == {"emulated (cpu)"} and ok.fp8_linear_calls["emulated (cpu)"] >= 8
    kernel = [r for r in ok.layers if r.part == "kernel"]
    worst = max(r.rel_l2 for r in kernel)
    assert 1e-2 < worst < 0.1  # the FP8 error is there (not silently exact), inside its rounding bound
    # a weight scale 30 % off: every block linear is off by 30 % -> the gate must fail at a block site
    real = FP8Linear.fp8_weight
    monkeypatch.setattr(FP8Linear, "fp8_weight", lambda self: (real(self)[0], real(self)[1] * 1.3))
    models.model.cache_clear()
    try:
        bad = gate.run_dit_case(case, mode="teacher", fp8_linear="stream")
    finally:
        models.model.cache_clear()
    assert not bad.passed and bad.first_failure.name.startswith("blocks.") and bad.first_failure.part == "kernel"


def test_bench_dit_tiny_with_fp8_linear(tmp_path):
    """bench_dit's --fp8-linear plumbing on the CPU (tiny preset): both weight formats run, calls are counted."""
    out = tmp_path / "b.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_dit", "--preset", "tiny", "--device",
                           "cpu", "--out", str(out), "--attention", "sdpa", "--steps", "1", "--no-kernels",
                           "--fp8-linear"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    d = json.loads(out.read_text())
    ok = [c for c in d["configs"] if c["status"] == "ok"]
    assert {c["weights"] for c in ok} == {"nvfp4", "bf16"} and all(c["finite"] for c in ok)
    for c in ok:  # warm-up + 1 timed step, 2 blocks x 4 linears per call: every GEMM emulated on the CPU
        assert c["fp8_linear"] == "stream" and set(c["fp8_linear_calls"]) == {"emulated (cpu)"}
        assert c["fp8_linear_calls"]["emulated (cpu)"] % 8 == 0
    assert {b["fp8_linear"] for b in d["builds"]} == {"stream"}


# ---------------------------------------------------------------- on the GPU (`pytest -m gpu`)

# K -> N of the full model's four block linears; the token count M is cut (it changes neither the path nor a scale)
BLOCK_LINEARS = {"qkv_proj": (5376, 21504), "out_proj": (7168, 5376), "fc1": (5376, 28672), "fc2": (14336, 5376)}


def _tokens(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[::97] *= 30  # outlier tokens: per-token scales keep the others
    return x.bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["fp32", "fast"])
@pytest.mark.parametrize("name", list(BLOCK_LINEARS))
def test_scaled_mm_path_is_its_cpu_emulation_at_the_block_shapes(name, accum):
    """`torch._scaled_mm` (the GPU path) and the CPU emulation compute the same W8A8 product: the exact product of
    the same e4m3 operands, rounded once to bf16. The emulation's error against it is that one rounding; the GPU's
    with fp32 accumulation may exceed it by 10 % (another summation order), and a wrong scale or layout is far
    outside. Fast accumulation (the tensor cores' accumulator over the whole K) adds its own error: it is held to the
    gate's rule for FP8 linears (the product of the unquantized operands, k·u·sqrt(2/3)·ρ with u of e4m3), the rule
    every FP8 linear site of a trace is judged by, and must change the result (the option reached the GEMM)."""
    from h3direct.traces.kernels import gemm_rho
    from h3direct.traces.metrics import rel_l2
    from parity_tests.budgets import Measured, load_budgets, verdict

    k, n = BLOCK_LINEARS[name]
    x = _tokens(256, k, seed=k + n)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.02).bfloat16()
    w8, sw = w8a8.quantize_rows(w)
    with counting() as calls:
        y = w8a8.linear_w8a8(x.cuda(), w8.cuda(), sw.cuda(), accum=accum).cpu()
    assert calls.as_dict() == {"fp8_linear": {"scaled_mm": 1}}, calls.as_dict()
    emulated = w8a8.linear_w8a8(x, w8, sw)
    x8, sx = w8a8.quantize_rows(x)
    exact = (w8a8.dequantize_rows(x8, sx).double().cuda() @ w8a8.dequantize_rows(w8, sw).double().cuda().T).cpu()
    one_rounding = rel_l2(emulated, exact)
    assert 0 < one_rounding < 2 ** -8, one_rounding
    if accum == "fp32":
        assert rel_l2(y, exact) <= 1.1 * one_rounding, (name, rel_l2(y, exact), one_rounding)
        return
    assert not torch.equal(y, w8a8.linear_w8a8(x.cuda(), w8.cuda(), sw.cuda(), accum="fp32").cpu())
    xd, wd = x.double().cuda(), w.double().cuda()
    true = xd @ wd.T
    b = load_budgets().lookup(mode="kernel", kind="linear", compute="*", weights="fp8_w8a8", attention="*", twin="*")
    v = verdict(b, Measured(rel_l2(y, true.cpu()), gemm_rho=gemm_rho(xd, wd, true)))
    assert v.passed, (name, v.text)


@pytest.mark.gpu
def test_triton_kernels_on_cuda_are_bitwise_the_cpu_reference():
    """The compiled kernels give the codes and scales of the torch reference computed on the CPU (their interpreted
    twin: test_triton_kernels_bitwise_under_interpreter): activations with outliers, a zero row, e4m3's grid swept
    at scale 1 (ties included); an NVFP4 block weight converted to e4m3 (the stream mode)."""
    from h3direct.checkpoint.quant import nvfp4_triton, w8a8_triton
    from h3direct.traces.metrics import bit_mismatch

    x = _tokens(2048, 5376, seed=1).float()
    x[3] = 0.0
    x[5, 7] = 448.0
    x[8] = 0.0
    x[8, :2] = torch.tensor([3136.0, 1.3671875])  # x / s on an e4m3 tie, x · fl(1 / s) just above it
    x[9] = torch.tensor([1e-37, -3e-38] * 2688)  # amax / 448 is not a normal fp32: s = 1
    sweep = torch.cat([torch.linspace(-448, 448, 40001), torch.logspace(-12, 2.65, 20001),
                       -torch.logspace(-12, 2.65, 2001), torch.tensor([2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875])])
    rows = -(-len(sweep) // 4095)
    flat = torch.zeros(rows * 4095)
    flat[:len(sweep)] = sweep
    # a 448 in every row: each row's scale is exactly 1, so its codes are the e4m3 rounding of the values themselves
    grid = torch.cat([torch.full((rows, 1), 448.0), flat.reshape(rows, 4095)], dim=1)
    for t in (x, x.bfloat16(), grid):
        q_gpu, s_gpu = w8a8_triton.quantize_rows(t.cuda())
        q_cpu, s_cpu = w8a8.quantize_rows(t)
        assert (diff := bit_mismatch(q_gpu.cpu(), q_cpu)) is None, f"{t.dtype} {list(t.shape)} codes: {diff}"
        assert (diff := bit_mismatch(s_gpu.cpu(), s_cpu)) is None, f"{t.dtype} {list(t.shape)} scales: {diff}"
    k, n = BLOCK_LINEARS["out_proj"]
    weight = quantize_nvfp4((torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16())
    scales = w8a8.nvfp4_channel_scales(*weight)
    got = nvfp4_triton.nvfp4_to_e4m3_triton(*(t.cuda() for t in weight), scales.cuda())
    assert (diff := bit_mismatch(got.cpu(), w8a8.nvfp4_to_e4m3_reference(*weight, scales))) is None, diff


@pytest.mark.gpu
def test_e4m3_encoding_instruction_is_torch_cast_on_every_fp32_value():
    """Compiled, the kernels encode e4m3 with the GPU's conversion instruction (the interpreter, which the CPU tests
    run, with integer arithmetic): on every fp32 value in [-448, 448] (all 2 x 1,138,753,537 bit patterns: every tie,
    the subnormals, -0) it must give torch's float8 cast (c10's software rounding). Rows of 4,095 consecutive patterns
    and a 448 (so the row's scale is exactly 1 and the division exact) through the activation quantizer."""
    from h3direct.checkpoint.quant import w8a8_triton

    top, width = 0x43E00000, 4095  # the bits of 448.0
    chunk = width * 65536
    for sign in (0, -(2**31)):
        for start in range(0, top + 1, chunk):
            bits = torch.arange(start, min(start + chunk, top + 1), device="cuda", dtype=torch.int32) | sign
            pad = -len(bits) % width
            vals = torch.cat([bits.view(torch.float32), torch.zeros(pad, device="cuda")]).view(-1, width)
            x = torch.cat([torch.full((len(vals), 1), 448.0, device="cuda"), vals], dim=1)
            q, s = w8a8_triton.quantize_rows(x)
            assert bool((s == 1).all())
            bad = (q.view(torch.uint8) != x.to(torch.float8_e4m3fn).view(torch.uint8)).nonzero()
            if len(bad):
                r, c = bad[0].tolist()
                v = x[r, c].item()
                raise AssertionError(f"{len(bad)} values encode differently, first {v!r} (bits "
                                     f"{x[r, c].view(torch.int32).item() & 0xFFFFFFFF:#010x}): "
                                     f"{q[r, c].view(torch.uint8).item():#04x} vs torch "
                                     f"{x[r, c].to(torch.float8_e4m3fn).view(torch.uint8).item():#04x}")
