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

    def __init__(self, in_features: int, out_features: int, bias: bool = False, mode: str = "w4a16"):
        super().__init__()
        from h3direct.checkpoint.quant.nvfp4 import storage_shapes

        self.in_features, self.out_features, self.island = in_features, out_features, False
        self.mode = mode
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
        fn = nvfp4.linear_w4a4 if self.mode == "w4a4" else nvfp4.linear_w4a16
        y = fn(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype,
               out_features=self.out_features)
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        from h3direct.checkpoint.quant import nvfp4

        w = nvfp4.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype)
        return w[: self.out_features, : self.in_features]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, nvfp4 {self.mode}"
