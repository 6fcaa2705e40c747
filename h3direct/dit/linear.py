"""Linear layers as ComfyUI stores them: plain (bf16 / fp32 island) and NVFP4.

Plain weights are cast to the input's dtype at call time, as ComfyUI's cast ops do; which dtype a weight
is *held* in is the loader's dtype policy (`loader.py`).

NVFP4 layers hold the checkpoint's tensors under the checkpoint's names (`weight` uint8 [N, K/2],
`weight_scale` float8_e4m3fn swizzled block scales, `weight_scale_2` fp32 global scale, `comfy_quant`
JSON marker) and run in one of two modes (see `h3direct.quant.nvfp4`):

- ``w4a16``: dequantize the weight to the activation dtype every call, unquantized activations — what
  ComfyUI does on GPUs without FP4 tensor cores (compute capability < 10, e.g. H200);
- ``w4a4``: activations quantized to NVFP4 with a dynamic per-tensor scale, FP4 matmul — what ComfyUI
  does on FP4-capable GPUs (Blackwell, DGX Spark) and on the CPU (comfy-kitchen's eager kernels), which
  is how the shared NVFP4 oracle traces were recorded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NVFP4_MODES = ("w4a4", "w4a16")


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

    def __init__(self, in_features: int, out_features: int, bias: bool = False, mode: str = "w4a4"):
        super().__init__()
        if in_features % 16:
            raise ValueError(f"NVFP4 needs in_features divisible by 16, got {in_features}")
        self.in_features, self.out_features, self.island = in_features, out_features, False
        self.mode = mode
        rows, cols = -(-out_features // 128) * 128, -(-(in_features // 16) // 4) * 4
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(rows, cols, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.empty((), dtype=torch.float32))
        self.register_buffer("comfy_quant", torch.empty(0, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from h3direct.quant import nvfp4

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.mode == "w4a4":
            y = nvfp4.linear_w4a4(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype)
        else:
            y = nvfp4.linear_w4a16(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype)
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        from h3direct.quant import nvfp4

        return nvfp4.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype,
                                      shape=(self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, nvfp4 {self.mode}"
