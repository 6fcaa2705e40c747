"""Block-sparse attention with a pooled tail: the math and its eager reference.

Blocks of BLOCK tokens, for queries and keys alike (NQ = NK = ceil(S / BLOCK); the last block may be partial).
`keep` [B, H, NQ, NK] says which key blocks each query block attends exactly. For a query row r of block i, with
scale = D^-1/2, the softmax runs over

- exact terms: scale · q_r·k_t for every key t of a kept block j (keep[b, h, i, j]), with value v_t;
- tail terms (`tail`): one per key block j that is not kept, logit scale · q_r·k̄_j + log(n_j), value v̄_j, where
  k̄_j, v̄_j are the means of k, v over the block's n_j tokens. Each is the block's n_j keys collapsed onto their mean,
  so the dropped blocks' mass stays approximately in the denominator.

`tail_mass` is the share of each row's softmax mass that went to the tail terms. A row with no term at all (no kept
block and the tail off) gets zeros, and so does its tail mass.

`block_sparse_reference` is that math in fp32 eager torch on any device (chunked over query blocks).
"""

from __future__ import annotations

import torch

BLOCK = 64  # tokens per query block and per key block
_REFERENCE_LOGITS = 1 << 26  # fp32 logits the reference holds at once (its query blocks are chunked to fit)


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
