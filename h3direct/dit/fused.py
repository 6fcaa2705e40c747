"""Fused elementwise kernels (Triton, CUDA only) that round exactly like the eager ops they replace.

The kernel performs the same IEEE float32 operations as PyTorch's eager kernels (CUDA's expf, IEEE
division, explicit round-to-nearest ops that are never contracted into FMAs) and rounds to the storage dtype
at the same points, so results are bitwise identical to the eager path — checked on an H200 by
`benchmarks/check_fused.py` (0 of 287 M elements differ, bf16 and fp32); it only saves memory passes:

- `swiglu`: silu(gate) · up from fc1's [gate | up] output (eager: silu, then mul_, rounding between),
  one pass instead of three (1.57 → 0.42 ms at S = 20,050, ffn 14,336).

(A fused adaLN modulation kernel was tried and dropped: it was not bitwise equal to eager on the GPU.)

Disabled with H3_FUSED=0; never used on the CPU or without Triton.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional (CUDA wheels of torch ship it)
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - CPU-only environments
    triton = None

_TL_DTYPES = {}


def enabled(x: torch.Tensor) -> bool:
    return (triton is not None and x.is_cuda and os.environ.get("H3_FUSED", "1") != "0"
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _rnd(x, OUT: tl.constexpr):
        # round to the storage dtype as eager kernels do (nearest, ties to even), back to fp32 for the next op
        return x.to(OUT, fp_downcast_rounding="rtne").to(tl.float32) if OUT != tl.float32 else x

    @triton.jit
    def _swiglu_kernel(a_ptr, out_ptr, F, stride_a, stride_o, OUT: tl.constexpr, BLOCK: tl.constexpr,
                       LIBDEVICE: tl.constexpr):
        tok = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < F
        g = tl.load(a_ptr + tok * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(a_ptr + tok * stride_a + F + offs, mask=mask, other=0.0).to(tl.float32)
        if LIBDEVICE:  # CUDA's expf and IEEE division, as PyTorch's silu kernel
            s = _rnd(libdevice.div_rn(g, 1.0 + libdevice.exp(-g)), OUT)
            y = libdevice.mul_rn(s, u)
        else:  # Triton's interpreter (CPU tests) has no libdevice
            s = _rnd(g / (1.0 + tl.exp(-g)), OUT)
            y = s * u
        tl.store(out_ptr + tok * stride_o + offs, y.to(OUT, fp_downcast_rounding="rtne") if OUT != tl.float32
                 else y, mask=mask)


def _libdevice() -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter (CPU tests) has no libdevice


def swiglu(a: torch.Tensor) -> torch.Tensor:
    # a [S, 2F] (fc1 output: gate | up) -> [S, F]
    s, f2 = a.shape
    f = f2 // 2
    a = a if a.stride(1) == 1 else a.contiguous()
    out = torch.empty(s, f, dtype=a.dtype, device=a.device)
    block = 1024
    _swiglu_kernel[(s, triton.cdiv(f, block))](a, out, f, a.stride(0), out.stride(0), OUT=_TL_DTYPES[a.dtype],
                                                BLOCK=block, LIBDEVICE=_libdevice())
    return out


# ---- compiled adaLN elementwise work (opt-in: H3_COMPILE_ELEMENTWISE=1) ------------------------------------------
# RMSNorm + modulation `norm(x)·(1 + scale[row]) + shift[row]` in one pass, and the gated residual
# `x + update·gate[row]` in one pass, through torch.compile (Inductor fuses the per-row gather into the pointwise
# kernel). Not bitwise equal to eager: the intermediate stays in fp32 (one bf16 rounding instead of three), which
# is closer to fp32; the parity gate's exact budgets judge it. One compiled graph per shape, shared by all blocks.

def compile_enabled(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("H3_COMPILE_ELEMENTWISE", "0") == "1"


_ROW_INDEX: dict = {}


def row_index(runs, rows: int, n_mod_rows: int, device) -> torch.Tensor:
    """[rows] int64: the adaLN row of each sequence row; rows outside every run point at n_mod_rows (a zero row)."""
    key = (tuple((r.start, r.stop, r.row) for r in runs), rows, n_mod_rows, str(device))
    idx = _ROW_INDEX.get(key)
    if idx is None:
        idx = torch.full((rows,), n_mod_rows, dtype=torch.int64)
        for r in runs:
            idx[r.start:r.stop] = r.row
        idx = idx.to(device)
        _ROW_INDEX.clear()
        _ROW_INDEX[key] = idx
    return idx


def _pad_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[-1])], dim=0)


def _norm_modulate_eager(x, weight, eps: float, shift, scale, idx):
    h = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return (h * (1.0 + scale.float()[idx]) + shift.float()[idx]).to(x.dtype)


def _gated_residual_eager(x, update, gate, idx):
    return (x.float() + update.float() * gate.float()[idx]).to(x.dtype)


_COMPILED: dict = {}


def _compiled(name, fn):
    f = _COMPILED.get(name)
    if f is None:
        f = _COMPILED[name] = torch.compile(fn, dynamic=False, fullgraph=True)
    return f


def norm_modulate(x, weight, eps: float, shift, scale, runs) -> torch.Tensor:
    idx = row_index(runs, x.shape[0], shift.shape[0], x.device)
    return _compiled("norm_modulate", _norm_modulate_eager)(x, weight, eps, _pad_zero_row(shift),
                                                            _pad_zero_row(scale), idx)


def gated_residual(x, gate, update, runs) -> torch.Tensor:
    idx = row_index(runs, x.shape[0], gate.shape[0], x.device)
    return _compiled("gated_residual", _gated_residual_eager)(x, update, _pad_zero_row(gate), idx)
