"""ComfyUI's quantized-weight formats: the one table of what each stores, the `comfy_quant` marker parser, and the
decoders (and, for NVFP4, the encoder).

One module per format family, each bitwise equal to the comfy-kitchen function ComfyUI calls:

- :mod:`h3direct.checkpoint.quant.nvfp4` — NVFP4 (`comfy_quant` format ``nvfp4``): dequantize, quantize, W4A16 / W4A4
  linears, and which of the two ComfyUI runs on which hardware;
- :mod:`h3direct.checkpoint.quant.int8` — ``int8_tensorwise`` (tensor-wise or per-row scale, optional ConvRot rotation);
- :mod:`h3direct.checkpoint.quant.fp8` — ``float8_e4m3fn`` / ``float8_e5m2`` scaled weights and ``mxfp8``.

`FORMATS` maps every format name ComfyUI loads (`comfy/quant_ops.py` QUANT_ALGOS at 0f1fa67a, and comfy-kitchen's
storage layouts behind them) to what a layer of that format stores: the safetensors dtypes of ``.weight``, its
companions (suffixes after the layer prefix) and, for block formats, the padding, packing and block-scale layout.
`h3direct inspect` checks files against all of it; the loaders decode the formats they support.

A quantized layer is marked by a ``<layer>.comfy_quant`` uint8 tensor holding a JSON object with a ``format``
(`parse_marker`, `state_dict_markers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from h3direct.errors import CheckpointError

MARKER = "comfy_quant"  # the suffix of a layer's quantization marker


@dataclass(frozen=True)
class QuantFormat:
    """What ComfyUI needs to load one quantized linear of this format."""

    name: str
    weight_dtypes: tuple[str, ...]     # safetensors dtypes accepted for `.weight` (the first: what ComfyUI writes)
    required: tuple[str, ...]          # companions ComfyUI refuses to load without
    optional: tuple[str, ...] = ()     # extra parameters it loads when present
    pad: int = 1                       # storage pads both weight dims to a multiple of this
    pack: int = 1                      # logical elements per stored element along K
    block: int | None = None           # values per block scale (tiled 128x4 layout)
    block_scale_dtypes: tuple[str, ...] = ()  # accepted dtypes of the block-scale tensor
    block_scale_view: str | None = None       # dtype ComfyUI views the block scale as

    @property
    def weight_dtype(self) -> str:
        """The torch dtype name of `.weight` as ComfyUI writes it."""
        from h3direct.checkpoint.safetensors_header import TORCH_DTYPE_NAMES

        return TORCH_DTYPE_NAMES[self.weight_dtypes[0]]


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("nvfp4", ("U8",), ("weight_scale", "weight_scale_2"), ("input_scale", "pre_quant_scale"),
                pad=16, pack=2, block=16, block_scale_dtypes=("F8_E4M3", "U8"), block_scale_view="F8_E4M3"),
    QuantFormat("mxfp8", ("F8_E4M3",), ("weight_scale",), ("input_scale",),
                pad=32, block=32, block_scale_dtypes=("F8_E8M0", "U8"), block_scale_view="F8_E8M0"),
    QuantFormat("float8_e4m3fn", ("F8_E4M3",), ("weight_scale",), ("input_scale",)),
    QuantFormat("float8_e5m2", ("F8_E5M2",), ("weight_scale",), ("input_scale",)),
    QuantFormat("int8_tensorwise", ("I8",), ("weight_scale",)),
    QuantFormat("convrot_w4a4", ("I8",), ("weight_scale",)),
    QuantFormat("asym_w4a8_int8", ("I8", "U8"), ("weight_s_rel",), ("weight_s_channel", "weight_codebook")),
)}

# the exact `comfy_quant` payload ComfyUI writes for a plain NVFP4 layer (json.dumps of {"format": "nvfp4"})
NVFP4_MARKER = b'{"format": "nvfp4"}'


def quant_config(conf, where: str, path=None) -> dict:
    """A layer's quantization config as ComfyUI reads it (a JSON object with a 'format'); a one-line
    `CheckpointError` naming `where` otherwise. Whether the format is one the caller handles is the caller's check."""
    if not isinstance(conf, dict):
        raise CheckpointError(f"{where}: quantization config {conf!r} is not a JSON object", path=path)
    if conf.get("format") is None:
        raise CheckpointError(f"{where}: quantization config {json.dumps(conf)} has no 'format'", path=path)
    return conf


def parse_marker(raw: bytes, where: str, path=None) -> dict:
    """The bytes of a `<layer>.comfy_quant` tensor -> its quantization config (`quant_config`)."""
    try:
        conf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{where}: unreadable comfy_quant marker {raw[:40]!r} (not UTF-8 JSON)",
                              path=path) from None
    return quant_config(conf, where, path)


def state_dict_markers(state: dict, path=None) -> dict[str, dict]:
    """layer -> quantization config of every `<layer>.comfy_quant` tensor of a loaded state dict (1-D uint8/int8)."""
    out = {}
    for key, t in state.items():
        if key.endswith("." + MARKER):
            if str(t.dtype) not in ("torch.uint8", "torch.int8") or t.dim() != 1:
                raise CheckpointError(f"{key}: comfy_quant marker must be a 1-D uint8 JSON string, got {t.dtype} "
                                      f"{list(t.shape)}", path=path)
            out[key[: -len(MARKER) - 1]] = parse_marker(t.cpu().numpy().tobytes(), key, path)
    return out
