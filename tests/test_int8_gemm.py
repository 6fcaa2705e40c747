"""The int8 GEMM kernel (`h3direct/checkpoint/quant/int8_gemm.py`): its output is its emulation's bit for bit (the
exact integer product through `w8a8.int8_epilogue`'s rounding) at shapes with partial tiles and K tails, with and
without bias, in every output dtype, under Triton's interpreter on the CPU and, on a GPU, in every tile shape
autotuning may pick; compiled for sm_90 it runs on the tensor cores' int8 path (wgmma s8), reads through the TMA
engine and keeps its epilogue free of fused multiply-adds."""

from __future__ import annotations

import re

import pytest
import torch
from interpreted import run_interpreted

# (M, N, K, bias): ragged on purpose; M = 5 is below cuBLASLt's int8 minimum, which this kernel has not
SHAPES = [(50, 48, 64, True), (37, 24, 48, False), (70, 40, 96, True), (5, 32, 48, True)]

_CHECK = """
import json, torch
from h3direct.checkpoint.quant import int8_gemm, w8a8
out = {}
for m, n, k, bias in %r:
    g = torch.Generator().manual_seed(m * n + k)
    x8, sx = w8a8.quantize_rows_int8(torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)[None, :])
    w8, sw = w8a8.quantize_rows_int8(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y = int8_gemm.int8_linear(x8, w8, sx, sw, b, dtype)
        ref = w8a8.int8_epilogue(x8.double() @ w8.double().T, sx, sw, b, dtype)
        out[f"{m}x{n}x{k} {dtype}"] = bool(torch.equal(y, ref))
print("RESULT " + json.dumps(out))
"""


def test_the_kernel_is_its_emulation_bit_for_bit_under_the_interpreter():
    res = run_interpreted(_CHECK % (SHAPES,))
    assert res and all(res.values()), res


@pytest.mark.parametrize("out", [2, 0], ids=["bf16", "fp32"])
def test_compiled_for_sm90_it_runs_int8_wgmma_through_tma_without_fma(out, tmp_path, monkeypatch):
    """Through Triton's whole compiler to sm_90 (no GPU needed), for a 16-bit output and for fp32 (an fp32 run's
    linears: the gate's fp32 traces)."""
    triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86_64 Linux)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3direct.checkpoint.quant import int8_gemm
    from h3direct.triton_build import SHARED_PER_BLOCK, build

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sig = {"a_ptr": "*i8", "b_ptr": "*i8", "sx_ptr": "*fp32", "sw_ptr": "*fp32",
           "bias_ptr": "*bf16" if out else "*fp32", "out_ptr": "*i16" if out else "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "HAS_BIAS": "constexpr", "OUT": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "PROGRAMS": "constexpr", "FLATTEN": "constexpr",
           "ROUND": "constexpr"}
    bm, bn, bk, group, warps, stages, flatten = int8_gemm.CONFIGS[0]
    c = triton.compile(ASTSource(fn=build(int8_gemm._int8_gemm_kernel), signature=sig, constexprs={
        "HAS_BIAS": True, "OUT": out, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
        "PROGRAMS": 132, "FLATTEN": flatten, "ROUND": build(int8_gemm.round_out)}),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    ptx = c.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\S*\.s32\.s8\.s8", ptx), "no int8 warpgroup MMA"
    assert "cp.async.bulk.tensor" in ptx, "operands not read through the TMA engine"
    assert "fma.rn.f32" not in ptx, "a fused multiply-add in the epilogue (its products must round as torch's)"
    limit = SHARED_PER_BLOCK[(9, 0)]
    assert c.metadata.shared <= limit, f"{c.metadata.shared} bytes of shared memory: over an H100's {limit}"


def test_the_tuned_config_is_chosen_per_output_dtype(monkeypatch):
    """A tile shape tuned for a 16-bit output is never reused for an fp32 one: the fp32 epilogue's tile takes twice
    the shared memory, and a shape that fits one may not fit the other (an H100 refused the fp32 run of the bf16
    choice)."""
    from h3direct.checkpoint.quant import int8_gemm

    tuned, launched = [], []
    monkeypatch.setattr(int8_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(int8_gemm, "_TUNED", {})
    monkeypatch.setattr(int8_gemm, "_autotune", lambda args: tuned.append(args[5]) or (len(tuned),))
    monkeypatch.setattr(int8_gemm, "_launch", lambda config, *args: launched.append((config, args[5])))
    x8, w8 = torch.zeros(64, 32, dtype=torch.int8), torch.zeros(48, 32, dtype=torch.int8)
    s = torch.ones(64), torch.ones(48)
    for dtype in (torch.bfloat16, torch.float32, torch.bfloat16, torch.float32):
        int8_gemm.int8_linear(x8, w8, *s, None, dtype)
    assert tuned == [torch.bfloat16, torch.float32]
    assert launched == [((1,), torch.bfloat16), ((2,), torch.float32), ((1,), torch.bfloat16), ((2,), torch.float32)]
    assert int8_gemm.tuned(x8, w8, torch.float32) == (2,)


def _on_a_spark(monkeypatch, shared: dict) -> int:
    """A GPU of compute capability 12.1 as `int8_gemm` sees one, whose compiled tile shapes take `shared[config]`
    bytes of shared memory; its limit per block."""
    from h3direct import triton_build
    from h3direct.checkpoint.quant import int8_gemm
    from tests.spark_image import SPARK, gb10_properties, gpu_seams

    for obj, name, value in gpu_seams(SPARK, gb10_properties()):
        monkeypatch.setattr(obj, name, value)
    monkeypatch.setattr(int8_gemm, "_compiled_shared", lambda index, n, k, out, bias, config: shared[config])
    monkeypatch.setattr(int8_gemm, "_FITTING", {})
    return triton_build.SHARED_PER_BLOCK[(12, 1)]


def test_autotuning_launches_only_the_tile_shapes_that_fit_the_gpu(monkeypatch):
    """A tile shape whose compiled kernel takes more shared memory than a block may on the GPU is never launched there
    (on the Spark, 99 KiB); one that takes exactly the limit is tried."""
    import triton.testing

    from h3direct.checkpoint.quant import int8_gemm

    configs = int8_gemm.CONFIGS
    limit = _on_a_spark(monkeypatch, {})
    shared = {c: limit + (i % 3) - 1 for i, c in enumerate(configs)}  # one below, at, and one over the limit
    monkeypatch.setattr(int8_gemm, "_compiled_shared", lambda index, n, k, out, bias, config: shared[config])
    launched = []
    monkeypatch.setattr(int8_gemm, "_launch", lambda config, *args: launched.append(config))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or len(launched))
    x8, w8 = torch.zeros(64, 32, dtype=torch.int8), torch.zeros(48, 32, dtype=torch.int8)
    args = (x8, w8, torch.ones(64), torch.ones(48), None, torch.bfloat16, None, None)
    int8_gemm._autotune(args)
    fit = [c for c in configs if shared[c] <= limit]
    assert fit and len(fit) < len(configs)
    assert sorted(set(launched)) == sorted(fit), launched
    assert int8_gemm.fitting(torch.device("cuda", 0), 48, 32, torch.bfloat16, None).configs == fit


def test_a_gpu_where_no_tile_shape_fits_routes_the_int8_linears_away_with_the_reason(monkeypatch):
    """No tile shape fits: the kernel refuses the operands in one line (the limit and the smallest kernel), which the
    int8 linear's dispatch passes on (it then runs cuBLASLt's int8 GEMM: `int_mm (int8_gemm: <the line>)`), and
    autotuning, should it be asked, raises it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from h3direct.checkpoint.quant import int8_gemm, w8a8

    limit = _on_a_spark(monkeypatch, {})
    shared = {c: limit + 1 + i for i, c in enumerate(int8_gemm.CONFIGS)}
    monkeypatch.setattr(int8_gemm, "_compiled_shared", lambda index, n, k, out, bias, config: shared[config])
    with FakeTensorMode(allow_non_fake_inputs=True):  # CUDA tensors as far as the dispatch asks
        x2 = torch.empty(64, 32, dtype=torch.bfloat16, device="cuda")
        x8, w8 = torch.empty(64, 32, dtype=torch.int8, device="cuda"), torch.empty(48, 32, dtype=torch.int8, device="cuda")
        line = f"no tile shape fits the {limit} bytes of shared memory a block may take on this GPU " \
               f"(the smallest takes {limit + 1})"
        assert int8_gemm.reason(x8, w8, torch.bfloat16) == line
        assert int8_gemm.reason(x8, w8) is None  # without the output dtype: the operands alone
        assert w8a8._triton_gemm_reason(x2, x8, w8, torch.bfloat16, None) == line
        with pytest.raises(RuntimeError, match=re.escape(line)):
            int8_gemm._autotune((x8, w8, None, None, None, torch.bfloat16, None, None))
    shared[int8_gemm.CONFIGS[-1]] = limit  # one that fits: the kernel takes them
    monkeypatch.setattr(int8_gemm, "_FITTING", {})
    with FakeTensorMode(allow_non_fake_inputs=True):
        x8, w8 = torch.empty(64, 32, dtype=torch.int8, device="cuda"), torch.empty(48, 32, dtype=torch.int8, device="cuda")
        assert int8_gemm.reason(x8, w8, torch.bfloat16) is None


GPU_SHAPES = [(300, 1152, 384, True), (4099, 640, 1536, False), (17, 384, 1152, True)]

def test_autotuning_raises_what_a_fitting_tile_shape_raises(monkeypatch):
    """Autotuning launches only the tile shapes that fit (`fitting`, from their compiled size): an error one of them
    raises is a bug in the kernel or its launch, raised, never taken for a shape that does not fit; without a planted
    error the fastest is chosen."""
    import triton.testing

    from h3direct.checkpoint.quant import int8_gemm

    configs = [("fast",), ("slow",)]
    ms = {("fast",): 1.0, ("slow",): 2.0}
    monkeypatch.setattr(int8_gemm, "CONFIGS", configs)
    monkeypatch.setattr(int8_gemm, "fitting", lambda *a: int8_gemm.Fitting(100, {c: 100 for c in configs}))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())

    def launch(refuse):
        def run(config, *args):
            if config in refuse:
                raise refuse[config]
            return ms[config]
        return run

    args = (torch.zeros(4, 4, dtype=torch.int8), torch.zeros(4, 4, dtype=torch.int8), None, None, None,
            torch.bfloat16, None, None)
    monkeypatch.setattr(int8_gemm, "_launch", launch({}))
    assert int8_gemm._autotune(args) == ("fast",)
    monkeypatch.setattr(int8_gemm, "_launch", launch({("slow",): ValueError("planted: a bug in the launch")}))
    with pytest.raises(ValueError, match="planted"):
        int8_gemm._autotune(args)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, *__import__("h3direct.checkpoint.quant.int8_gemm",
                                                       fromlist=["CONFIGS"]).CONFIGS], ids=str)
def test_every_config_is_cublas_int_mm_through_the_same_epilogue_bit_for_bit(config):
    from triton.runtime.errors import OutOfResources

    from h3direct.checkpoint.quant import int8_gemm, w8a8, w8a8_triton

    if int8_gemm.reason(torch.empty(1, 16, dtype=torch.int8, device="cuda"),
                        torch.empty(1, 16, dtype=torch.int8, device="cuda")) is not None:
        pytest.fail("the GPU lane's GPU must run the int8 kernel (compute capability >= 9.0)")
    for m, n, k, bias in GPU_SHAPES:
        g = torch.Generator().manual_seed(m + n + k)
        x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)[None, :]).bfloat16().cuda()
        x8, sx = w8a8.quantize_activation(x, "int8")
        w8, sw = w8a8.format_functions("int8")[0]((torch.randn(n, k, generator=g) * 0.02).cuda())
        b = torch.randn(n, generator=g).bfloat16().cuda() if bias else None
        for dtype in (torch.bfloat16, torch.float32):  # fp32: an fp32 run's linears (the gate's fp32 traces)
            bd = None if b is None else b.to(dtype)
            try:
                y = int8_gemm.int8_linear(x8, w8, sx, sw, bd, dtype, config)
            except OutOfResources:
                # an fp32 epilogue tile takes twice a 16-bit one's shared memory: a tile shape may not fit it (then
                # autotuning passes it over), but every shape fits 16-bit outputs, and the tuned kernel runs both
                if config is None or dtype != torch.float32:
                    raise
                continue
            if m > 16:  # torch._int_mm needs M > 16
                ref = w8a8_triton.int8_epilogue(torch._int_mm(x8, w8.t()), sx, sw, bd, dtype)
                assert torch.equal(y, ref), (config, m, n, k, dtype)
            cpu = w8a8.int8_epilogue(x8.cpu().double() @ w8.cpu().double().T, sx.cpu(), sw.cpu(),
                                     None if bd is None else bd.cpu(), dtype)
            assert torch.equal(y.cpu(), cpu), (config, m, n, k, dtype)


@pytest.mark.gpu
def test_the_fit_is_the_gpus_own_verdict():
    """`triton_build.SHARED_PER_BLOCK` for this GPU is what the GPU reports, and `int8_gemm.fitting` (compiled, never
    launched) predicts every tile shape's launch: those it keeps run, those it leaves out are refused by the GPU for
    shared memory, on the DiT's fp32 and bf16 outputs, with and without bias."""
    from triton.runtime.errors import OutOfResources

    from h3direct import triton_build
    from h3direct.checkpoint.quant import int8_gemm

    props = torch.cuda.get_device_properties(0)
    assert triton_build.SHARED_PER_BLOCK[torch.cuda.get_device_capability(0)] == props.shared_memory_per_block_optin
    m, n, k = 300, 1152, 384
    x8 = torch.ones(m, k, dtype=torch.int8, device="cuda")
    w8 = torch.ones(n, k, dtype=torch.int8, device="cuda")
    sx, sw = torch.ones(m, device="cuda"), torch.ones(n, device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for bias in (None, torch.ones(n, dtype=dtype, device="cuda")):
            fits = int8_gemm.fitting(x8.device, n, k, dtype, None if bias is None else bias.dtype)
            assert fits.configs, fits.refusal
            for config in int8_gemm.CONFIGS:
                try:
                    int8_gemm.int8_linear(x8, w8, sx, sw, bias, dtype, config)
                    ran = True
                except OutOfResources:
                    ran = False
                assert ran == (config in fits.configs), (config, dtype, bias is None, fits.shared[config])
