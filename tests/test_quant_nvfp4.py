"""NVFP4 codec and linears against comfy-kitchen (the code ComfyUI calls) and ComfyUI's CPU traces (the committed
fixture and, marker `shared`, ../shared/oracle's)."""

from __future__ import annotations

import json
from pathlib import Path

import comfy_kitchen as ck  # comfy-kitchen (the `kitchen` extra) is the NVFP4 reference (installed by CI)
import pytest
import torch
import torch.nn.functional as F
from comfy_kitchen.float_utils import from_blocked, to_blocked
from comfy_kitchen.tensor import QuantizedTensor
from comfy_kitchen.tensor import TensorCoreNVFP4Layout as CKNVFP4Layout
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from h3direct.checkpoint.quant import nvfp4
from parity_tests.discovery import FIXTURES, SHARED_ORACLE

SHARED_NVFP4 = ["h3_tiny_nvfp4", "h3_tiny_curve_nvfp4"]  # quantized by ComfyUI from the shared bf16 files
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# Tolerances (the only non-bitwise comparisons in this file), with where each number comes from.
TOLERANCES = {
    # W4A16 vs the shared bf16-compute traces: the bf16 GEMM's accumulation order depends on the CPU kernel /
    # thread count; measured: 1 element of 26112 (qkv) / 34816 (fc1) differs by 1 bf16 ulp, the rest bitwise.
    ("w4a16_trace", "bf16"): {"max_ulps": 1, "max_mismatch_frac": 1e-3},
    # W4A4 emulation vs comfy-kitchen dequantize(x)·dequantize(w)ᵀ in fp32: same products, different
    # association of the global scales (fp32 reassociation, a few ulps of the accumulated result).
    ("w4a4_vs_dequant", "fp32"): {"rtol": 1e-5, "atol": 1e-6},
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as same-width integers so -0.0 vs 0.0 and NaN payloads count as differences."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype} != {ref.dtype}"
    diff = (bits(ours) != bits(ref)).nonzero()
    if len(diff):
        i = tuple(diff[0].tolist())
        raise AssertionError(f"{what}: {len(diff)} elements differ, first at {i}: ours {ours[i].item()!r} "
                             f"ref {ref[i].item()!r}")


def load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def shared(name: str) -> dict[str, torch.Tensor]:
    return load(SHARED_ORACLE / f"{name}.safetensors")


def nvfp4_prefixes(sd: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len("weight_scale_2")] for k in sd if k.endswith(".weight_scale_2"))


# ---------------------------------------------------------------- the NVFP4 checkpoints

# every NVFP4 checkpoint decoded bitwise like comfy-kitchen decodes it: the shared ones and the committed fixture
NVFP4_FILES = [pytest.param(SHARED_ORACLE / f"{n}.safetensors", id=n, marks=pytest.mark.shared) for n in SHARED_NVFP4]
NVFP4_FILES += [pytest.param(FIXTURES / "h3_fx_curve_nvfp4.safetensors", id="h3_fx_curve_nvfp4")]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("path", NVFP4_FILES)
def test_dequantize_every_layer_bitwise(path, out_dtype):
    sd = load(path)
    prefixes = nvfp4_prefixes(sd)
    assert len(prefixes) == 12  # 3 blocks (2 DiT + 1 refiner) x 4 linears
    for p in prefixes:
        packed, bs, gs = sd[p + "weight"], sd[p + "weight_scale"], sd[p + "weight_scale_2"]
        ref = ck.dequantize_nvfp4(packed, gs, bs, out_dtype)
        assert_bitwise(nvfp4.dequantize_nvfp4(packed, bs, gs, out_dtype), ref, p)


@pytest.mark.shared
@pytest.mark.parametrize("name", SHARED_NVFP4)
def test_quantize_reproduces_shared_bytes(name):
    """The shared NVFP4 files were made by ComfyUI's TensorCoreNVFP4Layout.quantize from the bf16 weights."""
    sd, master = shared(name), shared(name.replace("nvfp4", "bf16"))
    for p in nvfp4_prefixes(sd):
        q = nvfp4.quantize_nvfp4(master[p + "weight"])
        assert_bitwise(q.packed, sd[p + "weight"], p + "weight")
        assert_bitwise(q.block_scale, sd[p + "weight_scale"], p + "weight_scale")
        assert_bitwise(q.global_scale, sd[p + "weight_scale_2"], p + "weight_scale_2")


@pytest.mark.shared
def test_global_scale_is_computed_in_the_weight_dtype():
    """A fp32 quotient of the same bf16 weights does not give the stored scale (guards the dtype choice)."""
    sd, master = shared("h3_tiny_nvfp4"), shared("h3_tiny_bf16")
    p = "blocks.0.attn.qkv_proj."
    w = master[p + "weight"]
    fp32_quotient = torch.amax(w.float().abs()) / (448.0 * 6.0)
    assert not torch.equal(fp32_quotient, sd[p + "weight_scale_2"])
    assert torch.equal(nvfp4.nvfp4_global_scale(w), sd[p + "weight_scale_2"])


# ---------------------------------------------------------------- swizzle layout

@given(rows=st.integers(1, 300), cols=st.integers(1, 13))
@settings(max_examples=30, deadline=None)
def test_swizzle_matches_comfy_kitchen(rows, cols):
    g = torch.Generator().manual_seed(rows * 31 + cols)
    scales = torch.randint(0, 0x7E, (rows, cols), dtype=torch.uint8, generator=g)
    ref = to_blocked(scales, flatten=False)
    ours = nvfp4.swizzle_block_scales(scales)
    assert_bitwise(ours, ref, "swizzle")
    assert_bitwise(nvfp4.unswizzle_block_scales(ours, rows, cols), from_blocked(ref, rows, cols), "unswizzle")


# ---------------------------------------------------------------- random tensors (hypothesis)

@st.composite
def weights(draw):
    """Odd shapes, all-zero blocks, blocks ~1e-6 of the tensor max, exact +-max entries, and a global-scale
    factor < 1 that saturates block scales at 448 (values then clamp to +-6)."""
    n = draw(st.integers(1, 200))
    k = draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    nb = -(-k // 16)
    kinds = torch.randint(0, 4, (n, nb), generator=g)  # 0 normal, 1 zero, 2 tiny, 3 contains +-max
    blocks = torch.nn.functional.pad(w, (0, nb * 16 - k)).view(n, nb, 16)
    amax = w.abs().max()
    blocks[kinds == 1] = 0.0
    blocks[kinds == 2] *= 1e-6
    sat = blocks[kinds == 3]
    sat[:, 0] = amax
    sat[:, 1] = -amax
    blocks[kinds == 3] = sat
    w = blocks.view(n, nb * 16)[:, :k].to(dtype)
    if w.abs().max() == 0:  # an all-zero tensor has no valid global scale (tested separately)
        w[0, 0] = 1.0
    factor = draw(st.sampled_from([1.0, 1.0, 0.25, 0.01]))
    return w, factor


@given(case=weights())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_quantize_and_dequantize_match_comfy_kitchen(case):
    w, factor = case
    gs = nvfp4.nvfp4_global_scale(w) * factor
    assume(gs > 0)  # fp16 tensors with amax < ~1e-4: the quotient underflows (ComfyUI would store NaN scales)
    needs_pad = nvfp4.padded_shape(tuple(w.shape)) != tuple(w.shape)
    ref_q, ref_bs = ck.quantize_nvfp4(w, gs, pad_16x=needs_pad)
    q = nvfp4.quantize_nvfp4(w, gs)
    assert_bitwise(q.packed, ref_q, "packed")
    assert_bitwise(q.block_scale, ref_bs, "block_scale")
    for out_dtype in OUT_DTYPES:
        ref = ck.dequantize_nvfp4(ref_q, gs, ref_bs, out_dtype)[: w.shape[0], : w.shape[1]]
        ours = nvfp4.dequantize_nvfp4(q.packed, q.block_scale, q.global_scale, out_dtype, shape=tuple(w.shape))
        assert not ours.isnan().any()
        assert_bitwise(ours, ref, f"dequantize {out_dtype}")


@given(rows=st.integers(1, 150), half=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       gscale=st.sampled_from([1e-4, 0.01, 1.0]))
@settings(max_examples=40, deadline=None)
def test_dequantize_arbitrary_bytes_matches_comfy_kitchen(rows, half, seed, gscale):
    """Every code, every finite E4M3 scale (subnormals included) in the padded, tiled layout."""
    half = half * 8  # K = 16 * half / 8 is a multiple of 16
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, half), dtype=torch.uint8, generator=g)
    shape = nvfp4.scale_storage_shape(rows, 2 * half // 16)
    raw = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=g)  # 0x7F / 0xFF are E4M3 NaN
    raw |= torch.randint(0, 2, shape, dtype=torch.uint8, generator=g) << 7
    raw[raw == 0xFF] = 0xFE
    bs = raw.view(torch.float8_e4m3fn)
    gs = torch.tensor(gscale, dtype=torch.float32)
    for out_dtype in OUT_DTYPES:
        ref = ck.dequantize_nvfp4(packed, gs, bs, out_dtype)
        assert_bitwise(nvfp4.dequantize_nvfp4(packed, bs, gs, out_dtype), ref, f"dequantize {out_dtype}")


def test_zero_tensor_is_rejected():
    with pytest.raises(ValueError, match="global scale"):
        nvfp4.quantize_nvfp4(torch.zeros(16, 16))


# ---------------------------------------------------------------- linears

def _random_layer(n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize_nvfp4((torch.randn(n, k, generator=g) / k**0.5).to(dtype))


@pytest.mark.parametrize("compute_dtype", OUT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("lead", [(7,), (2, 5)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_w4a16_is_comfyui_dequant_then_linear(compute_dtype, lead, with_bias):
    """ComfyUI on CPU / cc < 10: QuantizedTensor.dequantize() in the compute dtype, then F.linear (bias cast)."""
    n, k = 40, 64  # 40 rows: stored padded to 48
    q = _random_layer(n, k, 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*lead, k, generator=g).to(compute_dtype)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    params = CKNVFP4Layout.Params(scale=q.global_scale, orig_dtype=compute_dtype, orig_shape=(n, k),
                                  block_scale=q.block_scale)
    w_ref = QuantizedTensor(q.packed, "TensorCoreNVFP4Layout", params).dequantize()
    ref = F.linear(x, w_ref, None if bias is None else bias.to(compute_dtype))
    ours = nvfp4.linear_w4a16(x, q.packed, q.block_scale, q.global_scale, bias, compute_dtype, out_features=n)
    assert_bitwise(ours, ref, "w4a16")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w4a4_activation_quantization_matches_comfy_layout(x_dtype):
    """The activation is quantized exactly as `QuantizedTensor.from_float(x2d, "TensorCoreNVFP4Layout")`."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 80, generator=g) * 3).to(x_dtype)  # 37 rows: padded to 48
    ref_q, ref_params = CKNVFP4Layout.quantize(x)
    q = nvfp4.quantize_activation_nvfp4(x)
    assert_bitwise(q.packed, ref_q, "packed")
    assert_bitwise(q.block_scale, ref_params.block_scale, "block_scale")
    assert_bitwise(q.global_scale, ref_params.scale, "global_scale")


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_linear_w4a4_matches_dequantized_product(with_bias):
    n, k = 40, 64
    q = _random_layer(n, k, 4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    qx, px = CKNVFP4Layout.quantize(x.reshape(-1, k))
    xd = ck.dequantize_nvfp4(qx, px.scale, px.block_scale, torch.float32)[:18]
    wd = ck.dequantize_nvfp4(q.packed, q.global_scale, q.block_scale, torch.float32)[:n]
    ref = F.linear(xd, wd, bias).reshape(2, 9, n)
    ours = nvfp4.linear_w4a4(x, q.packed, q.block_scale, q.global_scale, bias, torch.float32, out_features=n)
    tol = TOLERANCES[("w4a4_vs_dequant", "fp32")]
    torch.testing.assert_close(ours, ref, rtol=tol["rtol"], atol=tol["atol"])
    # and it is not the W4A16 result (the activation really is quantized)
    w4a16 = nvfp4.linear_w4a16(x, *q, bias, torch.float32, out_features=n)
    assert not torch.allclose(ours, w4a16, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- ComfyUI's own CPU traces

def _trace(path: Path):
    """(manifest, tensor getter, the checkpoint's tensors) of a ComfyUI trace and the checkpoint beside it."""
    manifest = json.loads(path.with_suffix(".json").read_text())
    tensors = load(path)
    aliases = manifest["aliases"]
    sd = load(path.parent / Path(manifest["checkpoint"]).name)
    return manifest, (lambda key: tensors[key] if key in tensors else tensors[aliases[key]]), sd


# (linear, the trace tensor that is its input) — recorded completely for block 0 and the token refiner
TRACE_LINEARS = [
    ("blocks.0.attn.qkv_proj", "blocks.0.attn.in.0"),
    ("blocks.0.attn.out_proj", "blocks.0.attn.out_proj.in"),
    ("blocks.0.mlp.fc1", "blocks.0.mlp.in.0"),
    ("token_refiner.blocks.0.attn.qkv_proj", "token_refiner.blocks.0.norm1.out"),
    ("token_refiner.blocks.0.attn.out_proj", "token_refiner.blocks.0.attn.out_proj.in"),
    ("token_refiner.blocks.0.mlp.fc1", "token_refiner.blocks.0.norm2.out"),
]


def _traces(names, fixtures=()) -> list:
    return ([pytest.param(SHARED_ORACLE / f"{n}.safetensors", id=n, marks=pytest.mark.shared) for n in names]
            + [pytest.param(FIXTURES / f"{n}.safetensors", id=n) for n in fixtures])


@pytest.mark.parametrize("trace", _traces(["trace_nvfp4_t2va_fp32", "trace_nvfp4_ref2va_fp32",
                                           "trace_curve_nvfp4_t2va_fp32"], ["trace_fx_curve_nvfp4_ref2va_fp32"]))
def test_w4a16_reproduces_comfyui_cpu_trace_fp32_bitwise(trace):
    """ComfyUI on the CPU runs NVFP4 layers as W4A16 (FP4 compute is disabled off NVIDIA cc >= 10)."""
    _, get, sd = _trace(trace)
    for layer, inp in TRACE_LINEARS:
        p = layer + "."
        y = nvfp4.linear_w4a16(get(inp), sd[p + "weight"], sd[p + "weight_scale"], sd[p + "weight_scale_2"], None,
                               torch.float32)
        assert_bitwise(y, get(layer + ".out"), f"{trace.stem}:{layer}")


@pytest.mark.parametrize("trace", _traces(["trace_nvfp4_t2va_bf16", "trace_nvfp4_ref2va_bf16"]))
def test_w4a16_reproduces_comfyui_cpu_trace_bf16(trace):
    _, get, sd = _trace(trace)
    tol = TOLERANCES[("w4a16_trace", "bf16")]
    for layer, inp in TRACE_LINEARS:
        p = layer + "."
        y = nvfp4.linear_w4a16(get(inp).bfloat16(), sd[p + "weight"], sd[p + "weight_scale"], sd[p + "weight_scale_2"],
                               None, torch.bfloat16)
        ref = get(layer + ".out").bfloat16()
        ulps = (bits(y).int() - bits(ref).int()).abs()  # same-sign neighbours differ by 1 in their bit pattern
        assert ulps.max().item() <= tol["max_ulps"], f"{trace.stem}:{layer}: {ulps.max().item()} ulps"
        assert (ulps > 0).float().mean().item() <= tol["max_mismatch_frac"], f"{trace.stem}:{layer}"


def test_quantize_in_row_chunks_is_bitwise_whole_tensor():
    """Large weights are quantized in row chunks (memory bound); the bytes must not depend on it."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(nvfp4._ROW_CHUNK + 19, 32, generator=g).to(torch.bfloat16)
    gs = nvfp4.nvfp4_global_scale(w)
    ref_q, ref_bs = ck.quantize_nvfp4(w, gs, pad_16x=True)
    q = nvfp4.quantize_nvfp4(w)
    assert_bitwise(q.packed, ref_q, "packed")
    assert_bitwise(q.block_scale, ref_bs, "block_scale")
