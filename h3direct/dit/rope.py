"""3-axis partial rotary embedding, split-half convention, fused with the per-head QK RMSNorm.

Angles: position (t, h, w) × inv_freq per axis -> [S, 3·L] (t | h | w), duplicated -> [S, 6·L]; only the
first 6·L dims of each head rotate (96 of 128 in the real model), the rest pass through. Split-half:
a head's rotated part is [x1 | x2] (halves of 3·L), rotated as (x1·cos − x2·sin, x1·sin + x2·cos).

The rotation table is [1, S, 1, 3L, 2, 2] in the compute dtype — what ComfyUI hands comfy-kitchen's fused
`rms_rope_split_half_` kernel (and what the oracle traces store as `blocks.N.in.3`). The arithmetic here
follows that kernel's eager form op for op (RMSNorm in the input dtype, rotation in the table's dtype) so
CPU results are bit-identical. On CUDA, `rms_norm_rope_` runs h3direct's Triton kernel in place (`fused.py`:
fp32 inside, one rounding; judged by the exact budgets), or with the option `fused` off comfy-kitchen's fused kernel
when comfy-kitchen is installed — the very kernel ComfyUI runs on GPUs — and the eager form otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.checkpoint.quant.kitchen import kitchen_op
from h3direct.dit import fused


def rope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[S, 3] float64 positions, [L] fp32 inv_freq -> [S, 6L] fp32 angles.

    θ[s, a·L + j] = p[s, a] · ω_j for the axes a = t, h, w and j < L (positions rounded to fp32 first);
    the 3L angles then appear twice, once per half of the split-half rotated dims.
    """
    pos = position_ids.to(torch.float32).to(inv_freq.device)
    theta = rearrange(pos[:, :, None] * inv_freq[None, None, :], "s a l -> s (a l)")
    return theta.repeat(1, 2)


def rotation_table(angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, 6L] angles -> [1, S, 1, 3L, 2, 2] rotation matrices R(θ) = [[cos θ, −sin θ], [sin θ, cos θ]] in `dtype`.

    Only the first half of the angles is read: the second half repeats it.
    """
    theta = angles[:, :angles.shape[-1] // 2]
    cos, sin = theta.cos(), theta.sin()
    rows = torch.stack([torch.stack([cos, -sin], dim=-1), torch.stack([sin, cos], dim=-1)], dim=-2)  # [S, 3L, 2, 2]
    return rearrange(rows, "s r i j -> 1 s 1 r i j").to(dtype)


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
                   table: torch.Tensor, eps: float, *, fuse: bool = True) -> None:
    """In place on q, k [1, S, H, D] (views into the qkv buffer): per-head RMSNorm + partial split-half rope.

    CUDA: h3direct's Triton kernel (`fused.qk_norm_rope_`: fp32 inside, one rounding) unless `fuse` is off, else
    comfy-kitchen's kernel when installed; the eager form otherwise."""
    if fused.enabled(q, on=fuse) and fused.qk_norm_rope_supported(q, table):
        fused.qk_norm_rope_(q, k, q_weight, k_weight, table, eps)
        return
    kernel = kitchen_op("rms_rope_split_half_") if q.is_cuda else None
    if kernel is not None:
        kernel(q, k, table, q_weight, k_weight, epsilon=eps, rot_dim=table.shape[-3] * 2)
        return
    q.copy_(rms_norm_rope(q, q_weight, table, eps))
    k.copy_(rms_norm_rope(k, k_weight, table, eps))
