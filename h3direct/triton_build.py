"""How the runtime's Triton kernels are built and launched (`dit/fused.py`, `checkpoint/quant/*_triton.py`).

- `build(fn)`: `triton.jit(fn)`, made on first use and kept per mode: compiled, or run by Triton's CPU interpreter when
  TRITON_INTERPRET=1 is set at that moment (the CPU tests set it and run the very kernels the GPU compiles). A device
  function that several kernels call is built the same way and handed to them as a `tl.constexpr` argument, because a
  kernel resolves its global names for one mode only.
- `for_device(table, default, device)`: a kernel's launch config on `device`: the entry of `table` for the GPU's
  compute capability, else `default` (other GPUs, the CPU interpreter, no device).
- `OUT_CODES`: the code of each output dtype, for kernels that write any of them (`OUT: tl.constexpr`).
- `FP_OPTIONS`: compile options every launch passes. FMA contraction is pinned on: the kernels' bits were verified
  against their references with it, and Triton 3.10 turns its default off.
"""

from __future__ import annotations

import functools
import os
from typing import TypeVar

import torch

T = TypeVar("T")


def interpreting() -> bool:
    """Kernels built now run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_BUILT: dict = {}

FP_OPTIONS = {"enable_fp_fusion": True}
OUT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def build(fn, **jit_options):
    """`triton.jit(fn, **jit_options)`, built once per mode (compiled / interpreted)."""
    key = (fn, interpreting())
    k = _BUILT.get(key)
    if k is None:
        import triton

        k = _BUILT[key] = triton.jit(fn, **jit_options)
    return k


@functools.cache
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def for_device(table: dict[tuple[int, int], T], default: T, device: torch.device | None) -> T:
    """`table[compute capability of device]`, else `default` (a GPU without an entry, the CPU, None)."""
    if device is None or device.type != "cuda":
        return default
    index = device.index if device.index is not None else torch.cuda.current_device()
    return table.get(capability(index), default)
