"""The Triton NVFP4 dequantization kernel (`nvfp4_triton`) under Triton's CPU interpreter (TRITON_INTERPRET=1),
bitwise against the torch path of `nvfp4.dequantize_nvfp4` (itself bitwise comfy-kitchen's kernel and the shared
ComfyUI traces, `tests/test_quant_nvfp4.py`), on raw random storage: every byte of codes, every non-NaN E4M3 scale
(subnormals, ±0, ±448), padded shapes and partial programs. The compiled kernel is compiled for sm_90 here and run
by the `gpu` tests at the end (`pytest -m gpu`)."""

from __future__ import annotations

import re

import pytest
import torch

from h3direct.checkpoint.quant import nvfp4, nvfp4_triton, w8a8
from h3direct.traces.metrics import bit_mismatch
from h3direct.triton_build import FP_OPTIONS

pytestmark = pytest.mark.skipif(nvfp4_triton.triton is None, reason="needs Triton (the `test` extra installs it on "
                                                                    "x86_64 Linux) to run the kernel in its interpreter")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
# every E4M3 byte but the two NaNs (0x7F, 0xFF): zero, -0, subnormals 0x01..0x07, the max 448 (0x7E), negatives
SCALE_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
GLOBALS = [1.0, 3.0517578125e-05, 1.2345678e-3, 7.77e-7]  # 7.77e-7 is an fp16 subnormal, 1.2345678e-3 rounds in bf16


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert (diff := bit_mismatch(ours, ref)) is None, f"{what}: {diff}"


def random_storage(rows: int, cols: int, g: torch.Generator, global_scale: float) -> nvfp4.NVFP4Tensor:
    """Raw NVFP4 storage of a padded [rows, cols] weight: uniform random bytes of codes, block scales drawn from
    every non-NaN E4M3 byte (swizzled, zero in the tile padding), a given global scale."""
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    first = packed.view(-1)[:256]  # every byte value once where there is room (all 16 codes in both nibbles)
    first.copy_(torch.arange(len(first), dtype=torch.uint8))
    idx = torch.randint(0, len(SCALE_BYTES), (rows, cols // 16), generator=g)
    scales = SCALE_BYTES[idx].view(torch.float8_e4m3fn)
    return nvfp4.NVFP4Tensor(packed, nvfp4.swizzle_block_scales(scales), torch.tensor(global_scale))


# (logical N, K): padded to 16 in storage; 130/200/300 rows cross the 128-row scale tiles, 17 and 23 blocks a row
# leave padded scale columns; 256 blocks per program -> the last program is partial except for 256 x 256
SHAPES = [(1, 16), (130, 48), (37, 160), (200, 96), (300, 270), (256, 256), (129, 368)]


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bitwise_torch_path_random_storage(shape, out_dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    rows, cols = nvfp4.padded_shape(shape)
    for gs in GLOBALS:
        q = random_storage(rows, cols, g, gs)
        ref = nvfp4.dequantize_nvfp4(*q, out_dtype, backend="torch")
        got = nvfp4_triton.dequantize_nvfp4_triton(*q, out_dtype, config=(256, 4))
        assert_same_bits(got, ref, f"{shape} global {gs}")


@pytest.mark.parametrize("config", [(64, 1), (128, 4), (1024, 8)])
def test_bitwise_quantized_weight_and_configs(config):
    """A weight as the checkpoint holds it (quantize_nvfp4 of a bf16 tensor) through the other program sizes."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(150, 200, generator=g) * torch.logspace(-3, 1, 200)).bfloat16()
    q = nvfp4.quantize_nvfp4(w)
    for out_dtype in DTYPES:
        assert_same_bits(nvfp4_triton.dequantize_nvfp4_triton(*q, out_dtype, config=config),
                         nvfp4.dequantize_nvfp4(*q, out_dtype, backend="torch"), f"{config} {out_dtype}")


def _e4m3_cases(q: nvfp4.NVFP4Tensor) -> list[tuple[str, torch.Tensor]]:
    """Row scales for the e4m3 conversion: the layer's own (from its fp32 decode, as the FP8 linears take them), a
    third of them (values clamp at ±448), and 2^20 times them (values fall into e4m3's subnormals and to ±0)."""
    own = w8a8.nvfp4_channel_scales(*q)
    return [("own", own), ("clamping", own / 3), ("underflowing", own * 2.0 ** 20)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_e4m3_conversion_bitwise_random_storage(shape):
    """NVFP4 -> e4m3 under per-row scales (the FP8 linears' stream mode, every call): bitwise the torch reference
    (`w8a8.nvfp4_to_e4m3_reference`, e4m3(fp32 decode / row scale)) on raw random storage: every code, every non-NaN
    block-scale byte (subnormals, ±0, 448), partial programs (256 blocks a program)."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1] + 7)
    rows, cols = nvfp4.padded_shape(shape)
    for gs in GLOBALS[:2]:
        q = random_storage(rows, cols, g, gs)
        for what, rs in _e4m3_cases(q):
            got = nvfp4_triton.nvfp4_to_e4m3_triton(*q, rs, config=(256, 4))
            assert got.dtype == torch.float8_e4m3fn and got.shape == (rows, cols)
            assert_same_bits(got, w8a8.nvfp4_to_e4m3_reference(*q, rs), f"{shape} global {gs} {what} scales")


def test_e4m3_conversion_catches_a_wrong_row_scale():
    """The bitwise check above can fail: one row's scale 1 % off moves codes of that row, and only of that row."""
    rows, cols = nvfp4.padded_shape((64, 96))
    q = random_storage(rows, cols, torch.Generator().manual_seed(8), 1.0)
    rs = w8a8.nvfp4_channel_scales(*q)
    bumped = rs.clone()
    bumped[5] = rs[5] * 1.01
    got = nvfp4_triton.nvfp4_to_e4m3_triton(*q, bumped, config=(64, 1)).view(torch.uint8)
    ref = w8a8.nvfp4_to_e4m3_reference(*q, rs).view(torch.uint8)
    diff = (got != ref).any(dim=1)
    assert diff[5] and int(diff.sum()) == 1


def test_every_code_and_negative_zero():
    """Each of the 16 codes, as both nibbles, under scale 1 and global 1: the E2M1 table itself, -0.0 included."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = ((codes[:, None] << 4) | codes[None, :]).reshape(16, 16)  # row r: high nibble r, low nibble 0..15
    scales = torch.ones(16, 2).to(torch.float8_e4m3fn)
    out = nvfp4_triton.dequantize_nvfp4_triton(packed, nvfp4.swizzle_block_scales(scales), torch.tensor(1.0),
                                               torch.float32, config=(16, 1))
    table = nvfp4.e2m1_table(torch.float32)
    expect = torch.stack([table[(packed >> 4).long()], table[(packed & 15).long()]], dim=-1).reshape(16, 32)
    assert_same_bits(out, expect, "codes")
    assert torch.signbit(out[8, 0]) and out[8, 0] == 0  # code 8 is -0.0


def test_swizzle_per_block_scales():
    """Every block gets its own scale (codes all 1.0): block (r, b) of the output must equal scale[r, b] read from the
    row-major grid, not from wherever a wrong tile formula points. Feeding the row-major grid unswizzled fails."""
    rows, nb = 272, 23  # 3 row tiles (the last partial), 6 scale-column tiles (the last partial)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(1, len(SCALE_BYTES), (rows, nb), generator=g)
    scales = SCALE_BYTES[idx].view(torch.float8_e4m3fn)
    packed = torch.full((rows, nb * 8), 0x22, dtype=torch.uint8)  # code 2 = 1.0 in both nibbles
    out = nvfp4_triton.dequantize_nvfp4_triton(packed, nvfp4.swizzle_block_scales(scales), torch.tensor(1.0),
                                               torch.float32, config=(128, 4))
    expect = scales.to(torch.float32).repeat_interleave(16, dim=1)
    assert_same_bits(out, expect, "per-block scales")
    rp, cp = nvfp4.scale_storage_shape(rows, nb)
    flat = torch.zeros(rp, cp, dtype=torch.uint8)
    flat[:rows, :nb] = scales.view(torch.uint8)
    wrong = nvfp4_triton.dequantize_nvfp4_triton(packed, flat.view(torch.float8_e4m3fn), torch.tensor(1.0),
                                                 torch.float32, config=(128, 4))
    assert (_bits(wrong) != _bits(expect)).float().mean() > 0.9


def test_nan_scales_give_nan():
    """E4M3 NaN block scales (never written by quantization) decode to NaN, as on the torch path."""
    scales = torch.tensor([[0x7F, 0x38], [0xFF, 0x00]], dtype=torch.uint8).repeat(8, 1).view(torch.float8_e4m3fn)
    q = nvfp4.NVFP4Tensor(torch.full((16, 16), 0x35, dtype=torch.uint8), nvfp4.swizzle_block_scales(scales),
                          torch.tensor(0.5))
    for out_dtype in DTYPES:
        got = nvfp4_triton.dequantize_nvfp4_triton(*q, out_dtype, config=(16, 1))
        ref = nvfp4.dequantize_nvfp4(*q, out_dtype, backend="torch")
        assert torch.equal(got.isnan(), ref.isnan()) and got.isnan().sum() == 256
        assert torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_bad_storage_is_a_one_line_error():
    from h3direct.errors import CheckpointError

    q = nvfp4.quantize_nvfp4(torch.randn(32, 64))
    with pytest.raises(CheckpointError, match="block-scale tensor"):
        nvfp4_triton.dequantize_nvfp4_triton(q.packed, q.block_scale[:64], q.global_scale)
    with pytest.raises(ValueError, match="not supported"):
        nvfp4_triton.dequantize_nvfp4_triton(*q, torch.int32)


def test_backend_choice():
    """The CPU always decodes on the torch path; on CUDA the option nvfp4_dequant picks (auto: Triton when
    importable), and a bad value is a one-line error, at startup when it comes from the environment."""
    from h3direct.app.env import read_options
    from h3direct.errors import ConfigError

    assert nvfp4.dequant_backend("cpu") == "torch"
    assert nvfp4.dequant_backend("cpu", "kitchen") == "torch"
    assert nvfp4.dequant_backend("cuda", "triton") == "triton"
    assert nvfp4.dequant_backend("cuda", "torch") == "torch"
    assert nvfp4.dequant_backend("cuda") == "triton"  # Triton is importable here (module skip otherwise)
    with pytest.raises(ValueError, match="nvfp4_dequant 'cutlass'"):
        nvfp4.dequant_backend("cuda", "cutlass")
    assert read_options({"H3_NVFP4_DEQUANT": "torch"}) == {"nvfp4_dequant": "torch"}
    with pytest.raises(ConfigError, match="H3_NVFP4_DEQUANT='cutlass'"):
        read_options({"H3_NVFP4_DEQUANT": "cutlass"})


@pytest.mark.parametrize("out_dtype", DTYPE_IDS)
def test_compiles_for_hopper_with_wide_memory_access(out_dtype, monkeypatch):
    """Compiled mode (what the GPU runs), without a GPU: the kernel lowers to sm_90 PTX whose stores are 16-byte
    vectors and (bf16/fp16) whose roundings are the packed round-to-nearest-even conversions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET")
    tr = nvfp4_triton.triton
    code = {"bf16": 2, "fp16": 1, "fp32": 0}[out_dtype]
    sig = {"words_ptr": "*i32", "scale_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*fp32" if code == 0 else "*i16",
           "rs_ptr": "*fp32", "total": "i32", "NB": "i32", "TILES_PER_ROW": "i32", "BLK": "constexpr",
           "OUT": "constexpr", "EVEN": "constexpr", "INTERPRET": "constexpr", "ENCODE": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}  # pointers and `total`, as a launch specializes
    blk, warps = nvfp4_triton.LAUNCH[(9, 0)]["nvfp4_dequant"]  # the Hopper entry
    try:
        k = tr.compile(ASTSource(tr.jit(nvfp4_triton._dequant_kernel), sig,
                                 {"BLK": blk, "OUT": code, "EVEN": False, "INTERPRET": False, "ENCODE": None},
                                 aligned),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **FP_OPTIONS})
    except (RuntimeError, FileNotFoundError, ImportError) as exc:  # no CUDA toolchain in this Triton install
        if "ptxas" in str(exc) or "CUDA" in str(exc) or isinstance(exc, (FileNotFoundError, ImportError)):
            pytest.skip(f"Triton cannot compile for CUDA here: {str(exc).splitlines()[0]}")
        raise
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    stores = set(re.findall(r"st\.global(?:\.\w+)*", ptx))
    assert stores == {"st.global.v4.b32"}, stores
    assert "mul.ftz" not in ptx  # the E2M1 code 0.5 goes through an fp32 subnormal
    if code == 2:
        assert "cvt.rn.bf16x2.f32" in ptx
    elif code == 1:
        assert "cvt.rn.f16x2.f32" in ptx


# ---- the compiled kernel on a GPU (`pytest -m gpu`) ---------------------------------------------------------------

BLOCK_WEIGHTS = [("qkv", 21504, 5376), ("out", 5376, 7168), ("fc1", 28672, 5376), ("fc2", 5376, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
def test_compiled_kernel_on_cuda(out_dtype, monkeypatch):
    """Random storage (every code and non-NaN scale byte, a global scale that rounds): bitwise the torch path run on
    the CPU, which the CPU traces were recorded with."""
    monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(3)
    for shape in ((300, 270), (1024, 2048)):
        rows, cols = nvfp4.padded_shape(shape)
        q = random_storage(rows, cols, g, 1.2345678e-3)
        ref = nvfp4.dequantize_nvfp4(*q, out_dtype, backend="torch")
        for config in (None, *nvfp4_triton.CONFIGS):
            got = nvfp4_triton.dequantize_nvfp4_triton(*(t.cuda() for t in q), out_dtype, config=config)
            assert_same_bits(got.cpu(), ref, f"cuda {shape} {config}")


@pytest.mark.parametrize("kernel", ["nvfp4_dequant", "nvfp4_e4m3"])
def test_launch_config_by_compute_capability(kernel, monkeypatch):
    """The Hopper entry on sm_90, the untuned default on any other GPU and on the CPU; every table holds both uses of
    the kernel, each a config of the sweep."""
    from h3direct import triton_build

    monkeypatch.setattr(triton_build, "capability", lambda index: (9, 0))
    assert nvfp4_triton.launch_config(kernel, torch.device("cuda", 0)) == nvfp4_triton.LAUNCH[(9, 0)][kernel]
    monkeypatch.setattr(triton_build, "capability", lambda index: (12, 1))
    assert nvfp4_triton.launch_config(kernel, torch.device("cuda", 0)) == nvfp4_triton.DEFAULT_LAUNCH[kernel]
    assert nvfp4_triton.launch_config(kernel, torch.device("cpu")) == nvfp4_triton.DEFAULT_LAUNCH[kernel]
    for table in (nvfp4_triton.DEFAULT_LAUNCH, *nvfp4_triton.LAUNCH.values()):
        assert set(table) == {"nvfp4_dequant", "nvfp4_e4m3"} and table[kernel] in nvfp4_triton.CONFIGS


@pytest.mark.gpu
def test_compiled_e4m3_conversion_on_cuda(monkeypatch):
    """The e4m3 conversion compiled: random storage (every code and non-NaN scale byte) under the layer's own,
    clamping and underflowing row scales, every launch config: bitwise the torch reference run on the CPU."""
    monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(4)
    for shape in ((300, 270), (1024, 2048)):
        rows, cols = nvfp4.padded_shape(shape)
        q = random_storage(rows, cols, g, 1.2345678e-3)
        for what, rs in _e4m3_cases(q):
            ref = w8a8.nvfp4_to_e4m3_reference(*q, rs)
            for config in (None, *nvfp4_triton.CONFIGS):
                got = nvfp4_triton.nvfp4_to_e4m3_triton(*(t.cuda() for t in q), rs.cuda(), config=config)
                assert_same_bits(got.cpu(), ref, f"cuda {shape} {what} {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, n, k", BLOCK_WEIGHTS, ids=[w[0] for w in BLOCK_WEIGHTS])
def test_compiled_e4m3_conversion_block_weights_every_config(name, n, k, monkeypatch):
    """The full model's four block-linear weights through `w8a8.nvfp4_to_e4m3` (what a stream FP8 linear calls): the
    Triton kernel on CUDA, every launch config, bitwise the torch reference computed on the CPU."""
    monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator(device="cpu").manual_seed(n + k + 1)
    q = nvfp4.quantize_nvfp4((torch.randn(n, k, generator=g) * 0.02).bfloat16())
    rs = w8a8.nvfp4_channel_scales(*q)
    ref = w8a8.nvfp4_to_e4m3_reference(*q, rs)
    on_gpu = [t.cuda() for t in (*q, rs)]
    assert_same_bits(w8a8.nvfp4_to_e4m3(*on_gpu).cpu(), ref, f"{name} default config")
    for config in nvfp4_triton.CONFIGS:
        got = nvfp4_triton.nvfp4_to_e4m3_triton(*on_gpu, config=config)
        assert_same_bits(got.cpu(), ref, f"{name} config {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, n, k", BLOCK_WEIGHTS, ids=[w[0] for w in BLOCK_WEIGHTS])
def test_compiled_kernel_block_weights_every_config(name, n, k, monkeypatch):
    """The full model's four block-linear weights as the checkpoint holds them: every launch config gives the torch
    path's bits on the GPU, in each output dtype."""
    monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator(device="cpu").manual_seed(n + k)
    q = nvfp4.quantize_nvfp4((torch.randn(n, k, generator=g) * 0.02).to("cuda", torch.bfloat16))
    for out_dtype in DTYPES:
        ref = nvfp4.dequantize_nvfp4(*q, out_dtype, backend="torch")
        for config in nvfp4_triton.CONFIGS:
            got = nvfp4_triton.dequantize_nvfp4_triton(*q, out_dtype, config=config)
            assert_same_bits(got, ref, f"{name} {out_dtype} config {config}")
