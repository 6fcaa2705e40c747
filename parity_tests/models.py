"""What the gate runs h3direct with: its loaded DiTs and ComfyUI's traces (cached per run), and the dtype an
attention backend runs a case in.

Every part of the gate (gate.py, kernels.py, ladder.py, e2e.py, the tests) loads through `model` and `trace`, so a
checkpoint is loaded once per (dtype, NVFP4 mode, device, FP8 mode) and a trace once per run.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from h3direct.traces.format import Trace, load_trace

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def fp8_spec(mode: str, layers: str | None = None, fmt: str = "e4m3", rotate: str = "none") -> str:
    """The gate's one value for its 8-bit block linears: the mode ("off", "stream", "resident"), then the layers of
    `--fp8-linear-layers` after a colon when they are not all four, the format of `--fp8-linear-format` after a
    slash when it is not e4m3, and the rotated layers of `--fp8-linear-rotate` after "+rot=" when any: "stream",
    "stream:fc1,fc2", "stream/int8", "stream/int8+rot=fc1,fc2". `model` and `fp8_parts` read it back."""
    from h3direct.dit.options import FP8_LINEAR_LEAVES, fp8_layer_set, rotate_set

    if mode == "off":
        return mode
    out = mode
    if layers is not None and fp8_layer_set(layers) != FP8_LINEAR_LEAVES:
        out += ":" + ",".join(fp8_layer_set(layers))
    out += f"/{fmt}" if fmt != "e4m3" else ""
    return out + (f"+rot={','.join(rotate_set(rotate))}" if rotate_set(rotate) else "")


def fp8_parts(spec: str) -> tuple[str, str | None, str, str]:
    """`fp8_spec`'s value -> (mode, layers or None, format, rotated layers or "none")."""
    head, _, rotate = spec.partition("+rot=")
    head, _, fmt = head.partition("/")
    mode, _, layers = head.partition(":")
    return mode, layers or None, fmt or "e4m3", rotate or "none"


@lru_cache(maxsize=8)
def model(checkpoint: str, compute: str, nvfp4_mode: str, device: str, fp8_linear: str = "off"):
    """A loaded DiT; `fp8_linear` as `fp8_spec` writes it."""
    from h3direct.dit.loader import load_dit

    mode, layers, fmt, rotate = fp8_parts(fp8_linear)
    return load_dit(checkpoint, compute_dtype=compute, nvfp4_mode=nvfp4_mode, device=device, fp8_linear=mode,
                    fp8_linear_layers=layers, fp8_linear_format=fmt, fp8_linear_rotate=rotate)


@lru_cache(maxsize=32)
def trace(path: str) -> Trace:
    return load_trace(path)


def nvfp4_mode(case) -> str:
    """w4a16 | w4a4: how the case's NVFP4 weights ran in ComfyUI (w4a16 for a bf16 checkpoint, unused)."""
    return case.weights.split("_")[1] if case.weights.startswith("nvfp4") else "w4a16"


def dtype_name(dt: torch.dtype) -> str:
    """fp32 | bf16 | fp16: the name of a compute dtype."""
    return {v: k for k, v in DTYPES.items()}[str(dt).removeprefix("torch.")]


def compute_name(m) -> str:
    """fp32 | bf16 | fp16: the compute dtype of a loaded DiT."""
    return dtype_name(m.compute_dtype)


def dtype_reason(attention, compute: str, device: str) -> str | None:
    """Why the backend cannot run `compute` ("fp32", "bf16", "fp16") operands on `device` (None: it can), probed
    with a tensor of that dtype there."""
    from h3direct.dit.attention import unavailable_reason

    return unavailable_reason(attention, torch.empty(0, device=device, dtype=getattr(torch, DTYPES[compute])))


def own_dtype(attention, compute: str, device: str) -> str:
    """`h3direct.traces.kernels.own_dtype` by dtype name: the dtype a backend itself runs a `compute` case in."""
    from h3direct.traces import kernels

    return dtype_name(kernels.own_dtype(attention, getattr(torch, DTYPES[compute]), device))


def run_dtype(attention, compute: str, device: str) -> tuple[str, str | None]:
    """(the dtype h3direct runs a `compute` trace in with this backend, why it cannot run at all or None).

    Availability is probed with a tensor of that dtype on that device. A backend that runs only in bf16/fp16 runs an
    fp32 trace in bf16 (the ratio rule against ComfyUI's bf16 twin then applies): it never skips a case it can run.
    An approximate backend is only run at its kernel sites and in its free runs (in bf16 where it must); the rest
    of its gate runs on the exact path in the trace's own dtype."""
    from h3direct.dit.attention import is_exact

    reason = dtype_reason(attention, compute, device)
    if reason is not None and compute == "fp32" and dtype_reason(attention, "bf16", device) is None:
        return ("bf16" if is_exact(attention) else compute), None
    return compute, reason
