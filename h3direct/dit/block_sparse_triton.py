"""Block-sparse attention with a pooled tail: a Triton forward kernel and the eager reference it must match.

Blocks of BLOCK tokens, for queries and keys alike (NQ = NK = ceil(S / BLOCK); the last block may be partial).
`keep` [B, H, NQ, NK] says which key blocks each query block attends exactly. For a query row r of block i, with
scale = D^-1/2, the softmax runs over

- exact terms: scale · q_r·k_t for every key t of a kept block j (keep[b, h, i, j]), with value v_t;
- tail terms (`tail`): one per key block j that is not kept, logit scale · q_r·k̄_j + log(n_j), value v̄_j, where
  k̄_j, v̄_j are the means of k, v over the block's n_j tokens. Each is the block's n_j keys collapsed onto their mean,
  so the dropped blocks' mass stays approximately in the denominator.

`tail_mass` is the share of each row's softmax mass that went to the tail terms. A row with no term at all (no kept
block and the tail off) gets zeros, and so does its tail mass.

The kernel: one program per (query block, b·h). The kept key blocks come as a compact index list per (b, h, i)
(`kept_lists`), so the exact loop runs only over them; QKᵀ and PV are tensor-core products in the input dtype with
fp32 accumulation, the softmax is online in fp32 (exp2, log2(e) folded into the scale). The tail loop then takes the
NK pooled keys CHUNK at a time: their logits by one product, the kept blocks masked out by the keep row, log2(n_j)
added, folded into the same online softmax with the pooled values. The weights are rounded to the input dtype before
the PV product and the row sums add those rounded weights, so an output row is a convex combination of its values up
to fp32 sums. Launch configs per compute capability: `LAUNCH`.

`block_sparse_reference` is the same math in fp32 eager torch on any device (chunked over query blocks); the backend
runs it where the kernel cannot (the CPU), and the tests hold the kernel to it.
"""

from __future__ import annotations

import math

import torch

from h3direct.dit.budget_options import BUDGET_BLOCK as BLOCK  # tokens per query and per key block
from h3direct.triton_build import FP_OPTIONS, with_overrides
from h3direct.triton_build import build as _kernel
from h3direct.triton_build import interpreting as _interpreting

try:  # Triton is optional (CUDA wheels of torch ship it; the `test` extra installs it for the interpreter)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - environments without Triton
    triton = None

HEAD_DIMS = (64, 128)  # head dims the kernel is built for
MAX_PROGRAMS = 65535  # batch · heads: the grid's second axis
_REFERENCE_LOGITS = 1 << 26  # fp32 logits the reference holds at once (its query blocks are chunked to fit)

# ---- launch configurations ------------------------------------------------------------------------------------
# CHUNK: pooled keys per step of the tail loop. num_stages: how many K/V tiles are in flight (at D = 128 a stage holds
# a K and a V tile, 2 · 16 KiB in 16 bits). num_warps: 4 where one warpgroup's wgmma / tcgen05 products take the
# 64-row tile; 8 on the mma.sync targets (Ampere, Ada, sm_120/121), where 4 warps spill registers. sm_120/121 (GB10)
# gives a block 99 KiB of shared memory: two stages there. Untuned starting points; `config` overrides them per call.

DEFAULT_LAUNCH: dict = {"CHUNK": 64, "num_warps": 8, "num_stages": 2}  # other GPUs (mma.sync), the interpreter

LAUNCH: dict[tuple[int, int], dict] = {
    (9, 0): {"CHUNK": 64, "num_warps": 4, "num_stages": 3},  # Hopper (H100, H200): wgmma, 227 KiB a block
    (10, 0): {"CHUNK": 64, "num_warps": 4, "num_stages": 3},  # Blackwell datacenter (B200): tcgen05, 227 KiB a block
    (12, 0): {"CHUNK": 64, "num_warps": 8, "num_stages": 2},  # Blackwell consumer: mma.sync, 99 KiB a block
    (12, 1): {"CHUNK": 64, "num_warps": 8, "num_stages": 2},  # GB10 (DGX Spark): mma.sync, 99 KiB a block
}
_OPTIONS = ("num_warps", "num_stages")


def launch_config(device: torch.device | None = None, config: dict | None = None) -> dict:
    """`LAUNCH[compute capability of device]` (else `DEFAULT_LAUNCH`) with `config`'s entries over it."""
    return with_overrides(LAUNCH, DEFAULT_LAUNCH, device, config, "block-sparse attention")


# ---- kernel (plain functions; `_kernel` jit-compiles them on first use) -------------------------------------------

if triton is not None:
    def _round_to(x, DTYPE: tl.constexpr, BF16_INT: tl.constexpr):
        """fp32 -> DTYPE, to nearest even (bf16 by integer arithmetic under the interpreter, whose cast truncates)."""
        if BF16_INT:
            b = x.to(tl.uint32, bitcast=True)
            out = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = x.to(DTYPE)
        return out

    def _mma(a, b, acc, INTERPRET: tl.constexpr):
        """acc + a @ b, fp32 accumulation (the interpreter's dot misreads 16-bit operands: as fp32 they are exact)."""
        if INTERPRET:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc)
        return out

    def _row_max(x, INTERPRET: tl.constexpr):
        """max over axis 1 (tl.max: a compiled-mode function when Triton was imported outside the interpreter)."""
        if INTERPRET:
            out = tl.reduce(x, 1, tl.standard._elementwise_max)
        else:
            out = tl.max(x, axis=1)
        return out

    def _row_sum(x, INTERPRET: tl.constexpr):
        """sum over axis 1 (tl.sum: as `_row_max`)."""
        if INTERPRET:
            out = tl.reduce(x, 1, tl.standard._sum_combine)
        else:
            out = tl.sum(x, axis=1)
        return out

    def _block_sparse_kernel(q_ptr, k_ptr, v_ptr, km_ptr, vm_ptr, idx_ptr, cnt_ptr, keep_ptr, o_ptr, mass_ptr,
                             S, H, NQ, NK, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
                             qk_scale, D: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                             TAIL: tl.constexpr, BF16_INT: tl.constexpr, INTERPRET: tl.constexpr,
                             ROUND: tl.constexpr, MMA: tl.constexpr, MAX: tl.constexpr, SUM: tl.constexpr):
        # program = (query block i, b·h): 64 query rows against the kept key blocks, then the pooled tail.
        # m, l: running max (log2 units) and weight sum; lt: its tail part (0 until the tail loop); acc: unnormalized
        # output [BLOCK, D]
        i = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        dt = q_ptr.dtype.element_ty
        t = tl.arange(0, BLOCK)
        d = tl.arange(0, D)
        start = i * BLOCK
        rows_live = (start + t) < S
        q = tl.load(q_ptr + b * sq_b + h * sq_h + start.to(tl.int64) * sq_s + t[:, None] * sq_s + d[None, :],
                    mask=rows_live[:, None], other=0.0)
        k_at = k_ptr + b * sk_b + h * sk_h + t[None, :] * sk_s + d[:, None]  # a key block's Kᵀ [D, BLOCK]
        v_at = v_ptr + b * sv_b + h * sv_h + t[:, None] * sv_s + d[None, :]  # a key block's V [BLOCK, D]
        row = (bh * NQ + i) * NK  # this (b, h, i)'s index list and keep row
        count = tl.load(cnt_ptr + bh * NQ + i)
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l = tl.full([BLOCK], 0.0, dtype=tl.float32)
        lt = tl.full([BLOCK], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK, D], 0.0, dtype=tl.float32)
        for n in range(0, count):  # kept key blocks, exact (each has a live key: m stays finite)
            j = tl.load(idx_ptr + row + n)
            key0 = (j * BLOCK).to(tl.int64)
            keys_live = (j * BLOCK + t) < S
            kt = tl.load(k_at + key0 * sk_s, mask=keys_live[None, :], other=0.0)
            s = MMA(q, kt, tl.full([BLOCK, BLOCK], 0.0, dtype=tl.float32), INTERPRET) * qk_scale
            s = tl.where(keys_live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, MAX(s, INTERPRET))
            alpha = tl.math.exp2(m - m_new)
            p = ROUND(tl.math.exp2(s - m_new[:, None]), dt, BF16_INT)
            l = l * alpha + SUM(p.to(tl.float32), INTERPRET)
            vb = tl.load(v_at + key0 * sv_s, mask=keys_live[:, None], other=0.0)
            acc = MMA(p, vb, acc * alpha[:, None], INTERPRET)
            m = m_new
        if TAIL:  # pooled keys of the blocks not kept: logit + log2(n_j), value v̄_j
            c = tl.arange(0, CHUNK)
            km_at = km_ptr + bh * NK * D + c[None, :] * D + d[:, None]  # pooled Kᵀ [D, CHUNK]
            vm_at = vm_ptr + bh * NK * D + c[:, None] * D + d[None, :]  # pooled V [CHUNK, D]
            for c0 in range(0, NK, CHUNK):
                blocks = c0 + c
                inside = blocks < NK
                kept = tl.load(keep_ptr + row + blocks, mask=inside, other=1)
                pooled = inside & (kept == 0)
                n_j = tl.minimum(S - blocks * BLOCK, BLOCK)
                log2_n = tl.math.log2(tl.maximum(n_j, 1).to(tl.float32))
                kmt = tl.load(km_at + c0 * D, mask=inside[None, :], other=0.0)
                s = MMA(q, kmt, tl.full([BLOCK, CHUNK], 0.0, dtype=tl.float32), INTERPRET) * qk_scale
                s = tl.where(pooled[None, :], s + log2_n[None, :], float("-inf"))
                m_new = tl.maximum(m, MAX(s, INTERPRET))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no term yet: every weight is 0
                alpha = tl.math.exp2(m - m_use)
                p = ROUND(tl.math.exp2(s - m_use[:, None]), dt, BF16_INT)
                ps = SUM(p.to(tl.float32), INTERPRET)
                l = l * alpha + ps
                lt = lt * alpha + ps
                vm = tl.load(vm_at + c0 * D, mask=inside[:, None], other=0.0)
                acc = MMA(p, vm, acc * alpha[:, None], INTERPRET)
                m = m_new
        denom = tl.where(l > 0.0, l, 1.0)  # a row with no term: zeros
        out = ROUND(acc / denom[:, None], dt, BF16_INT)
        tl.store(o_ptr + b * so_b + h * so_h + start.to(tl.int64) * so_s + t[:, None] * so_s + d[None, :], out,
                 mask=rows_live[:, None])
        tl.store(mass_ptr + bh * S + start + t, lt / denom, mask=rows_live)


# ---- torch side ---------------------------------------------------------------------------------------------------

def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> int:
    """The number of blocks per row of `keep`; a one-line error for inputs the call cannot take."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"block-sparse attention: q, k, v must be [B, H, S, D] alike, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, s, _ = q.shape
    n = -(-s // BLOCK)
    if keep.dtype != torch.bool or tuple(keep.shape) != (b, h, n, n):
        raise ValueError(f"block-sparse attention: keep must be bool [B, H, NQ, NK] = {(b, h, n, n)} for S = {s}, "
                         f"got {keep.dtype} {tuple(keep.shape)}")
    return n


def block_means(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> fp32 [B, H, NK, D]: the mean of each key block's tokens (the last block's live ones only)."""
    s = x.shape[2]
    full = s // BLOCK
    parts = []
    if full:
        parts.append(x[:, :, :full * BLOCK].unflatten(2, (full, BLOCK)).mean(3, dtype=torch.float32))
    if s % BLOCK:
        parts.append(x[:, :, full * BLOCK:].mean(2, keepdim=True, dtype=torch.float32))
    return torch.cat(parts, 2) if parts else x.new_zeros(*x.shape[:2], 0, x.shape[3], dtype=torch.float32)


def block_lengths(s: int, device=None) -> torch.Tensor:
    """fp32 [NK]: each key block's token count (BLOCK, the last one S - BLOCK·(NK-1))."""
    starts = torch.arange(0, s, BLOCK, device=device)
    return (s - starts).clamp(max=BLOCK).to(torch.float32)


def kept_lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [..., NK] -> (int32 [..., NK]: the kept key blocks first, ascending, then the others; int32 [...]: how many
    are kept)."""
    order = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return order.to(torch.int32), keep.sum(-1, dtype=torch.int32)


def block_sparse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                           tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's math in fp32 eager torch, any device: q, k, v [B, H, S, D]; keep bool [B, H, NQ, NK] ->
    (out [B, H, S, D] in q's dtype, tail_mass fp32 [B, H, S])."""
    n = _check(q, k, v, keep)
    b, h, s, d = q.shape
    scale = d ** -0.5
    qf, kf, vf = q.float(), k.float(), v.float()
    key_block = torch.arange(s, device=q.device) // BLOCK
    if tail:
        km, vm = block_means(k), block_means(v)
        log_n = block_lengths(s, q.device).log()
    out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
    mass = torch.zeros(b, h, s, dtype=torch.float32, device=q.device)
    step = max(1, _REFERENCE_LOGITS // max(1, b * h * BLOCK * (s + n)))  # query blocks per chunk
    for i0 in range(0, n, step):
        rows = slice(i0 * BLOCK, min(s, (i0 + step) * BLOCK))
        kept = keep[:, :, i0:i0 + step].repeat_interleave(BLOCK, 2)[:, :, :rows.stop - rows.start]  # [B, H, r, NK]
        logits = (qf[:, :, rows] @ kf.transpose(-1, -2) * scale).masked_fill(~kept[..., key_block], float("-inf"))
        if tail:
            pooled = (qf[:, :, rows] @ km.transpose(-1, -2) * scale + log_n).masked_fill(kept, float("-inf"))
            logits = torch.cat([logits, pooled], -1)
        w = torch.softmax(logits, -1).nan_to_num(nan=0.0)  # a row with no term: all -inf, zeros
        out[:, :, rows] = w[..., :s] @ vf
        if tail:
            out[:, :, rows] += w[..., s:] @ vm
            mass[:, :, rows] = w[..., s:].sum(-1)
    return out.to(q.dtype), mass


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                           tail: bool = True, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, S, D]; keep bool [B, H, NQ, NK] -> (out [B, H, S, D] in q's dtype, tail_mass fp32 [B, H, S]).

    The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): bf16/fp16, D in HEAD_DIMS, any strides with
    unit last stride (others are copied). out is a view of [B, S, H, D] storage. `config`: entries over the device's
    `launch_config`."""
    n = _check(q, k, v, keep)
    b, h, s, d = q.shape
    if triton is None:
        raise RuntimeError("block_sparse_attention needs Triton; block_sparse_reference runs without it")
    if not q.is_cuda and not _interpreting():
        raise ValueError(f"block-sparse attention: the kernel runs on CUDA (CPU tensors under TRITON_INTERPRET=1), got "
                         f"{q.device}; block_sparse_reference runs anywhere")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"block-sparse attention: bf16 or fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"block-sparse attention: head_dim {d} is not one of {HEAD_DIMS}")
    if b * h > MAX_PROGRAMS:
        raise ValueError(f"block-sparse attention: B·H = {b * h} programs in grid axis 1 (at most {MAX_PROGRAMS})")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    mass = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    if s == 0 or b * h == 0:
        return out, mass
    keep = keep.contiguous()
    index, count = kept_lists(keep)
    if tail:
        km, vm = (block_means(x).to(q.dtype).contiguous() for x in (k, v))  # [B, H, NK, D] dense
    else:
        km = vm = q  # unread placeholders
    cfg = launch_config(q.device, config)
    tile = {key: value for key, value in cfg.items() if key not in _OPTIONS}
    options = {**FP_OPTIONS, **{key: value for key, value in cfg.items() if key in _OPTIONS}}
    interpret = _interpreting()
    _kernel(_block_sparse_kernel)[(n, b * h)](
        q, k, v, km, vm, index, count, keep.view(torch.uint8), out, mass, s, h, n, n, q.stride(0), q.stride(1),
        q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0),
        out.stride(1), out.stride(2), d ** -0.5 * math.log2(math.e), D=d, BLOCK=BLOCK, CHUNK=tile["CHUNK"],
        TAIL=bool(tail), BF16_INT=q.dtype == torch.bfloat16 and interpret, INTERPRET=interpret,
        ROUND=_kernel(_round_to), MMA=_kernel(_mma), MAX=_kernel(_row_max), SUM=_kernel(_row_sum), **options)
    return out, mass
