"""3-axis partial rotary embedding, split-half convention, fused with the per-head QK RMSNorm.

Angles: position (t, h, w) × inv_freq per axis -> [S, 3·L] (t | h | w), duplicated -> [S, 6·L]; only the
first 6·L dims of each head rotate (96 of 128 in the real model), the rest pass through. Split-half:
a head's rotated part is [x1 | x2] (halves of 3·L), rotated as (x1·cos − x2·sin, x1·sin + x2·cos).

The rotation table is [1, S, 1, 3L, 2, 2] in the compute dtype — what ComfyUI hands comfy-kitchen's fused
`rms_rope_split_half_` kernel (and what the oracle traces store as `blocks.N.in.3`). The arithmetic here
follows that kernel's eager form op for op (RMSNorm in the input dtype, rotation in the table's dtype) so
CPU results are bit-identical. On CUDA, `rms_norm_rope_` runs comfy-kitchen's fused kernel in place when
comfy-kitchen is installed — the very kernel ComfyUI runs on GPUs — and the eager form otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h3direct.checkpoint.quant.kitchen import kitchen_op


def rope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[S, 3] float64 positions, [L] fp32 inv_freq -> [S, 6L] fp32 angles (t|h|w, twice)."""
    pos = position_ids.to(torch.float32).to(inv_freq.device)
    per_axis = pos.unsqueeze(-1) * inv_freq.view(1, 1, -1)  # [S, 3, L]
    half = torch.cat(per_axis.unbind(dim=1), dim=-1)  # [S, 3L]
    return torch.cat((half, half), dim=-1)


def rotation_table(angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, 6L] angles -> [1, S, 1, 3L, 2, 2] rotation matrices [[cos, −sin], [sin, cos]] in `dtype`."""
    half = angles.shape[-1] // 2
    c, s = torch.cos(angles[:, :half]), torch.sin(angles[:, :half])
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, angles.shape[0], 1, half, 2, 2).to(dtype)


def rotate_split_half(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [..., S, H, 2·R] rotated by table [1, S, 1, R, 2, 2]; computed in the table's dtype, returned in x's."""
    pairs = x.reshape(*x.shape[:-1], 2, -1).movedim(-2, -1).unsqueeze(-2).to(table.dtype)  # [..., R, 1, 2]
    out = table[..., 0] * pairs[..., 0] + table[..., 1] * pairs[..., 1]  # [..., R, 2]
    return out.movedim(-1, -2).reshape(x.shape).type_as(x)


def rms_norm_rope(x: torch.Tensor, norm_weight: torch.Tensor, table: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm then partial split-half rope on the first 2·R dims. x: [1, S, H, D]."""
    x = F.rms_norm(x, (x.shape[-1],), weight=norm_weight, eps=eps)
    rot = table.shape[-3] * 2
    if rot == x.shape[-1]:
        return rotate_split_half(x, table)
    return torch.cat((rotate_split_half(x[..., :rot], table), x[..., rot:]), dim=-1)


def rms_norm_rope_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   table: torch.Tensor, eps: float) -> None:
    """In place on q, k [1, S, H, D] (views into the qkv buffer): per-head RMSNorm + partial split-half rope."""
    fused = kitchen_op("rms_rope_split_half_") if q.is_cuda else None
    if fused is not None:
        fused(q, k, table, q_weight, k_weight, epsilon=eps, rot_dim=table.shape[-3] * 2)
        return
    q.copy_(rms_norm_rope(q, q_weight, table, eps))
    k.copy_(rms_norm_rope(k, k_weight, table, eps))
