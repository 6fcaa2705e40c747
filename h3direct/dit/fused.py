"""Fused elementwise kernels (Triton) for the DiT block: one memory pass each, fp32 inside.

- `norm_modulate`: h = rmsnorm(x)·w ⊙ (1 + scale[r]) + shift[r] for every sequence row, r = the row's adaLN
  row (`row_index`; rows outside every modulation run get the plain norm). Eager rounds to the compute dtype
  three times (norm, multiply, add); this kernel keeps fp32 throughout and rounds once, at the store.
- `gated_residual_`: x[row] += update[row] · gate[r], in place, fp32 inside, one rounding (eager: two).
- `residual_norm_modulate_`: the two above in one pass (the attention's gated residual, then norm2 + the MLP's
  modulation): x updated in place and h returned, bitwise what `gated_residual_` then `norm_modulate` give.
- `swiglu_`: silu(gate) · up from fc1's [gate | up] output, written over the gate half in place (no [S, F]
  buffer). It rounds exactly where PyTorch's eager silu / mul do (CUDA's expf, IEEE division, explicit
  round-to-nearest ops), so on the GPU it is bitwise equal to `F.silu(gate).mul_(up)` (checked on the GPU by
  `tests/test_fused_gpu.py`; Triton's CPU interpreter has no libdevice and differs in the last bit).
- e4m3 outputs for the FP8 linears (`--fp8-linear`): `norm_modulate` / `residual_norm_modulate_` with `e4m3=True`
  and `swiglu_e4m3` write, instead of the rounded output, its e4m3 codes and per-row scales (`w8a8.E4M3Rows`, the
  inputs of qkv_proj, fc1 and fc2), through the device functions of `w8a8_triton`: bitwise what the per-row
  quantizer gives on the output the plain kernel would have stored (each output row is whole in one program).

The norms' sums of squares are exact (fixed point, int64), so every launch config (`launch_table`, `SWEEP`) gives
the same bits. The adaLN kernels are not bitwise equal to eager: they are closer to fp32 (fewer roundings), and
the parity gate's exact budgets (ratio rule against ComfyUI's fp32 trace) judge them, as the numerical contract
says.

Used on CUDA when Triton is importable; the option `fused` off (`--no-fused`, `H3_FUSED=0` at startup) selects the
eager, op-by-op path (bitwise ComfyUI's order).
The kernels are built on first use (`triton.jit` at that moment), so `TRITON_INTERPRET=1` set by a CPU test runs
them in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from h3direct.dit.host import upload
from h3direct.triton_build import FP_OPTIONS, for_device
from h3direct.triton_build import build as _kernel
from h3direct.triton_build import interpreting as _interpreting

try:  # Triton is optional (CUDA wheels of torch ship it; the `test` extra installs it for the interpreter)
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - environments without Triton
    triton = None

MAX_HIDDEN = 16384  # one program holds a whole row of the norm (block = next power of two)
_MAX_TILE = 32768  # values per program of the norm kernels: ROWS is cut to fit


def enabled(x: torch.Tensor, *, whole_rows: bool = True, on: bool = True) -> bool:
    """The fused path runs for this activation: `on` (the generation's `KernelOptions.fused`), CUDA, Triton present,
    a float compute dtype, and (for the kernels that hold one whole row per program, `whole_rows`) rows of at most
    MAX_HIDDEN features."""
    return (on and triton is not None and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (not whole_rows or x.shape[-1] <= MAX_HIDDEN))


# ---- launch configurations ------------------------------------------------------------------------------------
# A kernel's launch config: its tile constexprs (ROWS: rows per program; BLOCK: columns per program; HB: heads per
# program; EXACT: the exact sum of squares, False only to measure what it costs) and Triton's launch options. Every
# config gives the same bits (the kernels are per row or per element, and the norms' sums of squares are exact, so
# independent of how a program splits its rows): the choice is only about speed, and the fastest depends on the GPU.
# `LAUNCH` holds, per CUDA compute capability, the best of `SWEEP`'s candidates timed at the DiT's full shape on a GPU
# of that capability (`tools/tune_kernels.py` prints such an entry); every other device, and Triton's CPU
# interpreter, gets `DEFAULT_LAUNCH`.

DEFAULT_LAUNCH: dict[str, dict] = {  # untuned: Triton's usual 4 warps (8 for the norms, one whole row a program)
    "norm_modulate": {"ROWS": 1, "EXACT": True, "num_warps": 8},
    "residual_norm_modulate": {"ROWS": 1, "EXACT": True, "num_warps": 8},
    "gated_residual": {"ROWS": 1, "BLOCK": 1024, "num_warps": 4},
    "swiglu": {"ROWS": 1, "BLOCK": 1024, "num_warps": 4},
    "qk_norm_rope": {"HB": 8, "EXACT": True, "num_warps": 4},
    "norm_modulate_e4m3": {"ROWS": 1, "EXACT": True, "num_warps": 8},
    "residual_norm_modulate_e4m3": {"ROWS": 1, "EXACT": True, "num_warps": 8},
    "swiglu_e4m3": {"ROWS": 1, "num_warps": 16},  # whole rows: BLOCK is the row's power of two
}

LAUNCH: dict[tuple[int, int], dict[str, dict]] = {
    (9, 0): {  # Hopper (H100, H200)
        **DEFAULT_LAUNCH,
        "residual_norm_modulate": {"ROWS": 1, "EXACT": True, "num_warps": 16},
        "gated_residual": {"ROWS": 4, "BLOCK": 2048, "num_warps": 8},
        "qk_norm_rope": {"HB": 16, "EXACT": True, "num_warps": 2},
        "norm_modulate_e4m3": {"ROWS": 1, "EXACT": True, "num_warps": 8},
        "residual_norm_modulate_e4m3": {"ROWS": 1, "EXACT": True, "num_warps": 32},
        "swiglu_e4m3": {"ROWS": 1, "num_warps": 32},
    },
}

SWEEP: dict[str, list[dict]] = {  # (norms and rope: 4 to 64 values per thread and tile)
    "norm_modulate": [{"ROWS": r, "num_warps": w} for r in (1, 2, 4) for w in (4, 8, 16, 32) if 4 * r <= w],
    "residual_norm_modulate": [{"ROWS": r, "num_warps": w} for r in (1, 2, 4) for w in (4, 8, 16, 32)
                               if 4 * r <= w],
    "gated_residual": [{"ROWS": r, "BLOCK": b, "num_warps": w} for r, b in ((1, 1024), (1, 2048), (2, 1024),
                                                                             (2, 2048), (4, 1024), (4, 2048))
                       for w in (4, 8)],
    "swiglu": [{"ROWS": r, "BLOCK": b, "num_warps": w} for r, b in ((1, 1024), (1, 2048), (1, 4096), (2, 1024),
                                                                     (2, 2048), (4, 1024))
               for w in (4, 8, 16)],
    "qk_norm_rope": [{"HB": h, "num_warps": w} for h in (4, 8, 16, 32, 64) for w in (2, 4, 8, 16)
                     if w <= h <= 16 * w],
    "norm_modulate_e4m3": [{"ROWS": r, "num_warps": w} for r in (1, 2) for w in (4, 8, 16, 32) if 4 * r <= w],
    "residual_norm_modulate_e4m3": [{"ROWS": r, "num_warps": w} for r in (1, 2) for w in (4, 8, 16, 32)
                                    if 4 * r <= w],
    "swiglu_e4m3": [{"ROWS": r, "num_warps": w} for r in (1, 2) for w in (8, 16, 32) if 8 * r <= w],
}
_OPTIONS = ("num_warps", "num_stages")


def launch_table(device: torch.device | None = None) -> dict[str, dict]:
    """The launch configs for kernels run on `device`: `LAUNCH` for its compute capability, else `DEFAULT_LAUNCH`
    (other GPUs, the CPU interpreter, and None)."""
    return for_device(LAUNCH, DEFAULT_LAUNCH, device)


def launch_config(kernel: str, config: dict | None = None, device: torch.device | None = None) -> dict:
    """`launch_table(device)[kernel]` with `config`'s entries over it (a sweep's candidate); unknown keys are
    errors."""
    cfg = dict(launch_table(device)[kernel])
    for key, value in (config or {}).items():
        if key not in cfg and key not in _OPTIONS:
            raise ValueError(f"launch config of {kernel}: unknown key {key!r} (known: {sorted(cfg)})")
        cfg[key] = value
    return cfg


def _split(cfg: dict) -> tuple[dict, dict]:
    """(tile constexprs, launch options) of a launch config."""
    return ({k: v for k, v in cfg.items() if k not in _OPTIONS},
            {**FP_OPTIONS, **{k: v for k, v in cfg.items() if k in _OPTIONS}})


# ---- kernels (plain functions; `_kernel` jit-compiles them on first use) ------------------------------------------
# bf16 stores round to nearest even: by the hardware cast when compiled, by integer arithmetic in Triton's interpreter
# (BF16_INT; its .to() truncates) — the same bits.
# The norms' sums of squares are exact: each x² is scaled by a power of two set by the largest exponent in its
# row (so that it is < 1), truncated to a multiple of 2^-48 and summed as int64 — associative, so the sum does not
# depend on the program's layout (ROWS, HB, num_warps). The truncation moves the sum by < 2^-32 of it; the only
# rounding is the int64 -> fp32 conversion.

if triton is not None:
    def _norm_modulate_kernel(x_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, out_ptr, u_ptr, g_ptr, q_ptr, qs_ptr, S,
                              D, stride_x, stride_o, stride_u, stride_shift, stride_scale, stride_g, eps,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, EXACT: tl.constexpr,
                              BF16_INT: tl.constexpr, INTERPRET: tl.constexpr, E4M3: tl.constexpr,
                              QUANT: tl.constexpr, ENCODE: tl.constexpr):
        # program = ROWS sequence rows, whole rows in registers; fp32 inside, one rounding at each store.
        # RESIDUAL: first x[row] += u[row]·g[r] in place (rounded to x's dtype and stored, as gated_residual_
        # does), then the norm of that stored x. E4M3: h rounded to x's dtype is not stored: its e4m3 codes
        # (q [S, D]) and per-row scales (qs [S]) are (QUANT, ENCODE: w8a8_triton's device functions).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        in_rows = rows < S
        inside = in_rows[:, None] & (cols < D)[None, :]
        r = tl.load(idx_ptr + rows, mask=in_rows, other=-1)  # adaLN row, -1: no modulation (and no residual)
        modulated = inside & (r >= 0)[:, None]
        r = tl.maximum(r, 0).to(tl.int64)
        x_at = x_ptr + rows[:, None] * stride_x + cols[None, :]
        x = tl.load(x_at, mask=inside, other=0.0).to(tl.float32)
        if RESIDUAL:
            u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=modulated, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + r[:, None] * stride_g + cols[None, :], mask=modulated, other=0.0).to(tl.float32)
            y = tl.fma(u, g, x)  # as _gated_residual_kernel: one fp32 rounding, the same bits
            if BF16_INT:
                b = y.to(tl.uint32, bitcast=True)
                y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            y = y.to(x_ptr.dtype.element_ty)
            tl.store(x_at, y, mask=modulated)
            x = tl.where(modulated, y.to(tl.float32), x)
        if EXACT:  # exact sum of squares (see above): the same bits for every launch config
            # key = 2·exponent + is_nan: its row max gives the largest exponent and whether a NaN is in the row
            e = ((x.to(tl.uint32, bitcast=True) >> 22) & 0x1FE).to(tl.int32) + (x != x).to(tl.int32)
            if INTERPRET:  # tl.max / tl.sum: compiled-mode functions when Triton was imported outside it
                kmax = tl.reduce(e, 1, tl.standard._elementwise_max)
            else:
                kmax = tl.max(e, axis=1)
            emax = kmax >> 1
            down = (tl.minimum(tl.maximum(253 - emax, 1), 254) << 23).to(tl.float32, bitcast=True)  # 2^(126-emax)
            up = (tl.minimum(tl.maximum(emax + 1, 1), 254) << 23).to(tl.float32, bitcast=True)  # 2^(emax-126)
            t = x * down[:, None]
            q = (t * t * 281474976710656.0).to(tl.int64)  # · 2^48, truncated
            if INTERPRET:
                qs = tl.reduce(q, 1, tl.standard._sum_combine)
            else:
                qs = tl.sum(q, axis=1)
            ss = qs.to(tl.float32) * 3.552713678800501e-15 * up * up  # · 2^-48 · 2^(2·(emax - 126))
            ss = tl.where(emax == 255, tl.where(kmax == 511, float("nan"), float("inf")), ss)  # as an fp32 sum
        else:  # fp32 sum in the layout's order (for measuring what the exact sum costs)
            if INTERPRET:
                ss = tl.reduce(x * x, 1, tl.standard._sum_combine)
            else:
                ss = tl.sum(x * x, axis=1)
        inv_rms = 1.0 / tl.sqrt_rn(ss / D + eps)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + r[:, None] * stride_scale + cols[None, :], mask=modulated,
                        other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + r[:, None] * stride_shift + cols[None, :], mask=modulated,
                        other=0.0).to(tl.float32)
        h = tl.fma(x * inv_rms[:, None] * w[None, :], 1.0 + scale, shift)
        if BF16_INT:
            b = h.to(tl.uint32, bitcast=True)
            h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        if E4M3:  # h as the plain kernel stores it (x's dtype), then quantized
            codes, s = QUANT(tl.where(inside, h.to(x_ptr.dtype.element_ty).to(tl.float32), 0.0), ENCODE, INTERPRET)
            tl.store(q_ptr + rows[:, None] * D + cols[None, :], codes, mask=inside)
            tl.store(qs_ptr + rows, s, mask=in_rows)
        else:
            tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=inside)


    def _gated_residual_kernel(x_ptr, u_ptr, g_ptr, idx_ptr, S, D, stride_x, stride_u, stride_g,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr, BF16_INT: tl.constexpr):
        # program (ROWS rows, column block); rows outside every run are neither read nor written
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_rows = rows < S
        r = tl.load(idx_ptr + rows, mask=in_rows, other=-1)
        live = (in_rows & (r >= 0))[:, None] & (cols < D)[None, :]
        r = tl.maximum(r, 0).to(tl.int64)
        x_at = x_ptr + rows[:, None] * stride_x + cols[None, :]
        x = tl.load(x_at, mask=live, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r[:, None] * stride_g + cols[None, :], mask=live, other=0.0).to(tl.float32)
        y = tl.fma(u, g, x)  # explicit: the bits do not hang on the compiler's fp-contraction default
        if BF16_INT:
            b = y.to(tl.uint32, bitcast=True)
            y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(x_at, y.to(x_ptr.dtype.element_ty), mask=live)


    def _swiglu_kernel(a_ptr, q_ptr, qs_ptr, S, F, stride_a, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       ROUND: tl.constexpr, LIBDEVICE: tl.constexpr, E4M3: tl.constexpr, QUANT: tl.constexpr,
                       ENCODE: tl.constexpr, INTERPRET: tl.constexpr):
        # program (ROWS rows, column block): a[row, :F] <- silu(a[row, :F]) * a[row, F:], each element read before
        # written. ROUND: 0 fp32 storage, 1 fp16 (rtne cast), 2 bf16 (rtne cast; by integer arithmetic interpreted).
        # E4M3 (whole rows: one column block, BLOCK >= F): a is not written; the e4m3 codes (q [S, F]) and per-row
        # scales (qs [S]) of the rounded result are (QUANT, ENCODE: w8a8_triton's device functions).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = (rows < S)[:, None] & (cols < F)[None, :]
        at = a_ptr + rows[:, None] * stride_a + cols[None, :]
        g = tl.load(at, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(at + F, mask=inside, other=0.0).to(tl.float32)
        if LIBDEVICE:  # CUDA's expf and IEEE division, as PyTorch's silu kernel
            s = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
        else:  # Triton's interpreter has no libdevice
            s = g / (1.0 + tl.exp(-g))
        if ROUND == 1:  # eager rounds silu's result to the storage dtype before the product
            s = s.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
        elif ROUND == 2:
            if LIBDEVICE:
                s = s.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            else:
                b = s.to(tl.uint32, bitcast=True)
                s = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                s = s.to(tl.float32)
        if LIBDEVICE:
            y = libdevice.mul_rn(s, u)
        else:
            y = s * u
        if ROUND == 1:
            y = y.to(tl.float16, fp_downcast_rounding="rtne")
        elif ROUND == 2:
            if LIBDEVICE:
                y = y.to(tl.bfloat16, fp_downcast_rounding="rtne")
            else:
                b = y.to(tl.uint32, bitcast=True)
                y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        if E4M3:  # y as the plain kernel stores it (a's dtype), then quantized
            codes, s = QUANT(tl.where(inside, y.to(a_ptr.dtype.element_ty).to(tl.float32), 0.0), ENCODE, INTERPRET)
            tl.store(q_ptr + rows[:, None] * F + cols[None, :], codes, mask=inside)
            tl.store(qs_ptr + rows, s, mask=rows < S)
        else:
            tl.store(at, y.to(a_ptr.dtype.element_ty), mask=inside)

    def _qk_norm_rope_kernel(x_ptr, wq_ptr, wk_ptr, t_ptr, H, HQ, R, stride_xs, stride_xh, stride_ts, stride_tj,
                             stride_ta, stride_tb, eps, D: tl.constexpr, HB: tl.constexpr, EXACT: tl.constexpr,
                             BF16_INT: tl.constexpr, INTERPRET: tl.constexpr):
        # program (row s, block of HB heads), in place on x[s, h, :D] for h < H: per-head RMSNorm (weight wq for
        # heads h < HQ, wk after: q and k of one qkv row are H = 2·HQ heads of one strided view), then the
        # split-half rotation of the first 2R dims: out[j] = T[j,0,0]·n[j] + T[j,0,1]·n[j+R],
        # out[j+R] = T[j,1,0]·n[j] + T[j,1,1]·n[j+R] (j < R; T = the row's [R, 2, 2] table), the rest passes
        # through. fp32 inside, one rounding at the store.
        s = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HB + tl.arange(0, HB)
        d = tl.arange(0, D)
        live = (heads < H)[:, None] & (d < D)[None, :]
        base = x_ptr + s * stride_xs + heads[:, None].to(tl.int64) * stride_xh
        lo = d < R
        rot = d < 2 * R
        partner = tl.where(lo, d + R, tl.where(rot, d - R, d))
        x = tl.load(base + d[None, :], mask=live, other=0.0).to(tl.float32)
        xp = tl.load(base + partner[None, :], mask=live, other=0.0).to(tl.float32)
        if EXACT:  # exact sum of squares (see above): the same bits for every launch config
            # key = 2·exponent + is_nan: its row max gives the largest exponent and whether a NaN is in the row
            e = ((x.to(tl.uint32, bitcast=True) >> 22) & 0x1FE).to(tl.int32) + (x != x).to(tl.int32)
            if INTERPRET:  # tl.max / tl.sum: compiled-mode functions when Triton was imported outside it
                kmax = tl.reduce(e, 1, tl.standard._elementwise_max)
            else:
                kmax = tl.max(e, axis=1)
            emax = kmax >> 1
            down = (tl.minimum(tl.maximum(253 - emax, 1), 254) << 23).to(tl.float32, bitcast=True)
            up = (tl.minimum(tl.maximum(emax + 1, 1), 254) << 23).to(tl.float32, bitcast=True)
            t = x * down[:, None]
            q = (t * t * 281474976710656.0).to(tl.int64)
            if INTERPRET:
                qs = tl.reduce(q, 1, tl.standard._sum_combine)
            else:
                qs = tl.sum(q, axis=1)
            ss = qs.to(tl.float32) * 3.552713678800501e-15 * up * up
            ss = tl.where(emax == 255, tl.where(kmax == 511, float("nan"), float("inf")), ss)  # as an fp32 sum
        else:  # fp32 sum in the layout's order (for measuring what the exact sum costs)
            if INTERPRET:
                ss = tl.reduce(x * x, 1, tl.standard._sum_combine)
            else:
                ss = tl.sum(x * x, axis=1)
        inv_rms = 1.0 / tl.sqrt_rn(ss / D + eps)
        is_q = (heads < HQ)[:, None]
        w = tl.where(is_q, tl.load(wq_ptr + d).to(tl.float32)[None, :], tl.load(wk_ptr + d).to(tl.float32)[None, :])
        wp = tl.where(is_q, tl.load(wq_ptr + partner).to(tl.float32)[None, :],
                      tl.load(wk_ptr + partner).to(tl.float32)[None, :])
        n = x * inv_rms[:, None] * w
        n_p = xp * inv_rms[:, None] * wp
        j = tl.where(lo, d, d - R)
        a = tl.where(lo, 0, 1)  # output row of the 2x2 matrix
        trow = t_ptr + s * stride_ts + j * stride_tj + a * stride_ta
        c_self = tl.load(trow + a * stride_tb, mask=rot, other=1.0).to(tl.float32)  # T[j,0,0] or T[j,1,1]
        c_part = tl.load(trow + (1 - a) * stride_tb, mask=rot, other=0.0).to(tl.float32)  # T[j,0,1] or T[j,1,0]
        y = n * c_self[None, :] + n_p * c_part[None, :]
        if BF16_INT:
            b = y.to(tl.uint32, bitcast=True)
            y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(base + d[None, :], y.to(x_ptr.dtype.element_ty), mask=live)


_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ---- row index ------------------------------------------------------------------------------------------------

_ROW_INDEX: dict = {}


def row_index(runs, rows: int, device) -> torch.Tensor:
    """[rows] int32: the adaLN row of each sequence row, -1 for rows outside every run. Cached per runs."""
    key = (tuple((r.start, r.stop, r.row) for r in runs), rows, str(device))
    idx = _ROW_INDEX.get(key)
    if idx is None:
        idx = torch.full((rows,), -1, dtype=torch.int32)
        for r in runs:
            idx[r.start:r.stop] = r.row
        idx = upload(idx, device)  # pinned, asynchronous: no host wait
        if len(_ROW_INDEX) >= 16:
            _ROW_INDEX.clear()
        _ROW_INDEX[key] = idx
    return idx


# ---- entry points ---------------------------------------------------------------------------------------------
# `config`: entries over the kernel's row of `launch_table(x.device)` (a tuning sweep passes each candidate); None: the
# table's.

def _e4m3_rows(s: int, f: int, dtype: torch.dtype, device):
    """Empty e4m3 output of a fused kernel: (codes as uint8 [s, f], fp32 scales [s], the E4M3Rows to return)."""
    from h3direct.checkpoint.quant.w8a8 import E4M3Rows

    q = torch.empty(s, f, dtype=torch.uint8, device=device)
    qs = torch.empty(s, dtype=torch.float32, device=device)
    return q, qs, E4M3Rows(q.view(torch.float8_e4m3fn), qs, dtype)


def _quant_functions(e4m3: bool) -> dict:
    """The kernels' QUANT / ENCODE arguments: w8a8_triton's device functions when they write e4m3 rows."""
    if not e4m3:
        return {"E4M3": False, "QUANT": None, "ENCODE": None}
    from h3direct.checkpoint.quant.w8a8_triton import device_functions

    quant, encode = device_functions()
    return {"E4M3": True, "QUANT": quant, "ENCODE": encode}


def _norm_launch(kernel: str, x, weight, eps, shift, scale, runs, update, gate, config, e4m3: bool):
    """The norm kernel's output: a fresh [S, D] tensor in x's dtype, or (e4m3) its `E4M3Rows`."""
    s, d = x.shape
    if e4m3:
        q, qs, result = _e4m3_rows(s, d, x.dtype, x.device)
        out = x  # unwritten placeholder
    else:
        out = result = torch.empty(s, d, dtype=x.dtype, device=x.device)
        q = qs = x  # unwritten placeholders
    if s == 0:
        return result
    block = triton.next_power_of_2(d)
    tile, options = _split(launch_config(kernel + ("_e4m3" if e4m3 else ""), config, x.device))
    rows = max(1, min(tile["ROWS"], _MAX_TILE // block))
    residual = update is not None
    u, g = (update, gate) if residual else (x, shift)  # unread placeholders without the residual
    _kernel(_norm_modulate_kernel)[(triton.cdiv(s, rows),)](
        x, weight.contiguous(), shift, scale, row_index(runs, s, x.device), out, u, g, q, qs, s, d, x.stride(0),
        out.stride(0), u.stride(0), shift.stride(0), scale.stride(0), g.stride(0), float(eps), ROWS=rows,
        BLOCK=block, RESIDUAL=residual, EXACT=bool(tile["EXACT"]),
        BF16_INT=x.dtype == torch.bfloat16 and _interpreting(), INTERPRET=_interpreting(), **_quant_functions(e4m3),
        **options)
    return result


def norm_modulate(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor,
                  runs, *, e4m3: bool = False, config: dict | None = None):
    """rmsnorm(x)·weight ⊙ (1 + scale[r]) + shift[r] per row (a fresh tensor in x's dtype). x [S, D];
    shift, scale [n_rows, D] (any row stride); rows outside `runs`: the plain norm. e4m3: that tensor's e4m3 rows
    instead (`w8a8.E4M3Rows`, bitwise `w8a8.quantize_rows` of it; the tensor itself is not made)."""
    s, d = x.shape
    if d > MAX_HIDDEN:
        raise ValueError(f"norm_modulate holds one row per program: hidden {d} > {MAX_HIDDEN}")
    x, shift, scale = _rows_contiguous(x), _rows_contiguous(shift), _rows_contiguous(scale)
    return _norm_launch("norm_modulate", x, weight, eps, shift, scale, runs, None, None, config, e4m3)


def residual_norm_modulate_(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
                            eps: float, shift: torch.Tensor, scale: torch.Tensor, runs, *, e4m3: bool = False,
                            config: dict | None = None):
    """`gated_residual_(x, gate, update, runs)` then `norm_modulate(x, weight, eps, shift, scale, runs)` in one pass:
    x is updated in place (the same bits as gated_residual_), and the returned fresh h is the norm of that stored x
    (the same bits as norm_modulate; e4m3: its e4m3 rows, as norm_modulate's). Reads x and update once, writes x and
    h."""
    s, d = x.shape
    if d > MAX_HIDDEN:
        raise ValueError(f"residual_norm_modulate_ holds one row per program: hidden {d} > {MAX_HIDDEN}")
    if x.stride(-1) != 1:
        raise ValueError("residual_norm_modulate_ writes x in place: it needs unit column stride")
    if update.shape != x.shape:
        raise ValueError(f"residual_norm_modulate_: update {tuple(update.shape)} != x {tuple(x.shape)}")
    update, gate = _rows_contiguous(update), _rows_contiguous(gate)
    shift, scale = _rows_contiguous(shift), _rows_contiguous(scale)
    return _norm_launch("residual_norm_modulate", x, weight, eps, shift, scale, runs, update, gate, config, e4m3)


def gated_residual_(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, runs, *,
                    config: dict | None = None) -> torch.Tensor:
    """In place: x[row] += update[row]·gate[r] for the rows of `runs` (the others untouched); returns x.
    x [S, D] with unit column stride; update [S, D]; gate [n_rows, D]."""
    s, d = x.shape
    if x.stride(-1) != 1:
        raise ValueError("gated_residual_ writes x in place: it needs unit column stride")
    update, gate = _rows_contiguous(update), _rows_contiguous(gate)
    if s == 0:
        return x
    tile, options = _split(launch_config("gated_residual", config, x.device))
    block = min(tile["BLOCK"], triton.next_power_of_2(d))
    _kernel(_gated_residual_kernel)[(triton.cdiv(s, tile["ROWS"]), triton.cdiv(d, block))](
        x, update, gate, row_index(runs, s, x.device), s, d, x.stride(0), update.stride(0), gate.stride(0),
        ROWS=tile["ROWS"], BLOCK=block, BF16_INT=x.dtype == torch.bfloat16 and _interpreting(), **options)
    return x


def swiglu_(a: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """a [S, 2F] (fc1's output: gate | up) -> silu(gate)·up written over the gate half; returns that [S, F] view
    (row stride 2F)."""
    s, f2 = a.shape
    if a.stride(-1) != 1:
        raise ValueError("swiglu_ writes in place: it needs unit column stride")
    f = f2 // 2
    if s:
        tile, options = _split(launch_config("swiglu", config, a.device))
        block = min(tile["BLOCK"], triton.next_power_of_2(f))
        _kernel(_swiglu_kernel)[(triton.cdiv(s, tile["ROWS"]), triton.cdiv(f, block))](
            a, a, a, s, f, a.stride(0), ROWS=tile["ROWS"], BLOCK=block, ROUND=_ROUND[a.dtype],
            LIBDEVICE=not _interpreting(), INTERPRET=_interpreting(), **_quant_functions(False), **options)
    return a[:, :f]


def swiglu_e4m3(a: torch.Tensor, *, config: dict | None = None):
    """a [S, 2F] (fc1's output: gate | up) -> the e4m3 rows (`w8a8.E4M3Rows`) of silu(gate)·up as `swiglu_` rounds it,
    bitwise `w8a8.quantize_rows(swiglu_(a))`; a is only read. One whole row a program: F <= MAX_HIDDEN."""
    s, f2 = a.shape
    f = f2 // 2
    if f > MAX_HIDDEN:
        raise ValueError(f"swiglu_e4m3 holds one row per program: {f} features > {MAX_HIDDEN}")
    a = _rows_contiguous(a)
    q, qs, result = _e4m3_rows(s, f, a.dtype, a.device)
    if s:
        block = triton.next_power_of_2(f)
        tile, options = _split(launch_config("swiglu_e4m3", config, a.device))
        rows = max(1, min(tile["ROWS"], _MAX_TILE // block))
        _kernel(_swiglu_kernel)[(triton.cdiv(s, rows), 1)](
            a, q, qs, s, f, a.stride(0), ROWS=rows, BLOCK=block, ROUND=_ROUND[a.dtype], LIBDEVICE=not _interpreting(),
            INTERPRET=_interpreting(), **_quant_functions(True), **options)
    return result


def qk_norm_rope_supported(q: torch.Tensor, table: torch.Tensor) -> bool:
    """The fused q/k norm + rope kernel takes this call: head_dim a power of two (<= 256), unit last stride,
    rotated dims within the head."""
    dim = q.shape[-1]
    return (dim & (dim - 1)) == 0 and dim <= 256 and q.stride(-1) == 1 and 2 * table.shape[-3] <= dim


def _k_follows_q(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads continue q's in memory (q, k = thirds of one qkv projection row): one launch covers both."""
    h = q.shape[2]
    return (k.shape == q.shape and k.stride() == q.stride() and k.dtype == q.dtype
            and k.data_ptr() == q.data_ptr() + h * q.stride(2) * q.element_size())


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  table: torch.Tensor, eps: float, *, config: dict | None = None) -> None:
    """In place on q, k [1, S, H, D] (views into the qkv projection output): per-head RMSNorm (weight [D]) then
    the partial split-half rotation by table [1, S, 1, R, 2, 2] — `rope.rms_norm_rope` in one pass, fp32 inside,
    one rounding. One launch for both when k's heads follow q's in memory (the qkv buffer), else one per tensor."""
    _, s, h, dim = q.shape
    r = table.shape[-3]
    for x in (q, k):
        if x.stride(-1) != 1:
            raise ValueError("qk_norm_rope_ writes in place: it needs unit last stride")
    if s == 0:
        return
    tile, options = _split(launch_config("qk_norm_rope", config, q.device))
    wq, wk = q_weight.contiguous(), k_weight.contiguous()
    if _k_follows_q(q, k):
        calls = [(q, wq, wk, 2 * h)]
    else:
        calls = [(q, wq, wq, h), (k, wk, wk, h)]
    for x, w_first, w_second, heads in calls:
        hb = max(1, min(triton.next_power_of_2(heads), tile["HB"]))
        _kernel(_qk_norm_rope_kernel)[(s, triton.cdiv(heads, hb))](
            x, w_first, w_second, table, heads, h, r, x.stride(1), x.stride(2), table.stride(1), table.stride(3),
            table.stride(4), table.stride(5), float(eps), D=dim, HB=hb, EXACT=bool(tile["EXACT"]),
            BF16_INT=x.dtype == torch.bfloat16 and _interpreting(), INTERPRET=_interpreting(), **options)
