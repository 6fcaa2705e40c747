"""H3 transformer layers. Attribute names are ComfyUI's checkpoint keys (`blocks.7.attn.qkv_proj`, …).

In-place updates mirror ComfyUI's order of operations (modulation on the norm output, gated residual
accumulated into the stream), so bf16 results round the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from h3direct.dit import fused
from h3direct.dit.attention import DEFAULT_BACKEND, attention
from h3direct.dit.linear import Linear
from h3direct.dit.rope import rms_norm_rope_
from h3direct.dit.timesteps import ModRun


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = Linear(hidden, 3 * heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.out_proj = Linear(heads * head_dim, hidden, bias=False)
        self.tracer = None  # set by tracing.Tracer to record rope'd q/k

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor | None = None, *,
                backend: str = DEFAULT_BACKEND, sp=None) -> torch.Tensor:
        # x: [S, hidden] -> [S, hidden]; qkv rows are contiguous q | k | v thirds
        s, h, d = x.shape[0], self.heads, self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(h * d, dim=-1)
        if rope_table is not None:
            # fused per-head RMSNorm + partial rope, written back into the qkv buffer like ComfyUI's kernel
            q, k = q.view(1, s, h, d), k.view(1, s, h, d)
            rms_norm_rope_(q, k, self.q_norm.weight, self.k_norm.weight, rope_table, self.q_norm.eps)
            q, k = q[0], k[0]
            if self.tracer is not None:
                self.tracer.record_tensor(self, "rope_q", q)
                self.tracer.record_tensor(self, "rope_k", k)
        else:
            q, k = self.q_norm(q.view(s, h, d)), self.k_norm(k.view(s, h, d))
        v = v.reshape(s, h, d).clone()
        # sp: a `parallel.SequenceParallel` when x is this rank's slice of the sequence (all-to-all around attention)
        attend = attention if sp is None else sp.attention
        out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], backend)
        return self.out_proj(out[0])


class MLP(nn.Module):
    """SwiGLU: fc1 -> [gate | up] -> silu(gate)·up -> fc2. `chunks` > 1 runs rows in slices (exact)."""

    CHUNK_ALIGN = 64

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = Linear(ffn, hidden, bias=False)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if fused.enabled(h):
            return self.fc2(fused.swiglu(h))
        gate, up = h.chunk(2, dim=-1)
        return self.fc2(F.silu(gate).mul_(up))

    def forward(self, x: torch.Tensor, *, chunks: int = 1) -> torch.Tensor:
        # x: [S, hidden] -> [S, hidden]. Chunk boundaries fall on multiples of CHUNK_ALIGN rows and the last
        # chunk takes the remainder, so no GEMM runs on a sliver of rows (BLAS switches kernels for tiny M,
        # which would break bitwise equality with the unchunked product).
        s = x.shape[0]
        if chunks <= 1 or s < 2 * self.CHUNK_ALIGN:
            return self._swiglu(x)
        step = max(self.CHUNK_ALIGN, -(-s // chunks) // self.CHUNK_ALIGN * self.CHUNK_ALIGN)
        bounds = list(range(0, s, step))[:chunks] + [s]
        if bounds[-2] >= s - self.CHUNK_ALIGN // 2 and len(bounds) > 2:
            bounds.pop(-2)
        out = torch.empty(s, self.fc2.out_features, dtype=x.dtype, device=x.device)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            out[a:b] = self._swiglu(x[a:b])
        return out


class AdalnProj(nn.Module):
    """t_emb [M, k] -> `expand` tensors of [M·modalities, hidden]; row m·modalities + tag."""

    def __init__(self, t_dim: int, hidden: int, expand: int, modalities: int, curve: bool):
        super().__init__()
        self.expand, self.modalities, self.hidden, self.apply_silu = expand, modalities, hidden, not curve
        self.linear = Linear(t_dim, expand * hidden * modalities, bias=True, island=curve)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.linear(F.silu(t_emb) if self.apply_silu else t_emb)
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)


def modulate_(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, runs: list[ModRun]) -> torch.Tensor:
    """In place: h[run] = h[run]·(1 + scale[row]) + shift[row], per run."""
    for r in runs:
        h[r.start:r.stop].mul_(1.0 + scale[r.row].to(h.dtype)).add_(shift[r.row].to(h.dtype))
    return h


def gated_residual_(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, runs: list[ModRun]) -> torch.Tensor:
    """In place: x[run] += update[run]·gate[row], per run."""
    for r in runs:
        x[r.start:r.stop].addcmul_(update[r.start:r.stop], gate[r.row].to(x.dtype))
    return x


class RefinerBlock(nn.Module):
    """Text token refiner block: pre-norm attention (no rope) and SwiGLU, plain residuals."""

    def __init__(self, hidden, heads, head_dim, ffn, eps, qk_eps):
        super().__init__()
        self.norm1 = RMSNorm(hidden, eps)
        self.norm2 = RMSNorm(hidden, eps)
        self.attn = Attention(hidden, heads, head_dim, qk_eps)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor, *, backend: str = DEFAULT_BACKEND) -> torch.Tensor:
        # x: [L, hidden]
        x = self.attn(self.norm1(x), backend=backend).add_(x)
        return self.mlp(self.norm2(x)).add_(x)


class TokenRefiner(nn.Module):
    def __init__(self, num_layers, hidden, heads, head_dim, ffn, eps, qk_eps, final_eps):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(hidden, heads, head_dim, ffn, eps, qk_eps)
                                    for _ in range(num_layers))
        self.final_norm = RMSNorm(hidden, final_eps)

    def forward(self, x: torch.Tensor, *, backend: str = DEFAULT_BACKEND) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, backend=backend)
        return self.final_norm(x)


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, t_dim, eps, qk_eps, curve: bool):
        super().__init__()
        self.norm1 = RMSNorm(hidden, eps)
        self.norm2 = RMSNorm(hidden, eps)
        self.attn = Attention(hidden, heads, head_dim, qk_eps)
        self.mlp = MLP(hidden, ffn)
        self.adaln_proj = AdalnProj(t_dim, hidden, 6, 3, curve)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, runs: list[ModRun], rope_table: torch.Tensor, *,
                backend: str = DEFAULT_BACKEND, mlp_chunks: int = 1, sp=None) -> torch.Tensor:
        # x: [S, hidden] (updated in place), t_emb: [n_t, k], rope_table: [1, S, 1, R, 2, 2]
        # (with sp, S is this rank's slice and runs / rope_table are cut to it: parallel.SequenceParallel.split)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
        h = modulate_(self.norm1(x), shift_msa, scale_msa, runs)
        x = gated_residual_(x, gate_msa, self.attn(h, rope_table, backend=backend, sp=sp), runs)
        h = modulate_(self.norm2(x), shift_mlp, scale_mlp, runs)
        return gated_residual_(x, gate_mlp, self.mlp(h, chunks=mlp_chunks), runs)


class FinalLayer(nn.Module):
    """Modulated norm of the target rows, then the fp32 video / audio output heads."""

    def __init__(self, hidden, t_dim, video_dim, audio_dim, eps, curve: bool):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.adaln_proj = AdalnProj(t_dim, hidden, 2, 1, curve)
        self.video_out = Linear(hidden, video_dim, bias=True, island=True)
        self.audio_out = Linear(hidden, audio_dim, bias=True, island=True)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, video_seg: tuple[int, int, int],
                audio_seg: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        # segments: (start, stop, timestep_row); returns fp32 [n_video, C·4], [n_audio, C_audio]
        shift, scale = self.adaln_proj(t_emb)
        (va, vb, vrow), (aa, ab, arow) = video_seg, audio_seg
        hv = (self.norm(x[va:vb]) * (1.0 + scale[vrow]) + shift[vrow]).to(torch.float32)
        ha = (self.norm(x[aa:ab]) * (1.0 + scale[arow]) + shift[arow]).to(torch.float32)
        return self.video_out(hv), self.audio_out(ha)
