"""H3 text conditioning: the Qwen3-VL-32B encoder (50 layers, vision tower) as ComfyUI runs it, + token tags.

Facts (ComfyUI `text_encoders/{minimax,qwen3vl,llama,qwen_vl}.py`, `sd1_clip.py`, `ops.py`, `sd.py`):

Presentation: no chat template; raw text ids (no special tokens) with vision blocks spliced in, in order:
  image → "<Picture i>: " <vision_start> vision <vision_end>
  audio → "<Audio j>: "                           (audio never enters Qwen)
  video → "<Video k>: " then per 2-frame block "<T.T seconds>" <vision_start> vision <vision_end>
          (odd frame counts repeat the last frame and timestamp; T.T = mean of the pair)
then the prompt. An empty sequence is the single pad id 151643. Tags: 1 = text, 0 = the whole vision
block including its start/end tokens.

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

Files: ComfyUI-format safetensors, keys `model.*` (LM) and `visual.*` (vision tower), optionally under
`text_encoders.qwen3vl_32b.transformer.`; LM keys without `model.` are accepted (older h3direct files).
Quantized layers use ComfyUI's mixed-precision layout (`<layer>.comfy_quant` JSON); NVFP4 is supported
(with AWQ `pre_quant_scale`; decoded per call, see `qwen_vision.Linear`). `model.norm.weight` and
`lm_head.weight` are ignored (ComfyUI builds this encoder without them and loads non-strictly).

Without a vision tower (the bundled tiny encoder), vision positions get the pad token's embedding and
1-D positions — an approximation, not ComfyUI's result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import einops
import torch
import torch.nn.functional as F
from torch import nn

from h3direct.errors import CheckpointError, H3Error
from h3direct.text.vision import VISION_PRESETS, Linear, QwenVisionTower, VisionConfig, merged_tokens

PAD_ID = 151643
VISION_START = 151652
VISION_END = 151653
VISION_PAD = -1  # placeholder id in `token_ids` for a vision position
FILE_PREFIXES = ("text_encoders.qwen3vl_32b.transformer.", "qwen3vl_32b.transformer.", "transformer.")
_QUANT_SIDE = ("weight_scale_2", "pre_quant_scale", "input_scale")  # kept as stored whatever `dtype` says
IGNORED_KEYS = ("model.norm.weight", "lm_head.weight", "model.lm_head.weight")

Tokenize = Callable[[str], list]


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


@dataclass
class TextConditioning:
    states: torch.Tensor  # [1, L, D] float32
    tags: torch.Tensor  # [L] int64, 1 text / 0 vision


@dataclass
class VisionEntry:
    frames: torch.Tensor  # [1, H, W, 3] image or [2, H, W, 3] video block, in [0, 1]
    start: int  # index of its first position in token_ids
    count: int  # merged positions


@dataclass
class Presentation:
    token_ids: list  # ints; VISION_PAD (−1) at vision positions
    tags: torch.Tensor  # [L] int64
    vision: list = field(default_factory=list)  # VisionEntry, in sequence order


def vision_pad_count(height: int, width: int) -> int:
    """Merged Qwen vision tokens of one frame (or 2-frame block) of size height×width."""
    return merged_tokens(height, width)


def build_presentation(prompt: str, items: Sequence, tokenize: Tokenize) -> Presentation:
    """Token ids and tags for `items` (conditioning.PresentationItem list) then the prompt."""
    ids: list = []
    tags: list = []
    vision: list = []

    def text(s: str) -> None:
        t = list(tokenize(s))
        ids.extend(t)
        tags.extend([1] * len(t))

    def add_vision(frames: torch.Tensor) -> None:
        n = vision_pad_count(frames.shape[1], frames.shape[2])
        vision.append(VisionEntry(frames, len(ids) + 1, n))
        ids.extend([VISION_START] + [VISION_PAD] * n + [VISION_END])
        tags.extend([0] * (n + 2))

    count = {"image": 0, "audio": 0, "video": 0}
    for it in items:
        if it.kind not in count:
            raise H3Error(f"presentation item kind {it.kind!r}: use image, audio or video")
        count[it.kind] += 1
        if it.kind == "image":
            text(f"<Picture {count['image']}>: ")
            add_vision(it.frames[:1])
        elif it.kind == "audio":
            text(f"<Audio {count['audio']}>: ")
        else:
            frames, stamps = it.frames, list(it.timestamps or [i / 2.0 for i in range(it.frames.shape[0])])
            if frames.shape[0] % 2:
                frames = torch.cat([frames, frames[-1:]])
                stamps.append(stamps[-1])
            text(f"<Video {count['video']}>: ")
            for i in range(0, frames.shape[0], 2):
                text("<%.1f seconds>" % ((stamps[i] + stamps[i + 1]) / 2.0))
                add_vision(frames[i : i + 2])
    text(prompt)
    if not ids:
        ids, tags = [PAD_ID], [1]
    return Presentation(ids, torch.tensor(tags, dtype=torch.long), vision)


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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
        q, k = _rotate(self.q_norm(q), cos, sin), _rotate(self.k_norm(k), cos, sin)
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


# ---- construction and loading -------------------------------------------------------------------

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


def _normalize_keys(sd: dict, path) -> dict:
    out = {}
    for k, v in sd.items():
        for pre in FILE_PREFIXES:
            if k.startswith(pre):
                k = k[len(pre) :]
                break
        if not k.startswith(("model.", "visual.", "lm_head.")):
            k = "model." + k  # text-only files keyed like HF's Qwen3VLTextModel
        if k in out:
            raise CheckpointError(f"text-encoder key {k} appears twice (with and without a prefix)", path=path)
        out[k] = v
    return out


def _quant_layers(sd: dict, path) -> dict:
    """{layer prefix: format} of every `<layer>.comfy_quant` marker (removed from `sd`)."""
    from h3direct.checkpoint.quant import MARKER, state_dict_markers

    layers = {}
    for layer, conf in state_dict_markers(sd, path).items():
        del sd[f"{layer}.{MARKER}"]
        fmt = conf["format"]
        if fmt != "nvfp4":
            raise CheckpointError(f"{layer}: quantization format {fmt!r} is not supported for the text encoder "
                                  "(nvfp4 or unquantized)", path=path)
        layers[layer] = fmt
    return layers


def _prepare_nvfp4(net: QwenVL, sd: dict, layers: dict, path) -> None:
    from h3direct.checkpoint.quant import FORMATS
    from h3direct.checkpoint.quant.nvfp4 import storage_shapes

    fmt = FORMATS["nvfp4"]
    modules = dict(net.named_modules())
    for layer in layers:
        mod = modules.get(layer)
        if not isinstance(mod, Linear):
            raise CheckpointError(f"{layer}.comfy_quant marks a layer that is not a linear of Qwen3-VL", path=path)
        for suffix in ("weight", *fmt.required):
            if f"{layer}.{suffix}" not in sd:
                raise CheckpointError(f"{layer}: NVFP4 layer lacks {suffix}", path=path)
        want = storage_shapes((mod.out_features, mod.in_features))
        for suffix, shape in want.items():
            t = sd[f"{layer}.{suffix}"]
            if suffix == "weight_scale_2":
                ok = t.numel() == 1
            else:
                ok = tuple(t.shape) == shape
            if not ok:
                raise CheckpointError(f"{layer}.{suffix}: shape {list(t.shape)}, NVFP4 [{mod.out_features}, "
                                      f"{mod.in_features}] stores {list(shape)}", path=path)
        if sd[f"{layer}.weight"].dtype != torch.uint8:
            raise CheckpointError(f"{layer}.weight: dtype {sd[f'{layer}.weight'].dtype}, NVFP4 packs uint8", path=path)
        sd[f"{layer}.weight_scale"] = sd[f"{layer}.weight_scale"].view(torch.float8_e4m3fn)
        sd[f"{layer}.weight_scale_2"] = sd[f"{layer}.weight_scale_2"].float().reshape(())
        mod.to_nvfp4({s: sd[f"{layer}.{s}"] for s in ("weight", *fmt.required, *fmt.optional) if f"{layer}.{s}" in sd})


def config_from_weights(sd: dict, path=None) -> TextEncoderConfig:
    """The encoder's shape read from (normalized) file keys; the vision tower must match a preset."""
    try:
        vocab, hidden = sd["model.embed_tokens.weight"].shape
        layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
        head_dim = sd["model.layers.0.self_attn.q_norm.weight"].shape[0]
        heads = _rows(sd, "model.layers.0.self_attn.q_proj") // head_dim
        kv = _rows(sd, "model.layers.0.self_attn.k_proj") // head_dim
        inter = _rows(sd, "model.layers.0.mlp.gate_proj")
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"not a Qwen3-VL text encoder (missing {e})", path=path) from None
    sections = (24, 20, 20) if head_dim == 128 else (head_dim // 6,) * 3
    vision = None
    if "visual.patch_embed.proj.weight" in sd:
        shape = dict(hidden_size=sd["visual.patch_embed.proj.weight"].shape[0],
                     depth=1 + max(int(k.split(".")[2]) for k in sd if k.startswith("visual.blocks.")),
                     deepstack=len({k.split(".")[2] for k in sd if k.startswith("visual.deepstack_merger_list.")}),
                     out_hidden_size=_rows(sd, "visual.merger.linear_fc2"))
        for v in VISION_PRESETS.values():
            if shape == dict(hidden_size=v.hidden_size, depth=v.depth, deepstack=len(v.deepstack_visual_indexes),
                             out_hidden_size=v.out_hidden_size):
                vision = replace(v, num_position_embeddings=sd["visual.pos_embed.weight"].shape[0])
                break
        else:
            raise CheckpointError(f"vision tower {shape} matches no known Qwen3-VL vision config", path=path)
    return TextEncoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                             mrope_section=sections, vision=vision)


def _rows(sd: dict, layer: str) -> int:
    """Output features of a linear (NVFP4 stores them rounded up to 16; Qwen3-VL's are multiples of 16)."""
    return sd[f"{layer}.weight"].shape[0]


def load_text_encoder(path, config: TextEncoderConfig | None = None, dtype: torch.dtype | None = None,
                      compute_dtype: torch.dtype = torch.float32) -> QwenTextEncoder:
    """Load a ComfyUI-format Qwen3-VL text-encoder safetensors (bf16/fp16/fp32 weights, NVFP4 layers).

    `dtype`: the dtype floating weights are held in; default: as stored (a 32B bf16 file stays bf16).
    `compute_dtype`: what the forward runs in (ComfyUI: fp32)."""
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise CheckpointError("text-encoder file not found", path=p)
    try:
        sd = _normalize_keys(load_file(str(p)), p)
    except SafetensorError as e:
        raise CheckpointError(f"not a readable safetensors file ({e})", path=p) from None
    for k in IGNORED_KEYS:
        sd.pop(k, None)
    quant = _quant_layers(sd, p)
    if config is None:
        config = config_from_weights(sd, p)
    with torch.device("meta"):
        net = QwenVL(config)
    _prepare_nvfp4(net, sd, quant, p)
    expected = net.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"text-encoder keys do not match Qwen3-VL ({len(missing)} missing, e.g. {missing[:3]}; "
                              f"{len(unexpected)} unexpected, e.g. {unexpected[:3]})", path=p)
    for k, t in expected.items():
        if t.numel() and tuple(t.shape) != tuple(sd[k].shape):
            raise CheckpointError(f"{k}: shape {list(sd[k].shape)}, the config expects {list(t.shape)}", path=p)
        if dtype is not None and sd[k].is_floating_point() and sd[k].element_size() > 1 and not k.endswith(_QUANT_SIDE):
            sd[k] = sd[k].to(dtype)
    net.load_state_dict(sd, assign=True)
    for mod in net.modules():
        if isinstance(mod, Linear):
            mod.weight.requires_grad_(False)
    return QwenTextEncoder(net, compute_dtype)


def load_text_embeds(path) -> TextConditioning:
    """`--text-embeds FILE`: safetensors with `text_states` [1,L,D] (or [L,D]) and `token_tags` [L]."""
    from pathlib import Path

    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise H3Error("text-embeds file not found", path=p)
    sd = load_file(str(p))
    for k in ("text_states", "token_tags"):
        if k not in sd:
            raise H3Error(f"text-embeds file lacks `{k}` (needs text_states [1,L,D] and token_tags [L])", path=p)
    states, tags = sd["text_states"].float(), sd["token_tags"].long().reshape(-1)
    if states.ndim == 2:
        states = states[None]
    if states.ndim != 3 or states.shape[1] != tags.shape[0]:
        raise H3Error(f"text_states {tuple(states.shape)} and token_tags {tuple(tags.shape)} disagree on length", path=p)
    return TextConditioning(states, tags)
