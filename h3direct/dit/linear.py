"""Linear layers as ComfyUI stores them: plain (bf16 / fp32 island) and NVFP4.

Plain weights are cast to the input's dtype at call time, as ComfyUI's cast ops do; which dtype a weight
is *held* in is the loader's dtype policy (`loader.py`).

NVFP4 layers hold the checkpoint's tensors under the checkpoint's names (`weight` uint8 [N, K/2],
`weight_scale` float8_e4m3fn swizzled block scales, `weight_scale_2` fp32 global scale, `comfy_quant`
JSON marker) and run in one of two modes (see `h3direct.checkpoint.quant.nvfp4`):

- ``w4a16``: dequantize the weight to the activation dtype every call, unquantized activations — what
  ComfyUI does wherever FP4 compute is unsupported: GPUs with compute capability < 10 (H100/H200) and the
  CPU. The shared NVFP4 oracle traces were recorded on this path (bit-identical to dequantize + F.linear);
- ``w4a4``: activations quantized to NVFP4 with a dynamic per-tensor scale, FP4 matmul — what ComfyUI
  does on FP4-capable GPUs (compute capability >= 10: Blackwell, DGX Spark). Here an fp32 emulation of
  that arithmetic (the GPU kernel's accumulation order differs).

``auto`` (the default) picks as ComfyUI does for the device the model runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NVFP4_MODES = ("auto", "w4a4", "w4a16")


def resolve_nvfp4_mode(mode: str, device) -> str:
    """ComfyUI's choice: FP4 compute (W4A4) only on CUDA devices of compute capability >= 10."""
    if mode != "auto":
        return mode
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return "w4a4" if torch.cuda.get_device_capability(device)[0] >= 10 else "w4a16"
    return "w4a16"


class Linear(nn.Module):
    """y = x Wᵀ + b, W cast to x's dtype. `island=True` marks a layer ComfyUI declares float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, island: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.island = in_features, out_features, island
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        b = self.bias
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, island={self.island}"


class NVFP4Linear(nn.Module):
    """NVFP4 block-quantized linear (ComfyUI mixed-precision layout); `mode` picks W4A4 or W4A16."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, mode: str = "w4a16",
                 dequant: str = "auto"):
        super().__init__()
        from h3direct.checkpoint.quant.nvfp4 import storage_shapes

        self.in_features, self.out_features, self.island = in_features, out_features, False
        self.mode = mode
        self.dequant = dequant  # the dequantization path on CUDA (option nvfp4_dequant, fixed when loaded)
        shapes = storage_shapes((out_features, in_features))  # rows/cols zero-padded to 16, scales to 128x4 tiles
        self.register_buffer("weight", torch.empty(shapes["weight"], dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(shapes["weight_scale"], dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.empty((), dtype=torch.float32))
        self.register_buffer("comfy_quant", torch.empty(0, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from h3direct.checkpoint.quant import nvfp4

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.mode == "w4a4":
            y = nvfp4.linear_w4a4(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype,
                                  out_features=self.out_features)
        else:
            y = nvfp4.linear_w4a16(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype,
                                   out_features=self.out_features, dequant=self.dequant)
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        from h3direct.checkpoint.quant import nvfp4

        w = nvfp4.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype)
        return w[: self.out_features, : self.in_features]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, nvfp4 {self.mode}"


# ---------------------------------------------------------------- FP8 W8A8 (opt-in approximate path)

FP8_WEIGHTS_KEY = "fp8_w8a8"  # the budgets table's `weights` key of comparisons made with FP8 linears
# ... per number format of the 8-bit linears (option fp8_linear_format)
W8A8_WEIGHTS_KEYS = {"e4m3": FP8_WEIGHTS_KEY, "int8": "int8_w8a8"}


def block_linear_names(model: nn.Module, leaves: tuple[str, ...] | None = None) -> list[str]:
    """The DiT block linears the FP8 path replaces: per block attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2, or
    those of them whose leaf name is in `leaves` (the option `fp8_linear_layers`); refiner, adaLN, embedders and
    output heads are left alone."""
    from h3direct.checkpoint.keys import BLOCK_LINEARS

    chosen = [p for p in BLOCK_LINEARS if leaves is None or p.rpartition(".")[2] in leaves]
    return [f"blocks.{i}.{leaf}" for i in range(len(model.blocks)) for leaf in chosen]


class FP8Linear(nn.Module):
    """8-bit W8A8 linear (`h3direct.checkpoint.quant.w8a8`) in format `fmt`: e4m3 (FP8, `torch._scaled_mm` on CUDA)
    or int8 (`torch._int_mm`); per-output-channel weight scales, per-token activation scales, an emulation elsewhere.

    ``resident``: the e4m3 weight is made once and held (half the memory of bf16).
    ``stream`` (NVFP4 sources only): the NVFP4 tensors stay resident and the e4m3 weight is made on every call (one
    Triton pass on CUDA) under per-channel scales computed once from the fp32-decoded rows."""

    def __init__(self, in_features: int, out_features: int, mode: str, source: str, fmt: str = "e4m3",
                 rotate: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.island = in_features, out_features, False
        self.mode, self.source, self.fmt = mode, source, fmt
        # int8 only: input and weight rotated by `hadamard.rotate_rows` before quantizing (option fp8_linear_rotate);
        # the weight's scales carry the rotation's 1/b (the product of two rotated factors is b times the plain one)
        self.rotate = rotate
        # the load-time options fp8_strict (an emulated GEMM on CUDA is an error) and fp8_accum (the GEMM's
        # accumulation on CUDA), set by `dit.loader.apply_load_time`
        self.strict, self.accum = False, "fast"
        self.bias = None

    @classmethod
    def from_module(cls, layer: nn.Module, mode: str, fmt: str = "e4m3", rotate: bool = False) -> FP8Linear:
        from h3direct.checkpoint.quant import w8a8
        from h3direct.dit.options import FP8_LINEAR_FORMATS

        if mode not in ("stream", "resident"):
            raise ValueError(f"unknown fp8 linear mode {mode!r}")
        if fmt not in FP8_LINEAR_FORMATS:
            raise ValueError(f"unknown 8-bit format {fmt!r}")
        if rotate and fmt != "int8":
            raise ValueError("the rotation is of int8 linears")
        if not isinstance(layer, NVFP4Linear | Linear):
            raise TypeError(f"cannot make an fp8 linear of {type(layer).__name__}")
        nvfp4_source = isinstance(layer, NVFP4Linear)
        streams = nvfp4_source and mode == "stream"  # bf16/fp32 sources are always converted once
        new = cls(layer.in_features, layer.out_features, mode if nvfp4_source else "resident",
                  "nvfp4" if nvfp4_source else str(layer.weight.dtype).replace("torch.", ""), fmt, rotate=rotate)
        if streams:
            new.register_buffer("packed", layer.weight)
            new.register_buffer("block_scale", layer.weight_scale)
            new.register_buffer("global_scale", layer.weight_scale_2)
        if rotate:
            from h3direct.checkpoint.quant import hadamard

            rotated = hadamard.rotate_rows(new._weight_bf16(layer))
            row_scale = w8a8.int8_row_scales(rotated)  # per channel, set once
            if streams:  # the codes are made every call under it
                new.register_buffer("row_scale", row_scale)
            else:
                new.register_buffer("weight8", w8a8.encode_rows_int8(rotated, row_scale))
            # the GEMM's scales carry the rotation's 1/b: the product of two rotated factors is b times the plain one
            new.register_buffer("w_scale", row_scale / hadamard.block(layer.in_features))
        elif nvfp4_source:
            scales = w8a8.nvfp4_channel_scales(layer.weight, layer.weight_scale, layer.weight_scale_2, fmt)
            if streams:
                new.register_buffer("w_scale", scales)
            else:
                q = new._convert(layer.weight, layer.weight_scale, layer.weight_scale_2, scales)
                new.register_buffer("weight8", q[: layer.out_features, : layer.in_features].contiguous())
                new.register_buffer("w_scale", scales[: layer.out_features].contiguous())
        else:
            q, s = w8a8.format_functions(fmt)[0](layer.weight.detach())
            new.register_buffer("weight8", q)
            new.register_buffer("w_scale", s)
        if layer.bias is not None:
            new.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
        return new

    def _weight_bf16(self, layer: nn.Module | None = None) -> torch.Tensor:
        """The weight [N, K] in bf16 (an NVFP4 one dequantized: exact but for that rounding), unrotated: of `layer`
        (when this layer is made), else of this layer's own NVFP4 tensors (stream: every call)."""
        from h3direct.checkpoint.quant import nvfp4

        if layer is None:
            w = nvfp4.dequantize_nvfp4(self.packed, self.block_scale, self.global_scale, torch.bfloat16)
        elif isinstance(layer, NVFP4Linear):
            w = nvfp4.dequantize_nvfp4(layer.weight, layer.weight_scale, layer.weight_scale_2, torch.bfloat16)
        else:
            w = layer.weight.detach().to(torch.bfloat16)
        return w[: self.out_features, : self.in_features]

    def _convert(self, packed, block_scale, global_scale, scales) -> torch.Tensor:
        from h3direct.checkpoint.quant import w8a8

        return w8a8.nvfp4_to_codes(packed, block_scale, global_scale, scales, self.fmt)

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(8-bit weight [N, K] (e4m3 or int8), fp32 per-channel scales [N]) as the GEMM takes them."""
        if self.mode == "resident":
            return self.weight8, self.w_scale
        if self.rotate:  # one pass on the GPU (`w8a8.rotated_int8_codes`)
            from h3direct.checkpoint.quant import w8a8

            return w8a8.rotated_int8_codes(self._weight_bf16(), self.row_scale), self.w_scale
        q = self._convert(self.packed, self.block_scale, self.global_scale, self.w_scale)
        n, k = self.out_features, self.in_features
        if q.shape != (n, k):
            q = q[:n, :k].contiguous()
        return q, self.w_scale[:n]

    def forward(self, x) -> torch.Tensor:
        """x: a tensor [..., K], or its rows already quantized (`w8a8.E4M3Rows`, written by a fused kernel)."""
        from h3direct.checkpoint.quant import w8a8

        w8, s = self.fp8_weight()
        if self.rotate:  # the rotated input's int8 rows, made in one pass where it can (w8a8.quantize_rotated_int8)
            lead = x.shape[:-1]
            rows = w8a8.quantize_rotated_int8(x.reshape(-1, x.shape[-1]))
            y = w8a8.linear_w8a8(rows, w8, s, self.bias, strict=self.strict, accum=self.accum)
            return y.reshape(*lead, y.shape[-1])
        return w8a8.linear_w8a8(x, w8, s, self.bias, strict=self.strict, accum=self.accum)

    def extra_repr(self) -> str:
        accum = "exact int32" if self.fmt == "int8" else self.accum
        return (f"{self.in_features}, {self.out_features}, {self.fmt} w8a8 {self.mode} (from {self.source}), "
                f"{accum} accumulation" + (", input and weight rotated" if self.rotate else ""))


def check_fp8_linear(mode: str | None) -> str:
    """None/"off" -> "off"; a known mode passes; anything else is a one-line `RequestError` (the rule of the
    option `fp8_linear`)."""
    from h3direct.dit.options import KernelOptions

    return KernelOptions(fp8_linear=mode or "off").fp8_linear


def apply_fp8_linears(model: nn.Module, mode: str, leaves: tuple[str, ...] | None = None, fmt: str = "e4m3",
                      rotate: tuple[str, ...] = ()) -> int:
    """Replace the block linears of `model` (`block_linear_names`, those of `leaves` only when given) by
    `FP8Linear`s of format `fmt` in place; returns how many. `mode` "stream" keeps NVFP4 sources packed (bf16/fp32
    sources are always converted once: "resident"). When every new layer streams (it holds its source's own tensors)
    the replaced modules are kept, at no cost, so that `restore_linears` can undo it (`restorable`); a converted
    layer's source is dropped (keeping it would hold the checkpoint's weights beside the 8-bit ones)."""
    if check_fp8_linear(mode) == "off":
        return 0
    from h3direct.dit.options import FP8_LINEAR_LEAVES
    from h3direct.errors import ConfigError

    eight_bit = FP8_LINEAR_LEAVES if leaves is None else leaves
    idle = [leaf for leaf in rotate if leaf not in eight_bit]
    if idle:  # a rotation of a linear that stays the checkpoint's would do nothing, silently
        raise ConfigError(f"fp8_linear_rotate {','.join(idle)}: not among the 8-bit linears (fp8_linear_layers "
                          f"{','.join(eight_bit)})")
    names = block_linear_names(model, leaves)
    sources = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        new = FP8Linear.from_module(old, mode, fmt, rotate=child in rotate)
        setattr(parent, child, new)
        if new.mode == "stream":
            sources[name] = old
    model.fp8_linear, model.fp8_linear_layers, model.fp8_linear_format = mode, leaves, fmt
    model.fp8_linear_rotate = tuple(rotate)
    if len(sources) == len(names):
        # a plain dict, not a submodule: the originals stay out of the model's state dict and module walks
        model.__dict__["fp8_sources"] = sources
    return len(names)


def restorable(model: nn.Module) -> bool:
    """The model still has the block linears `apply_fp8_linears` replaced (every one of them streams)."""
    return "fp8_sources" in model.__dict__


def restore_linears(model: nn.Module) -> None:
    """Undo `apply_fp8_linears`: the block linears it replaced are put back (the model must be `restorable`)."""
    for name, module in model.__dict__.pop("fp8_sources", {}).items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)
    model.fp8_linear, model.fp8_linear_layers, model.fp8_linear_format = "off", None, "e4m3"
    model.fp8_linear_rotate = ()
