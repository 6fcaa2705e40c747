"""The Qwen3-VL-32B text encoder of H3 (50 layers, vision tower) as ComfyUI runs it.

Facts (ComfyUI `text_encoders/{minimax,qwen3vl,llama,qwen_vl}.py`, `sd1_clip.py`, `ops.py`, `sd.py`):

Encoding: token embeddings in fp32 (the table cast from its stored dtype); each vision entry is replaced
by the vision tower's merged embeddings ((H'/32)·(W'/32) positions, `qwen_vision`). With vision present,
positions are 3-axis MRoPE ids: text advances one position per token (all axes equal); a vision block
of mh×mw tokens starting at position p gets (p, p + row, p + col) and the text after it resumes at
p + max(mh, mw). Rotary: theta 5e6, head_dim 128, interleaved MRoPE — the T frequencies, with H on the
indices 1, 4, 7… < 3·20 and W on 2, 5, 8… < 3·20 (sections 24/20/20). Decoder: Qwen3 (RMSNorm eps 1e-6,
q/k RMSNorm per head, GQA 64/8, causal, SwiGLU). DeepStack: after decoder layer k (k < 3) the k-th
DeepStack feature of every vision entry is added at its positions. The conditioning is the output of
the last layer (50), unnormalized; the checkpoint has no final norm.
Arithmetic: ComfyUI calls the model with fp32 embeddings and its ops cast each weight to the input's
dtype per call, so everything computes in fp32 while weights stay stored as in the file (bf16) — here too.

Without a vision tower (the bundled tiny encoder), vision positions get the pad token's embedding and
1-D positions — an approximation, not ComfyUI's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import einops
import torch
import torch.nn.functional as F
from torch import nn

from h3direct.errors import H3Error
from h3direct.text.presentation import PAD_ID, VISION_PAD, Presentation, TextConditioning
from h3direct.text.vision import VISION_PRESETS, Linear, QwenVisionTower, VisionConfig, rotate


@dataclass(frozen=True)
class TextEncoderConfig:
    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 25600
    num_hidden_layers: int = 50
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    mrope_section: tuple = (24, 20, 20)
    vision: VisionConfig | None = field(default_factory=VisionConfig)

    def __post_init__(self):
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} heads are not a multiple of {self.num_key_value_heads} kv heads")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision out_hidden_size {self.vision.out_hidden_size} != hidden_size {self.hidden_size}")


_TINY = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, mrope_section=(4, 4, 4))
PRESETS = {
    "qwen3vl_32b": TextEncoderConfig(),
    "tiny": TextEncoderConfig(**_TINY, vision=None),  # the bundled encoder (hidden 96 = tiny DiT text_dim)
    "tiny_vision": TextEncoderConfig(**_TINY, vision=VISION_PRESETS["tiny"]),
}


def mrope_positions(length: int, blocks: Sequence) -> torch.Tensor:
    """[3, length] float positions; `blocks` = (start, mh, mw) of each vision block, in order."""
    pos = torch.empty(3, length)
    p, i = 0, 0
    for start, mh, mw in blocks:
        pos[:, i:start] = torch.arange(p, p + start - i)
        p += start - i
        pos[0, start : start + mh * mw] = p
        pos[1, start : start + mh * mw] = (p + torch.arange(mh)).repeat_interleave(mw)
        pos[2, start : start + mh * mw] = (p + torch.arange(mw)).repeat(mh)
        p, i = p + max(mh, mw), start + mh * mw
    pos[:, i:] = torch.arange(p, p + length - i)
    return pos


# ---- language model ---------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


def rope_cos_sin(cfg: TextEncoderConfig, positions: torch.Tensor) -> tuple:
    """positions [1 or 3, L] → cos, sin [L, head_dim] fp32 (interleaved MRoPE for 3 axes)."""
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=positions.device).float() / cfg.head_dim))
    freqs = positions.float()[..., None] * inv  # [A, L, half]
    f = freqs[0].clone()
    if positions.shape[0] == 3:
        for axis in (1, 2):
            sl = slice(axis, 3 * cfg.mrope_section[axis], 3)
            f[:, sl] = freqs[axis][:, sl]
    assert f.shape[-1] == half
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.cfg = cfg
        inner, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, inner, bias=False)
        self.k_proj = Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = Linear(inner, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [1, L, D] → [1, L, D]
        c = self.cfg
        q = einops.rearrange(self.q_proj(x), "b l (h d) -> b h l d", d=c.head_dim)
        k = einops.rearrange(self.k_proj(x), "b l (h d) -> b h l d", d=c.head_dim)
        v = einops.rearrange(self.v_proj(x), "b l (h d) -> b h l d", d=c.head_dim)
        q, k = rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(einops.rearrange(out, "b h l d -> b l (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenLM(nn.Module):
    """`model.*` of the checkpoint: token embedding + decoder layers (no final norm)."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, deepstack: Sequence = (),
                vision_mask: torch.Tensor | None = None) -> torch.Tensor:
        # x [1, L, D] (compute dtype), positions [1|3, L] → last layer's states [1, L, D]
        cos, sin = rope_cos_sin(self.config, positions.to(x.device))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype))
            if i < len(deepstack):
                x[:, vision_mask] = x[:, vision_mask] + deepstack[i].to(x.dtype)
        return x


class QwenVL(nn.Module):
    """The checkpoint's module tree: `model` (LM) and `visual` (vision tower, optional)."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.model = QwenLM(cfg)
        self.visual = None if cfg.vision is None else QwenVisionTower(cfg.vision)


class QwenTextEncoder:
    """Encode a Presentation to the last layer's unnormalized states (compute in `compute_dtype`)."""

    def __init__(self, net: QwenVL, compute_dtype: torch.dtype = torch.float32):
        self.net = net.eval()
        self.model, self.visual = net.model, net.visual
        self.config = net.model.config
        self.compute_dtype = compute_dtype

    def to(self, device) -> QwenTextEncoder:
        self.net.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.no_grad()
    def encode(self, pres: Presentation) -> TextConditioning:
        dev, dt = self.device, self.compute_dtype
        ids = torch.tensor([PAD_ID if t == VISION_PAD else t for t in pres.token_ids], dtype=torch.long, device=dev)
        x = self.model.embed_tokens(ids)[None].to(dt)
        length = ids.shape[0]
        if self.visual is None or not pres.vision:
            positions = torch.arange(length, dtype=torch.float32)[None]
            states = self.model(x, positions)
        else:
            blocks, feats = [], []
            mask = torch.zeros(length, dtype=torch.bool, device=dev)
            for e in pres.vision:
                out = self.visual.encode_frames(e.frames)
                if out.merged.shape[0] != e.count:
                    raise H3Error(f"vision entry at {e.start}: tower made {out.merged.shape[0]} tokens, expected {e.count}")
                x[0, e.start : e.start + e.count] = out.merged.to(dt)
                mask[e.start : e.start + e.count] = True
                _, gh, gw = out.grid
                m = self.visual.cfg.spatial_merge_size
                blocks.append((e.start, gh // m, gw // m))
                feats.append(out.deepstack)
            deepstack = [torch.cat([f[k] for f in feats]) for k in range(len(feats[0]))]
            states = self.model(x, mrope_positions(length, blocks), deepstack, mask)
        return TextConditioning(states.float(), pres.tags.clone())


# ---- construction ------------------------------------------------------------------------------

def tiny_config(vision: bool = False) -> TextEncoderConfig:
    return PRESETS["tiny_vision" if vision else "tiny"]


def make_tiny_text_encoder(seed: int = 0, vision: bool = False, config: TextEncoderConfig | None = None) -> QwenTextEncoder:
    """A random tiny Qwen3-VL encoder (2 layers, hidden 96 = the tiny DiT's text_dim), fp32, from `seed`."""
    cfg = config or tiny_config(vision)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        net = QwenVL(cfg)
    net = net.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in sorted(net.named_parameters()):
            if "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("pos_embed.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return QwenTextEncoder(net)


def comfy_state_dict(enc: QwenTextEncoder) -> dict:
    """The encoder's weights under ComfyUI's file keys (`model.*`, `visual.*`)."""
    return {k: v.detach().contiguous() for k, v in enc.net.state_dict().items()}
