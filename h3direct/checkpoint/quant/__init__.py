"""Decoders (and, for NVFP4, the encoder) of ComfyUI's quantized-weight formats.

One module per format family, each bitwise equal to the comfy-kitchen function ComfyUI calls:

- :mod:`h3direct.checkpoint.quant.nvfp4` — NVFP4 (`comfy_quant` format ``nvfp4``): dequantize, quantize, W4A16 / W4A4
  linears, and which of the two ComfyUI runs on which hardware;
- :mod:`h3direct.checkpoint.quant.int8` — ``int8_tensorwise`` (tensor-wise or per-row scale, optional ConvRot rotation);
- :mod:`h3direct.checkpoint.quant.fp8` — ``float8_e4m3fn`` / ``float8_e5m2`` scaled weights and ``mxfp8``.

`FORMATS` maps each `comfy_quant` format name to its checkpoint companions (suffixes after the layer
prefix), the storage dtype of ``.weight`` and whether ComfyUI can also store an ``input_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    name: str
    weight_dtype: str  # torch dtype name of `.weight`
    required: tuple[str, ...]  # companion suffixes that must be present
    optional: tuple[str, ...] = ()


FORMATS: dict[str, QuantFormat] = {
    "nvfp4": QuantFormat("nvfp4", "uint8", ("weight_scale", "weight_scale_2"), ("input_scale", "pre_quant_scale")),
    "float8_e4m3fn": QuantFormat("float8_e4m3fn", "float8_e4m3fn", ("weight_scale",), ("input_scale",)),
    "float8_e5m2": QuantFormat("float8_e5m2", "float8_e5m2", ("weight_scale",), ("input_scale",)),
    "mxfp8": QuantFormat("mxfp8", "float8_e4m3fn", ("weight_scale",), ("input_scale",)),
    "int8_tensorwise": QuantFormat("int8_tensorwise", "int8", ("weight_scale",)),
}

# the exact `comfy_quant` payload ComfyUI writes for a plain NVFP4 layer (json.dumps of {"format": "nvfp4"})
NVFP4_MARKER = b'{"format": "nvfp4"}'
