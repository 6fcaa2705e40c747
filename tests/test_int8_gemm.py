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
    from h3direct.triton_build import build

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
    assert c.metadata.shared <= HOPPER_SHARED_BYTES, f"{c.metadata.shared} bytes of shared memory: not on an H100"


HOPPER_SHARED_BYTES = 232_448  # the most shared memory one block may take on sm_90 (227 KiB)


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


GPU_SHAPES = [(300, 1152, 384, True), (4099, 640, 1536, False), (17, 384, 1152, True)]

def test_autotuning_passes_over_a_tile_shape_out_of_resources_and_raises_anything_else(monkeypatch):
    """Only Triton's OutOfResources means "this tile shape does not fit this GPU": autotuning then times the others
    and picks the fastest that ran; any other error (a bug in the kernel or its launch) is raised, not taken for a
    shape that does not fit; none that fits is one error."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    from h3direct.checkpoint.quant import int8_gemm

    configs = [("big",), ("fast",), ("slow",)]
    ms = {("fast",): 1.0, ("slow",): 2.0}
    monkeypatch.setattr(int8_gemm, "CONFIGS", configs)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())

    def launch(refuse):
        def run(config, *args):
            if config in refuse:
                raise refuse[config]
            return ms[config]
        return run

    monkeypatch.setattr(int8_gemm, "_launch", launch({("big",): OutOfResources(300_000, 232_448, "shared memory")}))
    assert int8_gemm._autotune(()) == ("fast",)
    monkeypatch.setattr(int8_gemm, "_launch", launch({("big",): OutOfResources(300_000, 232_448, "shared memory"),
                                                      ("fast",): ValueError("planted: a bug in the launch")}))
    with pytest.raises(ValueError, match="planted"):
        int8_gemm._autotune(())
    monkeypatch.setattr(int8_gemm, "_launch", launch({c: OutOfResources(1, 0, "shared memory") for c in configs}))
    with pytest.raises(RuntimeError, match="no int8 GEMM config fits"):
        int8_gemm._autotune(())



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
