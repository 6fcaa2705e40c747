"""H3 transformer layers. Attribute names are ComfyUI's checkpoint keys (`blocks.7.attn.qkv_proj`, …).

Each sublayer of a DiT block computes, for the rows of one modulation run with adaLN row r,

    h = norm(x) ⊙ (1 + scale_r) + shift_r,        x ← x + sublayer(h) ⊙ gate_r,

with the modulation applied in place on the norm output and the gated residual accumulated into the stream
in place. That order (multiply, then add, then addcmul into x) is also the oracle's, so bf16 results round
the same way. On CUDA with Triton (`fused.py`, unless the generation's option `fused` is off) the norm +
modulation and the gated residual are one pass each over all rows, fp32 inside and rounded once: closer to fp32
than that eager order, which the exact parity budgets (ratio rule against ComfyUI's fp32 trace) judge. The
attention's gated residual and the MLP's norm + modulation share one pass there (`fused.residual_norm_modulate_`,
bitwise the two kernels in turn). When a fused kernel feeds an FP8 linear (qkv_proj, fc1, fc2 with `--fp8-linear`)
and no hook wants the activation, it writes the linear's e4m3 input rows instead of a bf16 tensor (`w8a8.E4M3Rows`:
the codes and scales the linear would have made from that tensor, bit for bit); nothing else reads those
activations (the residual stream x is still updated in place). out_proj's input comes from the attention kernel and
is quantized by the linear itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.nn.modules import module as nn_module

from h3direct.dit import fused
from h3direct.dit.attention import attention
from h3direct.dit.linear import FP8Linear, Linear
from h3direct.dit.options import DEFAULT_OPTIONS, Options
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

    def forward(self, x, rope_table: torch.Tensor | None = None, *,
                options: Options = DEFAULT_OPTIONS, sp=None) -> torch.Tensor:
        # x: [S, hidden] (or its e4m3 rows for an FP8 qkv_proj) -> [S, hidden]. The projection's features are
        # q | k | v, each split into heads.
        qkv = self.qkv_proj(x)
        seq = qkv.shape[0]
        q, k, v = (third.view(seq, self.heads, self.head_dim) for third in qkv.chunk(3, dim=-1))
        if rope_table is None:
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            # q and k stay views into the projection output; the kernel normalises and rotates them there
            rms_norm_rope_(q[None], k[None], self.q_norm.weight, self.k_norm.weight, rope_table, self.q_norm.eps,
                           fuse=options.kernels.fused)
            if self.tracer is not None:
                self.tracer.record_tensor(self, "rope_q", q)
                self.tracer.record_tensor(self, "rope_k", k)
        # v stays a strided view of the projection output: backends that need it dense copy it (attention.py)
        q, k, v = (rearrange(t, "s h d -> 1 h s d") for t in (q, k, v))
        # sp: a `parallel.SequenceParallel` when x is this rank's slice of the sequence (all-to-all around attention)
        attend = attention if sp is None else sp.attention
        return self.out_proj(attend(q, k, v, options.attention)[0])


class MLP(nn.Module):
    """SwiGLU: fc1 -> [gate | up] -> silu(gate)·up -> fc2. `chunks` > 1 runs rows in slices (exact)."""

    CHUNK_ALIGN = 64

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = Linear(ffn, hidden, bias=False)

    def _swiglu(self, x: torch.Tensor, fuse: bool) -> torch.Tensor:
        return self._swiglu_taking([x], fuse)

    def _swiglu_taking(self, box: list, fuse: bool = True) -> torch.Tensor:
        # box: [x]; x is taken out of the list and released once fc1 has read it (when the caller keeps no other
        # reference). SwiGLU is written over the gate half of fc1's output, which fc2 reads as a strided view
        # (row stride 2F): no [S, F] buffer. Eager: silu_ then mul_ in place, the same two roundings as before.
        x = box.pop()
        a = self.fc1(x)
        del x
        if fused.enabled(a, whole_rows=False, on=fuse):  # SwiGLU tiles its columns: any width
            if a.shape[-1] // 2 <= fused.MAX_HIDDEN and takes_e4m3(self.fc2):  # FP8 fc2: its e4m3 input rows
                q = fused.swiglu_e4m3(a)
                del a  # fc1's output is not needed while fc2 runs
                return self.fc2(q)
            return self.fc2(fused.swiglu_(a))
        gate, up = a.chunk(2, dim=-1)
        return self.fc2(F.silu(gate, inplace=True).mul_(up))

    def forward_taking(self, box: list, *, chunks: int = 1, fuse: bool = True) -> torch.Tensor:
        """`forward` on box's one tensor, taken out of the list so that it is freed as soon as fc1 has read it
        (a module call keeps its arguments alive until it returns). With module hooks (the tracer) or chunks
        it is an ordinary call."""
        if chunks > 1 or self._forward_hooks or self._forward_pre_hooks or _global_hooks():
            return self(box.pop(), chunks=chunks, fuse=fuse)
        return self._swiglu_taking(box, fuse)

    def forward(self, x: torch.Tensor, *, chunks: int = 1, fuse: bool = True) -> torch.Tensor:
        # x: [S, hidden] -> [S, hidden]. Chunk boundaries fall on multiples of CHUNK_ALIGN rows and the last
        # chunk takes the remainder, so no GEMM runs on a sliver of rows (BLAS switches kernels for tiny M,
        # which would break bitwise equality with the unchunked product).
        s = x.shape[0]
        if chunks <= 1 or s < 2 * self.CHUNK_ALIGN:
            return self._swiglu(x, fuse)
        step = max(self.CHUNK_ALIGN, -(-s // chunks) // self.CHUNK_ALIGN * self.CHUNK_ALIGN)
        bounds = list(range(0, s, step))[:chunks] + [s]
        if bounds[-2] >= s - self.CHUNK_ALIGN // 2 and len(bounds) > 2:
            bounds.pop(-2)
        out = torch.empty(s, self.fc2.out_features, dtype=x.dtype, device=x.device)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            out[a:b] = self._swiglu(x[a:b], fuse)
        return out


class AdalnProj(nn.Module):
    """t_emb [M, k] -> `expand` tensors of [M·modalities, hidden]; row m·modalities + tag."""

    def __init__(self, t_dim: int, hidden: int, expand: int, modalities: int, curve: bool):
        super().__init__()
        self.expand, self.modalities, self.hidden, self.apply_silu = expand, modalities, hidden, not curve
        self.linear = Linear(t_dim, expand * hidden * modalities, bias=True, island=curve)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # t_emb: [M, t_dim]. The linear's features are laid out (modality, expand, hidden).
        feats = self.linear(F.silu(t_emb) if self.apply_silu else t_emb)
        table = rearrange(feats, "m (g e d) -> e (m g) d", g=self.modalities, e=self.expand)
        return tuple(table.unbind(0))


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

    def forward(self, x: torch.Tensor, *, options: Options = DEFAULT_OPTIONS) -> torch.Tensor:
        # x: [L, hidden] -> [L, hidden]; x ← sublayer(norm(x)) + x, the sum taken into the fresh output
        x = self.attn(self.norm1(x), options=options).add_(x)
        return self.mlp(self.norm2(x), fuse=options.kernels.fused).add_(x)


class TokenRefiner(nn.Module):
    def __init__(self, num_layers, hidden, heads, head_dim, ffn, eps, qk_eps, final_eps):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(hidden, heads, head_dim, ffn, eps, qk_eps)
                                    for _ in range(num_layers))
        self.final_norm = RMSNorm(hidden, final_eps)

    def forward(self, x: torch.Tensor, *, options: Options = DEFAULT_OPTIONS) -> torch.Tensor:
        # x: [L, hidden] text features -> refined [L, hidden]
        for block in self.blocks:
            x = block(x, options=options)
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
                options: Options = DEFAULT_OPTIONS, sp=None) -> torch.Tensor:
        # x: [S, hidden] (updated in place), t_emb: [n_t, k], rope_table: [1, S, 1, R, 2, 2]
        # (with sp, S is this rank's slice and runs / rope_table are cut to it: parallel.SequenceParallel.split)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaln_proj(t_emb)  # attention's, then MLP's
        fuse = fused.enabled(x, on=options.kernels.fused)  # Triton: norm+modulation, gated residual: one pass each
        # FP8 qkv_proj / fc1 (and no hooks): the kernels write their e4m3 input rows; fc1's not under row chunks
        qkv_e4m3 = fuse and takes_e4m3(self.attn.qkv_proj, self.attn)
        fc1_e4m3 = fuse and options.kernels.mlp_chunks <= 1 and takes_e4m3(self.mlp.fc1, self.mlp)
        h = _modulated(self.norm1, x, shift_a, scale_a, runs, fuse, e4m3=qkv_e4m3)
        attn_out = self.attn(h, rope_table, options=options, sp=sp)
        del h
        if fuse:  # attention's gated residual, then norm2 + the MLP's modulation, in one pass over x
            h = fused.residual_norm_modulate_(x, gate_a, attn_out, self.norm2.weight, self.norm2.eps, shift_m,
                                              scale_m, runs, e4m3=fc1_e4m3)
        else:
            x = gated_residual_(x, gate_a, attn_out, runs)
            h = _modulated(self.norm2, x, shift_m, scale_m, runs, fuse)
        del attn_out
        box = [h]  # the MLP frees it after fc1 (peak memory)
        del h
        mlp_out = self.mlp.forward_taking(box, chunks=options.kernels.mlp_chunks, fuse=options.kernels.fused)
        return _add_gated(x, gate_m, mlp_out, runs, fuse)


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def takes_e4m3(linear: nn.Module, *callers: nn.Module) -> bool:
    """`linear` can be handed its input as e4m3 rows (`w8a8.E4M3Rows`): an e4m3 FP8 linear, and no forward hook on it or
    on the modules the activation passes through on its way there (`callers`) that would want the tensor."""
    return (isinstance(linear, FP8Linear) and linear.fmt == "e4m3" and not _global_hooks()
            and not any(m._forward_hooks or m._forward_pre_hooks for m in (linear, *callers)))


def _modulated(norm: RMSNorm, x, shift, scale, runs: list[ModRun], fuse: bool, e4m3: bool = False):
    """norm(x)·(1 + scale[row]) + shift[row] (a fresh tensor; x is not changed). Fused: fp32 inside, one
    rounding (eager: three); rows outside every run get the plain norm either way. e4m3 (fused only): that
    tensor's e4m3 rows instead."""
    if fuse:
        return fused.norm_modulate(x, norm.weight, norm.eps, shift, scale, runs, e4m3=e4m3)
    return modulate_(norm(x), shift, scale, runs)


def _add_gated(x, gate, update, runs: list[ModRun], fuse: bool) -> torch.Tensor:
    """x + update·gate[row], in place on x. Fused: fp32 inside, one rounding (eager: two)."""
    if fuse:
        return fused.gated_residual_(x, gate, update, runs)
    return gated_residual_(x, gate, update, runs)


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
        # x: [S, hidden]; each target is (start, stop, time-embedding row) -> fp32 [rows, video_dim / audio_dim]
        # y = head(norm(x) ⊙ (1 + scale_r) + shift_r), the head in fp32
        shift, scale = self.adaln_proj(t_emb)
        outs = []
        for (lo, hi, r), head in ((video_seg, self.video_out), (audio_seg, self.audio_out)):
            y = self.norm(x[lo:hi]).mul(1.0 + scale[r]).add(shift[r])
            outs.append(head(y.float()))
        return outs[0], outs[1]
