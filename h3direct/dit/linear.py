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

`WeightPrefetcher` makes the per-call weight product (W4A16: the dense dequantized weight; FP8 ``stream``: the
e4m3 weight) of the next block linear on a side CUDA stream while the current one's GEMM runs; same kernels,
same bits. Opt-in (``H3_PREFETCH_DEQUANT=1``): on the H200 it did not win (full preset, fa3: 2.107 s/step with it,
2.092 without; peak +0.27 GiB), the GEMMs it overlaps lose what the dequantization saves.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager

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

    _prefetch = None  # a WeightPrefetcher serving this layer (W4A16 block linears on CUDA), see `prefetcher_for`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from h3direct.checkpoint.quant import nvfp4

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.mode == "w4a4":
            y = nvfp4.linear_w4a4(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype,
                                  out_features=self.out_features)
        else:
            pf = self._prefetch
            dense = pf.take(self) if pf is not None and pf.serves(self, x.dtype) else None
            y = nvfp4.linear_w4a16(x2, self.weight, self.weight_scale, self.weight_scale_2, self.bias, x.dtype,
                                   out_features=self.out_features, dense=dense)
        return y.reshape(*lead, self.out_features)

    def prefetch_product(self, dtype: torch.dtype) -> torch.Tensor:
        """What a W4A16 call multiplies by: the dense [out, in] weight in `dtype` (`nvfp4.w4a16_weight`)."""
        from h3direct.checkpoint.quant import nvfp4

        return nvfp4.w4a16_weight(self.weight, self.weight_scale, self.weight_scale_2, dtype,
                                  self.out_features, self.in_features)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        from h3direct.checkpoint.quant import nvfp4

        w = nvfp4.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype)
        return w[: self.out_features, : self.in_features]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, nvfp4 {self.mode}"


# ---------------------------------------------------------------- FP8 W8A8 (opt-in approximate path)

FP8_LINEAR_MODES = ("off", "stream", "resident")
FP8_WEIGHTS_KEY = "fp8_w8a8"  # the budgets table's `weights` key of comparisons made with FP8 linears


def block_linear_names(model: nn.Module) -> list[str]:
    """The DiT block linears the FP8 path replaces: per block attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2
    (refiner, adaLN, embedders and output heads are left alone)."""
    return [f"blocks.{i}.{leaf}" for i in range(len(model.blocks))
            for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]


class FP8Linear(nn.Module):
    """e4m3 W8A8 linear (`h3direct.checkpoint.quant.w8a8`): per-output-channel weight scales, per-token activation
    scales, `torch._scaled_mm` on CUDA, an fp32 emulation elsewhere.

    ``resident``: the e4m3 weight is made once and held (half the memory of bf16).
    ``stream`` (NVFP4 sources only): the NVFP4 tensors stay resident and the e4m3 weight is made on every call (one
    Triton pass on CUDA) under per-channel scales computed once from the fp32-decoded rows."""

    def __init__(self, in_features: int, out_features: int, mode: str, source: str):
        super().__init__()
        self.in_features, self.out_features, self.island = in_features, out_features, False
        self.mode, self.source = mode, source
        self.bias = None

    @classmethod
    def from_module(cls, layer: nn.Module, mode: str) -> FP8Linear:
        from h3direct.checkpoint.quant import w8a8

        if mode not in ("stream", "resident"):
            raise ValueError(f"unknown fp8 linear mode {mode!r}")
        if isinstance(layer, NVFP4Linear):
            new = cls(layer.in_features, layer.out_features, mode, "nvfp4")
            scales = w8a8.nvfp4_channel_scales(layer.weight, layer.weight_scale, layer.weight_scale_2)
            if mode == "stream":
                new.register_buffer("packed", layer.weight)
                new.register_buffer("block_scale", layer.weight_scale)
                new.register_buffer("global_scale", layer.weight_scale_2)
                new.register_buffer("w_scale", scales)
            else:
                q = w8a8.nvfp4_to_e4m3(layer.weight, layer.weight_scale, layer.weight_scale_2, scales)
                new.register_buffer("weight8", q[: layer.out_features, : layer.in_features].contiguous())
                new.register_buffer("w_scale", scales[: layer.out_features].contiguous())
        elif isinstance(layer, Linear):
            new = cls(layer.in_features, layer.out_features, "resident", str(layer.weight.dtype).replace("torch.", ""))
            q, s = w8a8.quantize_rows(layer.weight.detach())
            new.register_buffer("weight8", q)
            new.register_buffer("w_scale", s)
        else:
            raise TypeError(f"cannot make an fp8 linear of {type(layer).__name__}")
        if layer.bias is not None:
            new.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
        return new

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight [N, K], fp32 per-channel scales [N]) as the GEMM takes them."""
        if self.mode == "resident":
            return self.weight8, self.w_scale
        from h3direct.checkpoint.quant import w8a8

        q = w8a8.nvfp4_to_e4m3(self.packed, self.block_scale, self.global_scale, self.w_scale)
        n, k = self.out_features, self.in_features
        if q.shape != (n, k):
            q = q[:n, :k].contiguous()
        return q, self.w_scale[:n]

    _prefetch = None  # a WeightPrefetcher serving this layer (stream mode on CUDA), see `prefetcher_for`

    def prefetch_product(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What a call multiplies by: `fp8_weight()` (independent of the activation dtype)."""
        return self.fp8_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from h3direct.checkpoint.quant import w8a8

        pf = self._prefetch
        w8, s = pf.take(self) if pf is not None and pf.serves(self, x.dtype) else self.fp8_weight()
        return w8a8.linear_w8a8(x, w8, s, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fp8 e4m3 w8a8 {self.mode} (from {self.source})"


def check_fp8_linear(mode: str | None) -> str:
    """None/"off" -> "off"; a known mode passes; anything else is a one-line `ConfigError`."""
    mode = mode or "off"
    if mode not in FP8_LINEAR_MODES:
        from h3direct.errors import ConfigError

        raise ConfigError(f"unknown fp8 linear mode {mode!r}; choose one of {', '.join(FP8_LINEAR_MODES)}")
    return mode


def apply_fp8_linears(model: nn.Module, mode: str) -> int:
    """Replace the block linears of `model` (`block_linear_names`) by `FP8Linear`s in place; returns how many.
    `mode` "stream" keeps NVFP4 sources packed (bf16/fp32 sources are always converted once: "resident")."""
    if check_fp8_linear(mode) == "off":
        return 0
    names = block_linear_names(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, FP8Linear.from_module(getattr(parent, child), mode))
    model.fp8_linear = mode
    return len(names)


# ---------------------------------------------------------------- weight prefetch (side stream)

PREFETCH_ENV = "H3_PREFETCH_DEQUANT"  # "1": prefetch on the side stream; otherwise each block linear makes its own
_PREFETCH_STATS: Counter = Counter()


def prefetch_stats() -> dict[str, int]:
    """Weight products taken by block linears since the last reset: ``prefetched`` (made ahead on the side stream),
    ``sync_cold`` (none pending: made in place), ``sync_missed`` (another layer's was pending: dropped, made in
    place), ``unused`` (still pending when a forward ended)."""
    return dict(_PREFETCH_STATS)


def reset_prefetch_stats() -> None:
    _PREFETCH_STATS.clear()


class InlineStreams:
    """No second stream: a product is made the moment it is scheduled (CPU; the scheduling tests)."""

    def produce(self, make):
        return make(), None

    def consume(self, token) -> None:
        pass


class CudaStreams:
    """One side stream on `device`. Ordering rules (no `record_stream`, so freed products go straight back to the
    side stream's pool):

    - before making a product, the side stream waits for all work the compute stream has queued so far; that work
      includes every GEMM that read an earlier product, so a block the allocator hands out again is no longer read;
    - the compute stream waits on the product's ready event before its GEMM reads it."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(device=self.device)

    def produce(self, make):
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            product = make()
            ready = torch.cuda.Event()
            ready.record(self.side)
        return product, ready

    def consume(self, token) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)


class WeightPrefetcher:
    """Makes layer i+1's weight product while layer i computes; at most two products alive (the one in use and
    the next one).

    `layers`: the layers in execution order (each has `prefetch_product(dtype)` and calls `take(self)` in its
    forward when `serves(self, dtype)`); `streams`: `CudaStreams` on a GPU, `InlineStreams` otherwise. Only inside
    `running()` (one forward) is anything made ahead: on entry the first layer's product is started; each `take`
    returns the pending product when it is the caller's (waiting on its event), else drops it and makes the
    caller's in place (counted), then starts the next layer's; on exit a product still pending is dropped."""

    def __init__(self, layers, dtype: torch.dtype, streams=None):
        self.layers = list(layers)
        self.dtype = dtype
        self.streams = streams if streams is not None else InlineStreams()
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self._pending = None  # (layer index, product, ready token)
        self.active = False

    def attach(self) -> WeightPrefetcher:
        for layer in self.layers:
            layer._prefetch = self
        return self

    def detach(self) -> None:
        for layer in self.layers:
            if layer._prefetch is self:
                layer._prefetch = None

    def serves(self, layer, dtype: torch.dtype) -> bool:
        return self.active and dtype == self.dtype and id(layer) in self._index

    @contextmanager
    def running(self):
        if self.active:
            raise RuntimeError("WeightPrefetcher.running() is not reentrant")
        self.active = True
        try:
            self._start(0)
            yield self
        finally:
            if self._pending is not None:
                _PREFETCH_STATS["unused"] += 1
            self._pending = None
            self.active = False

    def take(self, layer):
        i = self._index[id(layer)]
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == i:
            product, token = pending[1], pending[2]
            self.streams.consume(token)
            _PREFETCH_STATS["prefetched"] += 1
        else:
            _PREFETCH_STATS["sync_missed" if pending is not None else "sync_cold"] += 1
            del pending  # dropped before the caller's is made: never three alive
            product = layer.prefetch_product(self.dtype)
        self._start(i + 1)
        return product

    def _start(self, i: int) -> None:
        if i < len(self.layers):
            layer = self.layers[i]
            product, token = self.streams.produce(lambda: layer.prefetch_product(self.dtype))
            self._pending = (i, product, token)


def prefetch_layers(model: nn.Module) -> list[nn.Module]:
    """The block linears (`block_linear_names` order = execution order) that make a weight product per call:
    NVFP4 in W4A16 mode, FP8 in stream mode."""
    out = []
    for name in block_linear_names(model):
        m = model.get_submodule(name)
        if (isinstance(m, NVFP4Linear) and m.mode == "w4a16") or (isinstance(m, FP8Linear) and m.mode == "stream"):
            out.append(m)
    return out


def prefetcher_for(model: nn.Module, like: torch.Tensor) -> WeightPrefetcher | None:
    """The model's prefetcher for activations like `like`, or None: only on CUDA, for a 16-bit compute dtype,
    when the model has block linears that make their weight per call, and `H3_PREFETCH_DEQUANT=1` (opt-in). Built
    once and kept on the model (`model.weight_prefetcher`); rebuilt when the layers, dtype or device change."""
    if os.environ.get(PREFETCH_ENV, "0") != "1" or not like.is_cuda or like.dtype not in (torch.bfloat16,
                                                                                         torch.float16):
        return None
    layers = prefetch_layers(model)
    if not layers:
        return None
    pf = getattr(model, "weight_prefetcher", None)
    if (pf is None or pf.dtype != like.dtype or len(pf.layers) != len(layers)
            or any(a is not b for a, b in zip(pf.layers, layers, strict=True))
            or getattr(pf.streams, "device", None) != like.device):
        if pf is not None:
            pf.detach()
        pf = WeightPrefetcher(layers, like.dtype, CudaStreams(like.device)).attach()
        model.weight_prefetcher = pf
    return pf
