"""Qwen3-VL vision tower of H3's text encoder (checkpoint keys `visual.*`) and its pixel preprocessing.

Facts (ComfyUI `text_encoders/{qwen3vl,qwen35,qwen_vl,minimax}.py`, snapshot 0f1fa67a):

- Preprocessing: frames [T, H, W, 3] in [0, 1] are resized (bilinear, align_corners False) to H'×W', each a
  multiple of 32 (round, then kept within [3136, 12845056] px), normalized with mean = std = 0.5, and cut
  into 2×16×16 patches in merge-block order (2×2 neighbouring patches adjacent). An image fills the temporal
  patch by repeating its frame; a video block holds 2 frames. grid = (1, H'/16, W'/16).
- Tower: Conv3d patch embed (+bias) → + learned position table (48×48) bilinearly resampled to the grid in
  the table's dtype → `depth` pre-LN blocks (LayerNorm eps 1e-6; attention with 2-D rotary on (row, col)
  halves, theta 10000; MLP with tanh GELU) → merger (LayerNorm, 2×2 concat, fc1, exact GELU, fc2 → LM width).
  After block i in `deepstack_visual_indexes` a DeepStack merger (concat 2×2 first, then LayerNorm) makes a
  feature that the LM adds to the vision positions after its decoder layer k (k-th index).
- Arithmetic: ComfyUI feeds the patches in fp32 and its ops cast every weight to the input's dtype, so the
  tower computes in fp32 whatever the stored dtype; only the position-table interpolation runs in the
  stored dtype (its embedding lookup returns the table's dtype).

`Linear` here is the one linear of the whole text encoder: a dense weight (any stored float dtype) or an
NVFP4 weight (ComfyUI mixed-precision layout), decoded to the input's dtype on every call, with ModelOpt AWQ
`pre_quant_scale` applied to the input first — what ComfyUI's `MixedPrecisionOps.Linear` does for text
encoders (they always run with `full_precision_mm`, so `input_scale` is stored but never used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import torch
import torch.nn.functional as F
from torch import nn

from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4

PATCH, MERGE, TEMPORAL = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5
LN_EPS = 1e-6
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    depth: int = 27
    num_heads: int = 16
    deepstack_visual_indexes: tuple = (8, 16, 24)
    out_hidden_size: int = 5120
    num_position_embeddings: int = 2304
    patch_size: int = PATCH
    temporal_patch_size: int = TEMPORAL
    spatial_merge_size: int = MERGE
    in_channels: int = 3

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} "
                             "must be a multiple of 4")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside depth {self.depth}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


VISION_PRESETS = {
    "qwen3vl_32b": VisionConfig(),
    "tiny": VisionConfig(hidden_size=32, intermediate_size=64, depth=3, num_heads=2, deepstack_visual_indexes=(0, 2),
                         out_hidden_size=96),
}


# ---- preprocessing --------------------------------------------------------------------------------

def qwen_resize(height: int, width: int) -> tuple:
    """(H', W') Qwen resizes a height×width frame to: multiples of 32 within [3136, 12845056] pixels."""
    f = PATCH * MERGE
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def merged_tokens(height: int, width: int) -> int:
    """LM positions of one vision entry (image or 2-frame block) of size height×width."""
    h, w = qwen_resize(height, width)
    return (h // (PATCH * MERGE)) * (w // (PATCH * MERGE))


def patchify(frames: torch.Tensor) -> tuple:
    """frames [1 or 2, H, W, 3] in [0, 1] → (patches [gh·gw, 3·2·16·16] fp32, grid (1, gh, gw)).

    One frame (an image) is repeated to fill the temporal patch; two frames are a video block."""
    t, height, width, _ = frames.shape
    if t not in (1, 2):
        raise ValueError(f"a vision entry has 1 (image) or 2 (video block) frames, got {t}")
    h, w = qwen_resize(height, width)
    x = F.interpolate(frames.float().permute(0, 3, 1, 2), size=(h, w), mode="bilinear", align_corners=False)
    x = (x - PIXEL_MEAN) / PIXEL_STD
    if t == 1:
        x = x.expand(TEMPORAL, -1, -1, -1)
    gh, gw = h // PATCH, w // PATCH
    patches = einops.rearrange(x, "t c (bh mh ph) (bw mw pw) -> (bh bw mh mw) (c t ph pw)",
                               mh=MERGE, mw=MERGE, ph=PATCH, pw=PATCH)
    return patches.contiguous(), (1, gh, gw)


# ---- layers ---------------------------------------------------------------------------------------

class Linear(nn.Module):
    """y = (x · pre_quant_scale) Wᵀ + b in x's dtype; W dense (stored dtype) or NVFP4 (decoded per call)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_format: str | None = None
        self.weight_scale = self.weight_scale_2 = self.pre_quant_scale = self.input_scale = None

    def to_nvfp4(self, stored: dict) -> None:
        """Switch to the NVFP4 layout; `stored` = {suffix: tensor} of the file (`weight` uint8 packed,
        `weight_scale` e4m3, `weight_scale_2` fp32, optional `pre_quant_scale`, `input_scale`): meta
        placeholders of the same shapes and dtypes are made, the loader assigns the tensors."""
        self.quant_format = "nvfp4"
        for name, t in stored.items():
            setattr(self, name, nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"), requires_grad=False))

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quant_format == "nvfp4":
            return dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, dtype,
                                    shape=(self.out_features, self.in_features))
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] → [..., out], x.dtype
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dense_weight(x.dtype), b)


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose stored weights are cast to the input's dtype (ComfyUI manual_cast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the two halves of the last axis: (x1, x2) → (x1·c − x2·s, x2·c + x1·s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.cfg = cfg
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # [N, 3·2·16·16] → [N, hidden], patches' dtype
        c = self.cfg
        x = patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        w, b = self.proj.weight.to(x.dtype), self.proj.bias.to(x.dtype)
        return F.conv3d(x, w, b, stride=self.proj.stride).view(-1, c.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [N, D], cos/sin [N, head_dim] → [N, D]  (one vision entry = one attention sequence)
        q, k, v = einops.rearrange(self.qkv(x), "n (three h d) -> three h n d", three=3, h=self.heads)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        return self.proj(einops.rearrange(out, "h n d -> n (h d)"))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, eps=LN_EPS)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=LN_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """2×2 patch merge to the LM width; the main merger normalizes before the merge, DeepStack's after."""

    def __init__(self, cfg: VisionConfig, norm_after_merge: bool):
        super().__init__()
        self.merge_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm_after_merge = norm_after_merge
        self.norm = LayerNorm(self.merge_dim if norm_after_merge else cfg.hidden_size, eps=LN_EPS)
        self.linear_fc1 = Linear(self.merge_dim, self.merge_dim)
        self.linear_fc2 = Linear(self.merge_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, hidden] → [N/4, out_hidden]
        if self.norm_after_merge:
            x = self.norm(x.reshape(-1, self.merge_dim))
        else:
            x = self.norm(x).reshape(-1, self.merge_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass
class VisionOut:
    merged: torch.Tensor  # [n, out_hidden]: the LM embeddings of the entry's positions
    deepstack: list  # len(deepstack_visual_indexes) × [n, out_hidden]
    grid: tuple  # (t, gh, gw) in patches


class QwenVisionTower(nn.Module):
    """`visual.*` of the checkpoint."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, norm_after_merge=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def position_table(self, gh: int, gw: int) -> torch.Tensor:
        """Learned positions bilinearly resampled to gh×gw, in merge-block order: [gh·gw, hidden], table dtype."""
        g, table = self.cfg.grid_side, self.pos_embed.weight
        dev = table.device
        hs, ws = torch.linspace(0, g - 1, gh, device=dev), torch.linspace(0, g - 1, gw, device=dev)
        h0, w0 = hs.int(), ws.int()
        h1, w1 = (h0 + 1).clamp(max=g - 1), (w0 + 1).clamp(max=g - 1)
        dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
        corners = ((h0[:, None], w0[None], (1 - dh) * (1 - dw)), (h0[:, None], w1[None], (1 - dh) * dw),
                   (h1[:, None], w0[None], dh * (1 - dw)), (h1[:, None], w1[None], dh * dw))
        out = None
        for hi, wi, wt in corners:  # weights rounded to the table's dtype, sum in that dtype (as ComfyUI)
            term = table[(hi * g + wi).reshape(-1)] * wt.reshape(-1, 1).to(table.dtype)
            out = term if out is None else out + term
        m = self.cfg.spatial_merge_size
        return einops.rearrange(out, "(bh mh bw mw) d -> (bh bw mh mw) d", bh=gh // m, mh=m, bw=gw // m, mw=m)

    def rotary(self, gh: int, gw: int, device) -> tuple:
        """cos, sin [gh·gw, head_dim] of the (row, col) patch coordinates in merge-block order (fp32)."""
        rot = self.cfg.head_dim // 2  # each of row / col rotates head_dim/4 frequency pairs
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, rot, 2, dtype=torch.float, device=device) / rot))
        m = self.cfg.spatial_merge_size
        rows = torch.arange(gh, device=device)[:, None].expand(gh, gw)
        cols = torch.arange(gw, device=device)[None, :].expand(gh, gw)
        order = "(bh mh) (bw mw) -> (bh bw mh mw)"
        rows, cols = (einops.rearrange(a, order, mh=m, mw=m) for a in (rows, cols))
        table = torch.outer(torch.arange(max(gh, gw), device=device, dtype=torch.float), inv)
        freqs = torch.cat((table[rows], table[cols]), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None], emb.sin()[None]

    def forward(self, patches: torch.Tensor, grid: tuple) -> VisionOut:
        # patches [gh·gw, 1536] fp32 → VisionOut(merged [gh·gw/4, out], deepstack, grid)
        t, gh, gw = grid
        if t != 1:
            raise ValueError(f"one vision entry per call (grid t = 1), got t = {t}")
        x = self.patch_embed(patches)
        x = x + self.position_table(gh, gw).to(x.device)
        cos, sin = self.rotary(gh, gw, x.device)
        feats = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin)
            if i in self.cfg.deepstack_visual_indexes:
                feats.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return VisionOut(self.merger(x), feats, grid)

    def encode_frames(self, frames: torch.Tensor) -> VisionOut:
        """frames [1 or 2, H, W, 3] in [0, 1] → VisionOut (fp32 compute, as ComfyUI)."""
        patches, grid = patchify(frames.to(self.pos_embed.weight.device))
        return self(patches, grid)
