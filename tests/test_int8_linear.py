"""int8 W8A8 block linears (`--fp8-linear --option fp8_linear_format=int8`): the quantizer against numpy's fp32
arithmetic, the product against exact integer arithmetic, the gate's rounding bound (predictive, and able to fail),
the Triton kernels against the torch reference (Triton's interpreter), the loader and the gate's keying."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from interpreted import run_interpreted

from h3direct.checkpoint.quant import w8a8
from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4
from h3direct.counts import counting
from h3direct.dit.linear import FP8Linear
from h3direct.dit.loader import load_dit
from h3direct.traces import kernels

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 300, generator=g) * torch.logspace(-6, 3, 24)[:, None]
    x[3] = 0.0  # a zero row: scale 1, codes 0
    x[5] = torch.tensor([1e-37, -3e-38] * 150)  # amax / 127 not a normal fp32: scale 1, codes 0
    x[6, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: ties go to even
    x[6, 4:] = 0.0
    return x


def test_codes_are_the_rounded_product_with_the_row_reciprocal():
    """From numpy's fp32 arithmetic: s = fl(amax / 127) (1 where that is not a normal fp32), codes =
    rint(clip(x · fl(1 / s), ±127)) with ties to even; every element within s / 2 of its code's value."""
    x = _rows()
    q, s = w8a8.quantize_rows_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    x32 = x.numpy()
    amax = np.abs(x32).max(axis=1)
    want_s = (amax / np.float32(127.0)).astype(np.float32)
    want_s = np.where(want_s >= np.float32(2.0 ** -126), want_s, np.float32(1.0)).astype(np.float32)
    assert np.array_equal(s.numpy(), want_s)
    inverse = (np.float32(1.0) / want_s).astype(np.float32)
    want = np.rint(np.clip((x32 * inverse[:, None]).astype(np.float32), -127, 127)).astype(np.int8)
    assert np.array_equal(q.numpy(), want)
    assert q[6, :4].tolist() == [127, 0, 2, -2] and not q[3].any() and not q[5].any()
    back = q.double() * s.double()[:, None]
    assert bool(((back - x.double()).abs() <= s.double()[:, None] / 2 * (1 + 1e-6)).all())
    nz = torch.from_numpy(amax > np.float32(127 * 2.0 ** -126))
    assert bool((q[nz].abs().amax(dim=1) == 127).all())  # each row's largest element lands on ±127


def test_the_emulated_product_is_exact_integer_arithmetic_then_one_epilogue():
    """The emulation's product equals numpy's integer product of the codes, then fl32(acc) · s_x · s_w (+ bias)
    rounded once, bit for bit; it is counted as emulated on the CPU."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 512, generator=g).bfloat16()
    w8, sw = w8a8.quantize_rows_int8(torch.randn(96, 512, generator=g) * 0.05)
    b = torch.randn(96, generator=g)
    with counting() as calls:
        y = w8a8.linear_w8a8(x, w8, sw, b)
    assert y.shape == (2, 40, 96) and y.dtype == torch.bfloat16
    assert calls.as_dict() == {"fp8_linear": {"emulated (cpu)": 1}}
    xq, sx = w8a8.quantize_rows_int8(x.reshape(-1, 512))
    acc = xq.numpy().astype(np.int64) @ w8.numpy().astype(np.int64).T
    ref = (acc.astype(np.float32) * sx.numpy()[:, None]).astype(np.float32) * sw.numpy()[None, :]
    ref = torch.from_numpy((ref + b.numpy()[None, :]).astype(np.float32)).to(torch.bfloat16)
    assert torch.equal(y.reshape(-1, 96), ref)


@pytest.mark.parametrize("tails", [1.0, 4.0])
def test_the_rounding_bound_predicts_the_error_and_fails_coarser_grids(tails):
    """`h3direct.traces.kernels.int8_rho` (uniform noise of variance s²/12 per code) is the expected error itself: the measured
    error of the product lies near it (Gaussian rows, and rows with a few large elements), inside the gate's
    k = 1.5 bound; the same product with a grid four times coarser (scales amax / 31) breaks the bound."""
    from parity_tests.budgets import Measured, load_budgets, verdict

    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 1024, generator=g)
    x[:, :8] *= tails  # outlier channels widen each row's range
    w = torch.randn(384, 1024, generator=g) * 0.02
    exact = x.double() @ w.double().T
    rho = kernels.int8_rho(x, w, exact)
    b = load_budgets().lookup(mode="kernel", kind="linear", compute="*", weights="int8_w8a8", attention="*", twin="*")

    def err(scale_rows):
        xq, sx = scale_rows(x)
        wq, sw = scale_rows(w)
        y = w8a8.int8_epilogue(xq.double() @ wq.double().T, sx, sw, None, torch.float32)
        return float((y.double() - exact).norm() / exact.norm())

    ok = err(w8a8.quantize_rows_int8)
    assert 0.8 < ok / rho < 1.2, (ok, rho)
    assert verdict(b, Measured(ok, gemm_rho=rho)).passed

    def coarse(t):  # a planted coarser grid: the same codes for values four times larger
        s = w8a8.int8_row_scales(t) * (127 / 31)
        return w8a8.encode_rows_int8(t, s), s

    bad = err(coarse)
    assert not verdict(b, Measured(bad, gemm_rho=rho)).passed, (bad, rho)


_KERNEL_CHECK = textwrap.dedent("""
    import json, torch
    from h3direct.checkpoint.quant import nvfp4_triton, w8a8, w8a8_triton
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4
    out = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-6, 3, 37)[:, None]
    x[3] = 0
    x[9] = torch.tensor([1e-37, -3e-38] * 150)
    x[10, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, 126.5])
    x[10, 6:] = 0
    for name, t in (("fp32", x), ("bf16", x.bfloat16()), ("strided", x[:, :256])):
        q1, s1 = w8a8_triton.quantize_rows(t, "int8")
        q2, s2 = w8a8.quantize_rows_int8(t)
        out[name] = [int((q1 != q2).sum()), bool(torch.equal(s1, s2)), str(q1.dtype)]
    for n, k in ((200, 96), (256, 512)):
        t = quantize_nvfp4(torch.randn(n, k, generator=g).bfloat16())
        s = w8a8.nvfp4_channel_scales(*t, "int8")
        a = nvfp4_triton.nvfp4_to_codes_triton(*t, s, fmt="int8")
        b = w8a8.nvfp4_to_codes_reference(*t, s, "int8")
        out[f"nvfp4_{n}x{k}"] = [int((a != b).sum()), list(a.shape), str(a.dtype)]
    acc = torch.randint(-2 ** 30, 2 ** 30, (70, 300), generator=g, dtype=torch.int32)
    sx, sw = torch.rand(70, generator=g) * 1e-3, torch.rand(300, generator=g) * 1e-3
    bias = torch.randn(300, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for b in (None, bias.to(dtype)):
            a = w8a8_triton.int8_epilogue(acc, sx, sw, b, dtype)
            r = w8a8.int8_epilogue(acc, sx, sw, b, dtype)
            out[f"epilogue_{dtype}_{b is not None}"] = int((a.float() != r.float()).sum())
    print("RESULT " + json.dumps(out))
""")


def test_triton_kernels_bitwise_under_interpreter():
    res = run_interpreted(_KERNEL_CHECK)
    for name in ("fp32", "bf16", "strided"):
        assert res[name] == [0, True, "torch.int8"], (name, res[name])
    assert res["nvfp4_200x96"] == [0, [208, 96], "torch.int8"]
    assert res["nvfp4_256x512"] == [0, [256, 512], "torch.int8"]
    assert {k: v for k, v in res.items() if k.startswith("epilogue")} == {
        f"epilogue_{d}_{b}": 0 for d in ("torch.float32", "torch.bfloat16", "torch.float16") for b in (False, True)}


def test_nvfp4_stream_and_resident_int8_give_the_same_product_as_the_reference_conversion():
    a = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="stream", fp8_linear_format="int8")
    b = load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="resident", fp8_linear_format="int8")
    fc1 = a.blocks[1].mlp.fc1
    assert isinstance(fc1, FP8Linear) and fc1.fmt == "int8" and "int8 w8a8 stream" in repr(fc1)
    x = torch.randn(33, fc1.in_features, generator=torch.Generator().manual_seed(3))
    assert torch.equal(fc1(x), b.blocks[1].mlp.fc1(x))
    w8, s = fc1.fp8_weight()
    assert w8.dtype == torch.int8 and torch.equal(
        w8, w8a8.nvfp4_to_codes_reference(fc1.packed, fc1.block_scale, fc1.global_scale, fc1.w_scale, "int8")
        [: fc1.out_features, : fc1.in_features])


def test_each_8bit_linear_takes_rows_of_its_own_format_only():
    """An int8 linear refuses e4m3 rows and an e4m3 linear int8 rows; int8 rows give the product of the same input
    quantized inside the linear."""
    x = torch.randn(20, 32)
    w8, sw = w8a8.quantize_rows_int8(torch.randn(16, 32))
    we, swe = w8a8.quantize_rows(torch.randn(16, 32))
    e4m3_rows = w8a8.E4M3Rows(*w8a8.quantize_rows(x), torch.float32)
    int8_rows = w8a8.Int8Rows(*w8a8.quantize_rows_int8(x), torch.float32)
    with pytest.raises(TypeError, match="an int8 linear"):
        w8a8.linear_w8a8(e4m3_rows, w8, sw)
    with pytest.raises(TypeError, match="an e4m3 linear"):
        w8a8.linear_w8a8(int8_rows, we, swe)
    assert torch.equal(w8a8.linear_w8a8(int8_rows, w8, sw), w8a8.linear_w8a8(x, w8, sw))
    with pytest.raises(ValueError, match="Int8Rows: codes torch.float8_e4m3fn"):
        w8a8.Int8Rows(e4m3_rows.data, e4m3_rows.scale, torch.float32)


def test_the_gate_keys_int8_linears_by_their_own_rule_and_it_can_fail(monkeypatch):
    """Teacher-forced gate of the fixture with int8 linears: every FP8-site row is keyed int8_w8a8 and passes; the
    quantizer's grid made four times coarser (planted) fails those rows."""
    from parity_tests.discovery import find_dit_cases
    from parity_tests.gate import run_dit_case
    from parity_tests.models import model

    cases, _ = find_dit_cases([FIX])
    case = next(c for c in cases if c.trace.stem == "trace_fx_curve_nvfp4_ref2va_fp32")
    ok = run_dit_case(case, mode="teacher", fp8_linear="stream/int8")
    rows = [r for r in ok.layers if r.part == "kernel" and "int8" in r.rule]
    assert ok.weights == "int8_w8a8" and rows and all(r.passed for r in rows), ok.report()
    model.cache_clear()
    real = w8a8.int8_row_scales
    monkeypatch.setattr(w8a8, "int8_row_scales", lambda t: real(t) * (127 / 31))
    try:
        bad = run_dit_case(case, mode="teacher", fp8_linear="stream/int8")
    finally:
        model.cache_clear()
    failed = [r for r in bad.layers if r.part == "kernel" and not r.passed]
    assert failed and all("int8" in r.rule for r in failed), bad.report()


def test_int8_kernels_compile_for_sm90_with_the_rounding_they_claim(tmp_path, monkeypatch):
    """The int8 kernels through Triton's whole compiler to an sm_90 cubin (no GPU needed): round to nearest even by
    `cvt.rni` (libdevice rint), IEEE division for the row scales, and no fused multiply-add in the epilogue (its two
    products and the bias add round as torch's do)."""
    triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86_64 Linux)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3direct.checkpoint.quant import nvfp4_triton, w8a8_triton
    from h3direct.triton_build import FP_OPTIONS, build

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    quant, encode = w8a8_triton.device_functions("int8")
    rows = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_x": "i32",
            "ROWS": "constexpr", "BLOCK": "constexpr", "QUANT": "constexpr", "ENCODE": "constexpr",
            "INTERPRET": "constexpr"}
    conv = {"words_ptr": "*i32", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*i8", "rs_ptr": "*fp32",
            "total": "i32", "NB": "i32", "TILES_PER_ROW": "i32", "BLK": "constexpr", "OUT": "constexpr",
            "EVEN": "constexpr", "INTERPRET": "constexpr", "ENCODE": "constexpr"}
    epi = {"acc_ptr": "*i32", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*i16", "M": "i32",
           "N": "i32", "HAS_BIAS": "constexpr", "OUT": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "ROUND": "constexpr"}
    rotation = {"ENCODE": encode, "ROTATE": build(w8a8_triton.rotated_block), "ROUND": build(w8a8_triton.round_out),
                "INTERPRET": False}
    rot = {"w_ptr": "*bf16", "signs_ptr": "*bf16", "h_ptr": "*bf16", "rs_ptr": "*fp32", "out_ptr": "*i8", "N": "i32",
           "stride_w": "i32", "stride_out": "i32", "B": "constexpr", "BN": "constexpr",
           **{name: "constexpr" for name in rotation}}
    rot_rows = {"x_ptr": "*bf16", "signs_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "M": "i32",
                "K": "i32", "stride_x": "i32", "B": "constexpr", "BM": "constexpr",
                **{name: "constexpr" for name in rotation}}
    # as a launch at the DiT's shapes specializes them: pointers, strides and K multiples of 16
    aligned = {"rotate": {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7)},
               "rotate_rows": {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7)}}
    bn = w8a8_triton.ROTATE_ROWS_PER_PROGRAM
    ptx = {}
    for name, fn, sig, consts, options in (
            ("rotate", build(w8a8_triton._rotate_encode_kernel), rot, {"B": 128, "BN": bn, **rotation},
             {"num_warps": 4, **FP_OPTIONS}),
            ("rotate_rows", build(w8a8_triton._rotate_quant_rows_kernel), rot_rows, {"B": 128, "BM": bn, **rotation},
             {"num_warps": 4, **FP_OPTIONS}),
            ("rows", build(w8a8_triton._quant_rows_kernel), rows,
             {"ROWS": 1, "BLOCK": 8192, "QUANT": quant, "ENCODE": encode, "INTERPRET": False}, FP_OPTIONS),
            ("nvfp4", build(nvfp4_triton._dequant_kernel), conv,
             {"BLK": 256, "OUT": nvfp4_triton.E4M3_OUT, "EVEN": False, "INTERPRET": False, "ENCODE": encode},
             FP_OPTIONS),
            ("epilogue", build(w8a8_triton._int8_epilogue_kernel), epi,
             {"HAS_BIAS": True, "OUT": 2, "BLOCK_M": 32, "BLOCK_N": 128, "ROUND": build(w8a8_triton.round_out)},
             {"enable_fp_fusion": False})):
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned.get(name)),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        ptx[name] = compiled.asm["ptx"]
        assert compiled.asm["cubin"]
    # the rotating kernels: one warpgroup tensor-core product per block, 16-byte loads and stores
    for name in ("rotate", "rotate_rows"):
        assert "wgmma.mma_async" in ptx[name] and "st.global.v4.b32" in ptx[name], name
        assert "div.rn.f32" in ptx[name], name
    for name in ("rotate", "rotate_rows", "rows", "nvfp4"):
        assert "cvt.rni.f32.f32" in ptx[name], name  # rint: nearest, ties to even
        assert "div.full.f32" not in ptx[name] and "div.approx" not in ptx[name], name
    assert "div.rn.f32" in ptx["rows"]
    assert "fma.rn.f32" not in ptx["epilogue"] and "mul.rn.f32" in ptx["epilogue"]


GPU_SHAPES = {"qkv_proj": (384, 1152), "fc2": (1536, 384)}  # (K, N) of block-like linears, M = 300 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_int_mm_path_is_its_cpu_emulation_bit_for_bit(name):
    """On CUDA the int8 linear runs the Triton quantizer, `torch._int_mm` (exact int32 accumulation) and the Triton
    epilogue; the CPU emulation accumulates exactly in float64 and runs the same epilogue: the same bits, bias
    included; an NVFP4 weight's int8 codes from the CUDA kernel equal the CPU reference's."""
    from h3direct.checkpoint.quant import nvfp4_triton

    k, n = GPU_SHAPES[name]
    g = torch.Generator().manual_seed(k + n)
    x = (torch.randn(300, k, generator=g) * torch.logspace(-2, 1, k)[None, :]).bfloat16()
    t = quantize_nvfp4((torch.randn(n, k, generator=g) * 0.02).bfloat16())
    s = w8a8.nvfp4_channel_scales(*t, "int8")
    w8 = w8a8.nvfp4_to_codes_reference(*t, s, "int8")
    on_gpu = nvfp4_triton.nvfp4_to_codes_triton(*(a.cuda() for a in t), s.cuda(), fmt="int8").cpu()
    assert torch.equal(on_gpu, w8)
    b = torch.randn(n, generator=g).bfloat16()
    with counting() as calls:
        y = w8a8.linear_w8a8(x.cuda(), w8.cuda(), s.cuda(), b.cuda()).cpu()
    # h3direct's kernel from Hopper on; before it cuBLASLt's, the path saying why
    path = ("int8_gemm" if torch.cuda.get_device_capability() >= (9, 0)
            else "int_mm (int8_gemm: compute capability < 9.0 (tensor descriptors: the TMA engine))")
    assert calls.as_dict() == {"fp8_linear": {path: 1}}, calls.as_dict()
    assert torch.equal(y, w8a8.linear_w8a8(x, w8, s, b))


# ---- the rotation (option fp8_linear_rotate) ---------------------------------------------------------------------

def test_the_rotation_leaves_the_product_and_spreads_a_tokens_outliers():
    """hadamard.rotate_rows: (x·R)(W·R)ᵀ = b·xWᵀ exactly (fp64), and a token with a few outlier channels comes out
    with its energy spread over each block, so its int8 error against the exact product falls; without outliers
    (i.i.d. entries) it changes little."""
    from h3direct.checkpoint.quant import hadamard

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=g, dtype=torch.float64), torch.randn(96, 512, generator=g, dtype=torch.float64)
    b = hadamard.block(512)
    assert torch.allclose(hadamard.rotate_rows(x) @ hadamard.rotate_rows(w).T, b * (x @ w.T), rtol=0, atol=1e-9)
    peaky = torch.randn(256, 512, generator=g)
    peaky[torch.arange(256), torch.randint(0, 512, (256,), generator=g)] *= 40  # one outlier channel per token
    wf = torch.randn(128, 512, generator=g)

    def int8_err(a, ww, rotate):
        exact = a.double() @ ww.double().T
        if rotate:
            a, ww = hadamard.rotate_rows(a), hadamard.rotate_rows(ww)
        a8, sa = w8a8.quantize_rows_int8(a)
        w8_, sw_ = w8a8.quantize_rows_int8(ww)
        y = (a8.double() * sa.double()[:, None]) @ (w8_.double() * sw_.double()[:, None]).T / (b if rotate else 1)
        return float((y - exact).norm() / exact.norm())

    assert int8_err(peaky, wf, True) < 0.5 * int8_err(peaky, wf, False)
    flat = torch.randn(256, 512, generator=g)
    assert 0.8 < int8_err(flat, wf, True) / int8_err(flat, wf, False) < 1.25


def test_a_rotated_int8_linear_is_the_rotated_product_and_its_option_is_checked():
    """FP8Linear with rotate: the weight's codes are those of W·R (W in bf16; scales carrying 1/b), the input is rotated before
    its quantization; stream (NVFP4 kept packed) and resident give the same bits. The option: none or a layer list,
    int8 only, and only with fp8_linear on."""
    from h3direct.checkpoint.quant import hadamard
    from h3direct.dit.linear import FP8Linear, NVFP4Linear
    from h3direct.dit.options import KernelOptions, Options, not_in_effect
    from h3direct.errors import RequestError

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.02).bfloat16()
    layer = NVFP4Linear(256, 64, bias=True, mode="w4a16")
    packed, block_scale, global_scale = quantize_nvfp4(w)
    layer.weight, layer.weight_scale, layer.weight_scale_2 = packed, block_scale, global_scale
    layer.bias = torch.nn.Parameter(torch.randn(64, generator=g).bfloat16(), requires_grad=False)
    x = torch.randn(40, 256, generator=g).bfloat16()
    stream, resident = (FP8Linear.from_module(layer, m, "int8", rotate=True) for m in ("stream", "resident"))
    assert torch.equal(stream(x), resident(x))
    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4

    rotated = hadamard.rotate_rows(dequantize_nvfp4(packed, block_scale, global_scale, torch.bfloat16)[:64, :256])
    w8_, sw_ = w8a8.quantize_rows_int8(rotated)  # the weight in bf16, rotated, per-channel int8
    assert torch.equal(resident.weight8, w8_) and torch.equal(resident.w_scale, sw_ / hadamard.block(256))
    assert torch.equal(resident(x), w8a8.linear_w8a8(hadamard.rotate_rows(x), w8_, sw_ / 128, layer.bias))
    with pytest.raises(ValueError, match="int8"):
        FP8Linear.from_module(layer, "stream", "e4m3", rotate=True)
    assert KernelOptions(fp8_linear_rotate="fc2,fc1").fp8_linear_rotate == "fc2,fc1"
    for bad in ("fc3", "fc1,fc1", ""):
        with pytest.raises(RequestError):
            KernelOptions(fp8_linear_rotate=bad)
    assert not_in_effect(Options(), ["fp8_linear_rotate"]) == ["fp8_linear_rotate"]
    from h3direct.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8_linear_rotate fc2: not among the 8-bit linears"):
        load_dit(FIX / "h3_fx_curve_nvfp4.safetensors", fp8_linear="stream", fp8_linear_format="int8",
                 fp8_linear_layers="fc1", fp8_linear_rotate="fc2")
    from h3direct.dit.linear import apply_fp8_linears

    with pytest.raises(ConfigError, match="fp8_linear_layers qkv_proj,out_proj,fc1,fc2"):  # every linear 8-bit
        apply_fp8_linears(torch.nn.Sequential(), "stream", None, "int8", rotate=("proj_in",))


_ROTATE_CHECK = textwrap.dedent("""
    import json, torch
    from h3direct.checkpoint.quant import hadamard, w8a8
    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    g = torch.Generator().manual_seed(5)
    out = {}
    # NVFP4 weights as a checkpoint holds them (block scales within a few binades: every block sum exact in fp32),
    # rows past a program's 64, K of 3 and of 42 Hadamard blocks of 128 (fc1's), a row of zeros
    for n, k in ((200, 384), (70, 5376), (33, 96)):
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        w[5] = 0
        w = dequantize_nvfp4(*quantize_nvfp4(w), torch.bfloat16)[:n, :k]
        s = w8a8.int8_row_scales(hadamard.rotate_rows(w))
        got, ref = w8a8.rotated_int8_codes(w, s), w8a8.rotated_int8_codes_reference(w, s)
        out[f"nvfp4_{n}x{k}"] = [int((got != ref).sum()), str(got.dtype), list(got.shape)]
    # columns spread over 2^-12 .. 2^12 (sums rounded in fp32, in an order of the kernel's own): within one code
    w = (torch.randn(64, 256, generator=g) * 2.0 ** torch.randint(-12, 13, (256,), generator=g)).bfloat16()
    s = w8a8.int8_row_scales(hadamard.rotate_rows(w))
    d = (w8a8.rotated_int8_codes(w, s).int() - w8a8.rotated_int8_codes_reference(w, s).int()).abs()
    out["spread"] = int(d.max())
    # a strided view (the padded storage's [:N, :K]) reads as its copy
    big = (torch.randn(80, 272, generator=g)).bfloat16()
    s = w8a8.int8_row_scales(hadamard.rotate_rows(big[:, :256].contiguous()))
    out["view"] = bool(torch.equal(w8a8.rotated_int8_codes(big[:, :256], s),
                                   w8a8.rotated_int8_codes_reference(big[:, :256], s)))
    # activations: the rotated rows' int8 codes and scales in one kernel, against quantize_rows_int8(rotate_rows(x))
    for m, k in ((70, 384), (130, 5376), (5, 96)):
        x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 0.5, k)[None, :]).bfloat16()
        x[3, 7] = 40.0  # an outlier channel
        x[1] = 0
        rows = w8a8.quantize_rotated_int8(x)
        q, sc = w8a8.quantize_rows_int8(hadamard.rotate_rows(x))
        out[f"act_{m}x{k}"] = [int((rows.data != q).sum()), bool(torch.equal(rows.scale, sc)), str(rows.dtype)]
    print("RESULT " + json.dumps(out))
""")


def test_the_rotating_kernels_are_their_references_under_the_interpreter():
    """`w8a8.rotated_int8_codes` (the stream path's per-call weight: rotate, round to bf16, encode, one Triton pass)
    against its torch reference: bit for bit on NVFP4 weights, whose block sums are exact in fp32; within one code
    where columns span 24 binades and the fp32 sums round in the kernel's own order (its stated rule). The rotated
    activation's int8 rows (`w8a8.quantize_rotated_int8`, one kernel): codes and scales bit for bit."""
    res = run_interpreted(_ROTATE_CHECK)
    assert res["nvfp4_200x384"] == [0, "torch.int8", [200, 384]]
    assert res["nvfp4_70x5376"] == [0, "torch.int8", [70, 5376]]
    assert res["nvfp4_33x96"] == [0, "torch.int8", [33, 96]]  # a Hadamard block of 32
    assert res["spread"] <= 1 and res["view"] is True
    for name in ("act_70x384", "act_130x5376", "act_5x96"):  # the rotated activations' rows (fc1's K among them)
        assert res[name] == [0, True, "torch.bfloat16"], (name, res[name])


@pytest.mark.gpu
def test_the_rotating_kernels_on_cuda_are_the_cpu_references():
    """The compiled kernels at a block linear's shape (fc2: K = 14,336 in 112 blocks of 128): on an NVFP4 weight the CPU
    reference's codes bit for bit; a rotated int8 FP8Linear that streams gives the resident one's output; the rotated
    activation's rows within their rule of the CPU's."""
    from h3direct.checkpoint.quant import hadamard
    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4
    from h3direct.dit.linear import NVFP4Linear

    g = torch.Generator().manual_seed(7)
    n, k = 1024, 14336
    q = quantize_nvfp4((torch.randn(n, k, generator=g) * 0.02).bfloat16())
    w = dequantize_nvfp4(*q, torch.bfloat16)[:n, :k]
    s = w8a8.int8_row_scales(hadamard.rotate_rows(w))
    assert torch.equal(w8a8.rotated_int8_codes(w.cuda(), s.cuda()).cpu(), w8a8.rotated_int8_codes_reference(w, s))
    layer = NVFP4Linear(k, n, bias=False, mode="w4a16")
    layer.weight, layer.weight_scale, layer.weight_scale_2 = q
    stream, resident = (FP8Linear.from_module(layer, m, "int8", rotate=True).cuda() for m in ("stream", "resident"))
    x = torch.randn(300, k, generator=g).bfloat16()
    assert torch.equal(stream(x.cuda()), resident(x.cuda()))
    # the rotated activation's rows from the one-pass kernel against the CPU's rotate_rows + quantize_rows_int8, under
    # the rule: fp32 sums in another order move a rotated value by at most one bf16 ulp, so a code by at most one
    # and a row's scale (its amax / 127) by at most one bf16 ulp
    rows = w8a8.quantize_rotated_int8(x.cuda())
    q, sc = w8a8.quantize_rows_int8(hadamard.rotate_rows(x))
    assert (rows.data.cpu().int() - q.int()).abs().max() <= 1
    assert ((rows.scale.cpu() - sc).abs() <= sc * 2.0 ** -8).all()
