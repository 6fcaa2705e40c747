"""int8_tensorwise (+ConvRot), scaled fp8 and MXFP8 decode against comfy-kitchen's layouts (what ComfyUI calls)."""

from __future__ import annotations

import comfy_kitchen as ck  # comfy-kitchen (the `kitchen` extra) is the reference (installed by CI)
import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout, TensorWiseINT8Layout
from hypothesis import given, settings
from hypothesis import strategies as st

from h3direct.checkpoint.quant import FORMATS, NVFP4_MARKER, fp8, int8
from h3direct.errors import CheckpointError

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got, want = (ours.shape, ours.dtype), (ref.shape, ref.dtype)
    assert got == want, f"{what}: {got} vs {want}"
    n = (bits(ours) != bits(ref)).sum().item()
    assert n == 0, f"{what}: {n} of {ours.numel()} elements differ"


def _w(n: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


# ---------------------------------------------------------------- int8_tensorwise

@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", [
    dict(),
    dict(per_channel=True),
    dict(per_channel=True, convrot=True, convrot_groupsize=64),
    dict(per_channel=True, convrot=True, convrot_groupsize=256),
], ids=["tensorwise", "rowwise", "convrot64", "convrot256"])
def test_int8_dequantize_matches_comfy_kitchen(variant, out_dtype):
    w = _w(48, 512, 1)
    q, params = TensorWiseINT8Layout.quantize(w, **variant)
    params = type(params)(**{**params.__dict__, "orig_dtype": out_dtype})
    ref = QuantizedTensor(q, "TensorWiseINT8Layout", params).dequantize()
    ours = int8.dequantize_int8(q, params.scale, out_dtype,
                                convrot_groupsize=variant.get("convrot_groupsize") if variant.get("convrot") else None)
    assert_bitwise(ours, ref, str(variant))
    if variant.get("convrot"):  # the rotation really is undone (back near the original weights)
        # int8 rounding <= scale/2 per rotated element; an orthonormal G-group spreads it by at most sqrt(G);
        # plus the output dtype's own rounding of |w| <= max|w|
        bound = 0.5 * float(params.scale.max()) * variant["convrot_groupsize"] ** 0.5
        bound += float(w.float().abs().max()) * torch.finfo(out_dtype).eps
        assert (ours.float() - w.float()).abs().max().item() <= bound


def test_hadamard_is_orthogonal_and_symmetric():
    for size in (4, 16, 64, 256):
        h = int8.regular_hadamard(size, torch.float64)
        torch.testing.assert_close(h @ h, torch.eye(size, dtype=torch.float64), atol=1e-12, rtol=0)
        assert torch.equal(h, h.T)
    with pytest.raises(CheckpointError, match="power of 4"):
        int8.regular_hadamard(32)


# ---------------------------------------------------------------- scaled fp8

@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_scaled_dequantize_matches_comfy_kitchen(fp8_dtype, out_dtype):
    w = _w(40, 72, 2, torch.float32)
    scale = torch.amax(w.abs()) / torch.finfo(fp8_dtype).max
    q = ck.quantize_per_tensor_fp8(w, scale, fp8_dtype)
    params = TensorCoreFP8Layout.Params(scale=scale, orig_dtype=out_dtype, orig_shape=tuple(w.shape))
    ref = QuantizedTensor(q, "TensorCoreFP8Layout", params).dequantize()
    assert_bitwise(fp8.dequantize_fp8_scaled(q, scale, out_dtype), ref, "fp8")


# ---------------------------------------------------------------- mxfp8

@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(64, 128), (37, 70), (130, 96)], ids=str)
def test_mxfp8_dequantize_matches_comfy_kitchen(shape, out_dtype):
    w = _w(*shape, 3, torch.float32)
    w[0, :32] = 0  # a zero block (E8M0 code 0)
    padded = tuple(-(-s // 32) * 32 for s in shape)
    q, bs = ck.quantize_mxfp8(w, pad_32x=padded != shape)
    ref = ck.dequantize_mxfp8(q, bs, out_dtype)
    assert_bitwise(fp8.dequantize_mxfp8(q, bs, out_dtype), ref, "mxfp8")
    assert_bitwise(fp8.dequantize_mxfp8(q, bs.view(torch.uint8), out_dtype, shape=shape), ref[: shape[0], : shape[1]],
                   "mxfp8 uint8 scales, sliced")


@given(rows=st.integers(1, 140), nb=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_mxfp8_arbitrary_bytes(rows, nb, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, 32 * nb), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0  # drop E4M3 NaN codes
    q = raw.view(torch.float8_e4m3fn)
    shape = (-(-rows // 128) * 128, -(-nb // 4) * 4)
    bs = torch.randint(100, 150, shape, dtype=torch.uint8, generator=g)
    bs[0, 0] = 0
    assert_bitwise(fp8.dequantize_mxfp8(q, bs, torch.float32), ck.dequantize_mxfp8(q, bs.view(torch.float8_e8m0fnu),
                                                                                     torch.float32), "mxfp8 bytes")


# ---------------------------------------------------------------- format table

def test_format_table_matches_comfyui_quant_algos():
    """Companions and storage dtypes as ComfyUI's QUANT_ALGOS lists them (comfy/quant_ops.py at 0f1fa67a)."""
    expected = {  # format: (storage dtype, parameters)
        "float8_e4m3fn": ("float8_e4m3fn", {"weight_scale", "input_scale"}),
        "float8_e5m2": ("float8_e5m2", {"weight_scale", "input_scale"}),
        "nvfp4": ("uint8", {"weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale"}),
        "mxfp8": ("float8_e4m3fn", {"weight_scale", "input_scale"}),
        "int8_tensorwise": ("int8", {"weight_scale"}),
    }
    for name, (dtype, params) in expected.items():
        f = FORMATS[name]
        assert f.weight_dtype == dtype
        assert set(f.required) | set(f.optional) == params
    import json

    assert NVFP4_MARKER == json.dumps({"format": "nvfp4"}).encode()
