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
- `SHARED_PER_BLOCK` / `shared_limit(device)`: the most shared memory one block may take on a GPU, by compute
  capability; a launch config whose compiled kernel needs more is never tried there (`int8_gemm`'s autotuning).
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


KIB = 1024
# The most shared memory one thread block may opt in to, by compute capability: the SM's shared memory less the 1 KiB
# the driver reserves per block. Source: NVIDIA CCCL, libcudacxx/include/cuda/__device/arch_traits.h
# (`max_shared_memory_per_block_optin` = `max_shared_memory_per_multiprocessor` - `reserved_shared_memory_per_block`:
# 164 KiB per SM on 8.0, 100 KiB on 8.6, 8.9 and 12.0, 228 KiB on 9.0 and 10.0; 10.3 and 11.0 take 10.0's figures).
# 12.1 (GB10, DGX Spark) is not in that table: it takes 12.0's, the 12.x family's 99 KiB a block. A GPU test holds the
# entry of the lane's GPU to what the device reports (`test_int8_gemm.py::test_the_fit_is_the_gpus_own_verdict`).
SHARED_PER_BLOCK: dict[tuple[int, int], int] = {
    (8, 0): 164 * KIB - KIB,
    (8, 6): 100 * KIB - KIB,
    (8, 9): 100 * KIB - KIB,
    (9, 0): 228 * KIB - KIB,  # H100, H200
    (10, 0): 228 * KIB - KIB,  # B200
    (10, 3): 228 * KIB - KIB,
    (11, 0): 228 * KIB - KIB,
    (12, 0): 100 * KIB - KIB,
    (12, 1): 100 * KIB - KIB,  # GB10 (DGX Spark)
}


def cuda_index(device: torch.device) -> int:
    """The index of CUDA `device` ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def shared_limit(device: torch.device) -> int:
    """The most shared memory (bytes) one block may take on CUDA `device`: what the device reports
    (`shared_memory_per_block_optin`, what Triton's launcher checks), never more than `SHARED_PER_BLOCK` for its
    compute capability (the table the cross-target compile tests hold every kernel to)."""
    index = cuda_index(device)
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # older torch: only the default per block
    reported = int(optin if optin is not None else props.shared_memory_per_block)
    return min(reported, SHARED_PER_BLOCK.get(capability(index), reported))


def for_device(table: dict[tuple[int, int], T], default: T, device: torch.device | None) -> T:
    """`table[compute capability of device]`, else `default` (a GPU without an entry, the CPU, None)."""
    if device is None or device.type != "cuda":
        return default
    return table.get(capability(cuda_index(device)), default)


def with_overrides(table: dict[tuple[int, int], dict], default: dict, device: torch.device | None,
                   config: dict | None, what: str) -> dict:
    """A launch config: `for_device(table, default, device)` with `config`'s entries over it; a key it does not have
    is a one-line ValueError naming `what`."""
    cfg = dict(for_device(table, default, device))
    for key, value in (config or {}).items():
        if key not in cfg:
            raise ValueError(f"{what} launch config: unknown key {key!r} (known: {sorted(cfg)})")
        cfg[key] = value
    return cfg
