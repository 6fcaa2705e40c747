"""budget_attn's block selection from every row of each query block, fused: one Triton program per (query block,
b·h) runs `budget_attention.choose` on the masses `budget_attention.block_masses` would give with all 64 rows sampled,
without writing them anywhere.

The program's 64 query rows (the last block's rows past S repeat row S−1, as `sample_rows` does) meet the pooled keys
(`budget_attention.pooled_keys`: the mean key and log-length of every 16-token sub-block) CHUNK sub-keys at a time, in
three passes over them, recomputing the logits each time (64 · S/16 · D products a pass, 3/16 of QKᵀ's):

1. each row's log-sum-exp over every sub-key (online max and sum, log2 units);
2. each key block's mean mass over the rows (a sub-key's softmax weights summed over the rows, then over the block's
   four sub-keys), written to a scratch row;
3. each row's mass per bucket of the blocks' mean masses (`budget_attention.mass_bucket`), the forced blocks left
   out: the softmax weights times a one-hot matrix of the sub-keys' buckets, one product per chunk.

Then, as `choose`: the lightest buckets whose mass on every row stays within the budget are dropped (a reversed
running sum over buckets, its maximum over rows); every other block and the forced ones (the diagonal, its
neighbours, the `PB` sink blocks) are kept. The products run on the tensor cores as three TF32 products each
(split operands: fp32's accuracy), so the kernel's masses are the torch rule's up to fp32 summation order, and its
choice differs from the rule's only for a block whose mean mass lies on a bucket edge.
"""

from __future__ import annotations

import math

import torch

from h3direct.dit.block_sparse_triton import HEAD_DIMS, MAX_PROGRAMS  # budget_attn's kernel: the same calls
from h3direct.dit.budget_options import BUDGET_BLOCK, BUDGET_SUB
from h3direct.triton_build import FP_OPTIONS, with_overrides
from h3direct.triton_build import build as _kernel
from h3direct.triton_build import interpreting as _interpreting

try:  # Triton is optional (as in block_sparse_triton)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - environments without Triton
    triton = None

SUBS = BUDGET_BLOCK // BUDGET_SUB  # sub-keys per key block

# CHUNK: pooled sub-keys per step (16 key blocks); a stage holds a [CHUNK, D] fp32 tile of them (32 KiB at D = 128)
# beside the query tile (32 KiB): one stage on the 99 KiB targets. Untuned starting points; `config` overrides them.
DEFAULT_LAUNCH: dict = {"CHUNK": 64, "num_warps": 8, "num_stages": 1}
LAUNCH: dict[tuple[int, int], dict] = {
    (9, 0): {"CHUNK": 64, "num_warps": 4, "num_stages": 2},  # Hopper: 227 KiB a block
    (10, 0): {"CHUNK": 64, "num_warps": 4, "num_stages": 2},  # B200: 227 KiB a block
    (12, 0): {"CHUNK": 64, "num_warps": 8, "num_stages": 1},  # Blackwell consumer: 99 KiB a block
    (12, 1): {"CHUNK": 64, "num_warps": 8, "num_stages": 1},  # GB10 (DGX Spark): 99 KiB a block
}
_OPTIONS = ("num_warps", "num_stages")


def launch_config(device: torch.device | None = None, config: dict | None = None) -> dict:
    """`LAUNCH[compute capability of device]` (else `DEFAULT_LAUNCH`) with `config`'s entries over it."""
    return with_overrides(LAUNCH, DEFAULT_LAUNCH, device, config, "budget selection")


if triton is not None:
    def _dot(a, b, acc, INTERPRET: tl.constexpr):
        """acc + a @ b of fp32 operands: three TF32 products (fp32's accuracy) compiled, fp32 in the interpreter."""
        if INTERPRET:
            out = tl.dot(a, b, acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc, input_precision="tf32x3")
        return out

    def _reduce(x, AXIS: tl.constexpr, OP: tl.constexpr, INTERPRET: tl.constexpr):
        """max (OP 0) or sum (OP 1) over AXIS (tl.max / tl.sum are compiled-mode functions when Triton was imported
        outside the interpreter)."""
        if INTERPRET:
            if OP == 0:
                out = tl.reduce(x, AXIS, tl.standard._elementwise_max)
            else:
                out = tl.reduce(x, AXIS, tl.standard._sum_combine)
        else:
            if OP == 0:
                out = tl.max(x, axis=AXIS)
            else:
                out = tl.sum(x, axis=AXIS)
        return out

    def _suffix_sum(x, INTERPRET: tl.constexpr):
        """x [R, NB] -> the sums over buckets e..NB-1, per row (a reversed running sum over axis 1)."""
        if INTERPRET:
            out = tl.associative_scan(x, 1, tl.standard._sum_combine, reverse=True)
        else:
            out = tl.cumsum(x, axis=1, reverse=True)
        return out

    def _select_kernel(q_ptr, kp_ptr, ll_ptr, edge_ptr, mean_ptr, keep_ptr, drop_ptr,
                       S, H, NQ, NK, NSUB, PB, sq_b, sq_h, sq_s, qk_scale, budget,
                       D: tl.constexpr, BLOCK: tl.constexpr, SUBS: tl.constexpr, CHUNK: tl.constexpr,
                       NB: tl.constexpr, INTERPRET: tl.constexpr, DOT: tl.constexpr, RED: tl.constexpr,
                       SCAN: tl.constexpr):
        i = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        t = tl.arange(0, BLOCK)
        d = tl.arange(0, D)
        c = tl.arange(0, CHUNK)
        e = tl.arange(0, NB)
        rows = tl.minimum(i * BLOCK + t, S - 1).to(tl.int64)  # past S: row S-1 again
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_s + d[None, :]).to(tl.float32)
        kp_at = kp_ptr + bh * NSUB * D + c[None, :] * D + d[:, None]  # pooled keysᵀ [D, CHUNK]
        # 1. each row's max and sum over every sub-key (log2 units)
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l = tl.full([BLOCK], 0.0, dtype=tl.float32)
        for c0 in range(0, NSUB, CHUNK):
            kt = tl.load(kp_at + c0 * D)
            s = DOT(q, kt, tl.full([BLOCK, CHUNK], 0.0, dtype=tl.float32), INTERPRET) * qk_scale
            s = s + tl.load(ll_ptr + c0 + c)[None, :]
            m_new = tl.maximum(m, RED(s, 1, 0, INTERPRET))
            l = l * tl.math.exp2(m - m_new) + RED(tl.math.exp2(s - m_new[:, None]), 1, 1, INTERPRET)
            m = m_new
        inv_l = 1.0 / l
        # 2. each key block's mean mass over the rows
        mean_row = mean_ptr + (bh * NQ + i) * NK
        g = tl.arange(0, CHUNK // SUBS)
        for c0 in range(0, NSUB, CHUNK):
            kt = tl.load(kp_at + c0 * D)
            s = DOT(q, kt, tl.full([BLOCK, CHUNK], 0.0, dtype=tl.float32), INTERPRET) * qk_scale
            s = s + tl.load(ll_ptr + c0 + c)[None, :]
            p = tl.math.exp2(s - m[:, None]) * inv_l[:, None]
            per_sub = RED(p, 0, 1, INTERPRET)  # [CHUNK]
            per_block = RED(tl.reshape(per_sub, [CHUNK // SUBS, SUBS]), 1, 1, INTERPRET) * (1.0 / BLOCK)
            blocks = c0 // SUBS + g
            tl.store(mean_row + blocks, per_block, mask=blocks < NK)
        # 3. each row's mass per bucket of the blocks' mean masses, forced blocks left out
        hist = tl.full([BLOCK, NB], 0.0, dtype=tl.float32)
        upper = tl.load(edge_ptr + e, mask=e > 0, other=0.0)  # edges after the first (0: above no mass)
        for c0 in range(0, NSUB, CHUNK):
            kt = tl.load(kp_at + c0 * D)
            s = DOT(q, kt, tl.full([BLOCK, CHUNK], 0.0, dtype=tl.float32), INTERPRET) * qk_scale
            s = s + tl.load(ll_ptr + c0 + c)[None, :]
            p = tl.math.exp2(s - m[:, None]) * inv_l[:, None]
            block = (c0 + c) // SUBS
            live = block < NK
            mean = tl.load(mean_row + block, mask=live, other=0.0)
            bucket = RED(tl.where(mean[:, None] < upper[None, :], 1, 0), 1, 1, INTERPRET)
            free = live & ((block - i) * (block - i) > 1) & (block >= PB)
            onehot = tl.where(free[:, None] & (bucket[:, None] == e[None, :]), 1.0, 0.0)
            hist = DOT(p, onehot, hist, INTERPRET)
        worst = RED(SCAN(hist, INTERPRET), 0, 0, INTERPRET)  # [NB]: dropping bucket e and every lighter one
        cut = NB - RED(tl.where(worst <= budget, 1, 0), 0, 1, INTERPRET)
        dropped = RED(tl.where(e == cut, worst, 0.0), 0, 1, INTERPRET)
        tl.store(drop_ptr + bh * NQ + i, dropped)
        # the keep row: forced, or a bucket heavier than the cut
        for j0 in range(0, NK, CHUNK):
            block = j0 + c
            live = block < NK
            mean = tl.load(mean_row + block, mask=live, other=0.0)
            bucket = RED(tl.where(mean[:, None] < upper[None, :], 1, 0), 1, 1, INTERPRET)
            forced = ((block - i) * (block - i) <= 1) | (block < PB)
            tl.store(keep_ptr + (bh * NQ + i) * NK + block, (forced | (bucket < cut)).to(tl.uint8), mask=live)


def kernel_reason(like: torch.Tensor) -> str | None:
    """Why the kernel cannot take `like` (None: it can): Triton, the device, the head size, the grid."""
    if triton is None:
        return "Triton is not importable"
    if not like.is_cuda and not _interpreting():
        return f"the kernel runs on CUDA (CPU tensors under TRITON_INTERPRET=1), got {like.device}"
    b, h, _, d = like.shape
    if d not in HEAD_DIMS:
        return f"head_dim {d} is not one of the kernel's {HEAD_DIMS}"
    if b * h > MAX_PROGRAMS:
        return f"batch x heads {b * h} > {MAX_PROGRAMS} (the kernel's grid)"
    return None


def select_blocks(q: torch.Tensor, pooled: torch.Tensor, log_len: torch.Tensor, edges: torch.Tensor, mass: float,
                  pb: int, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, S, D]; the pooled keys fp32 [B·H, NK·4, D] and their log-lengths [NK·4]
    (`budget_attention.pooled_keys`); the buckets' edges (`budget_attention.mass_edges`) -> (keep bool
    [B, H, NQ, NK], dropped fp32 [B, H, NQ]): `budget_attention.choose` on every row's estimated block masses, the
    first `pb` key blocks forced beside the diagonal and its neighbours. A one-line ValueError where the kernel
    cannot run (`kernel_reason`)."""
    why = kernel_reason(q)
    if why is not None:
        raise ValueError(f"budget selection kernel: {why}")
    b, h, s, d = q.shape
    n = -(-s // BUDGET_BLOCK)
    cfg = launch_config(q.device, config)
    chunk = cfg["CHUNK"]
    nsub = -(-pooled.shape[1] // chunk) * chunk
    kp = torch.nn.functional.pad(pooled, (0, 0, 0, nsub - pooled.shape[1])).contiguous()
    ll2 = torch.nn.functional.pad(log_len * math.log2(math.e), (0, nsub - log_len.shape[0]), value=float("-inf"))
    means = torch.empty(b * h, n, n, dtype=torch.float32, device=q.device)
    keep = torch.empty(b, h, n, n, dtype=torch.uint8, device=q.device)
    dropped = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    interpret = _interpreting()
    options = {**FP_OPTIONS, **{key: value for key, value in cfg.items() if key in _OPTIONS}}
    _kernel(_select_kernel)[(n, b * h)](
        q, kp, ll2.contiguous(), edges.contiguous(), means, keep, dropped, s, h, n, n, nsub, pb, q.stride(0),
        q.stride(1), q.stride(2), d ** -0.5 * math.log2(math.e), float(mass), D=d, BLOCK=BUDGET_BLOCK, SUBS=SUBS,
        CHUNK=chunk, NB=edges.numel(), INTERPRET=interpret, DOT=_kernel(_dot), RED=_kernel(_reduce),
        SCAN=_kernel(_suffix_sum), **options)
    return keep.view(torch.bool), dropped
