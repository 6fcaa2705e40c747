"""H3 text conditioning: Qwen3-VL (transformers) hidden states after the last kept layer + token tags.

Facts (ComfyUI `text_encoders/minimax.py`): no chat template; the token sequence is raw text ids
(no special tokens) with vision blocks spliced in, in presentation order:
  image → "<Picture i>: " <vision_start> pads <vision_end>
  audio → "<Audio j>: "                        (audio never enters Qwen)
  video → "<Video k>: " then per 2-frame block "<T.T seconds>" <vision_start> pads <vision_end>
          (odd frame counts repeat the last frame and timestamp; T.T = mean of the pair)
then the prompt. An empty sequence is the single pad id 151643. Tags: 1 = text, 0 = the whole
vision block including its start/end tokens. The states are the *unnormalized* output of the
last layer (the H3 checkpoint is truncated to 50 layers; no final norm).

Vision entries here are pads: each expands to (H'/32)·(W'/32) positions, H', W' = Qwen's
resize of the frame (rounded to 32 within [3136, 12845056] px), embedded with the pad token's
embedding. The Qwen3-VL vision tower is not implemented (use `--text-embeds` for exact Ref2VA
conditioning with references).

ComfyUI-format files: keys `text_encoders.qwen3vl_32b.transformer.model.<hf name>` (prefix
optional); `visual.*` keys are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3direct.errors import CheckpointError, H3Error

PAD_ID = 151643
VISION_START = 151652
VISION_END = 151653
VISION_PAD = -1  # placeholder id in `token_ids` for a vision position
QWEN_PATCH, QWEN_MERGE = 16, 2
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
KEY_PREFIXES = ("text_encoders.qwen3vl_32b.transformer.model.", "qwen3vl_32b.transformer.model.", "model.", "")

Tokenize = Callable[[str], list]


@dataclass
class TextConditioning:
    states: torch.Tensor  # [1, L, D] float32
    tags: torch.Tensor  # [L] int64, 1 text / 0 vision


@dataclass
class Presentation:
    token_ids: list  # ints; VISION_PAD (−1) at vision positions
    tags: torch.Tensor  # [L] int64


def vision_pad_count(height: int, width: int) -> int:
    """Merged Qwen vision tokens of one frame (or 2-frame block) of size height×width."""
    f = QWEN_PATCH * QWEN_MERGE
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return (h // f) * (w // f)


def build_presentation(prompt: str, items: Sequence, tokenize: Tokenize) -> Presentation:
    """Token ids and tags for `items` (conditioning.PresentationItem list) then the prompt."""
    ids: list = []
    tags: list = []

    def text(s: str) -> None:
        t = list(tokenize(s))
        ids.extend(t)
        tags.extend([1] * len(t))

    def vision(frames: torch.Tensor) -> None:
        n = vision_pad_count(frames.shape[1], frames.shape[2])
        ids.extend([VISION_START] + [VISION_PAD] * n + [VISION_END])
        tags.extend([0] * (n + 2))

    count = {"image": 0, "audio": 0, "video": 0}
    for it in items:
        count[it.kind] += 1
        if it.kind == "image":
            text(f"<Picture {count['image']}>: ")
            vision(it.frames)
        elif it.kind == "audio":
            text(f"<Audio {count['audio']}>: ")
        elif it.kind == "video":
            frames, stamps = it.frames, list(it.timestamps or [i / 2.0 for i in range(it.frames.shape[0])])
            if frames.shape[0] % 2:
                frames = torch.cat([frames, frames[-1:]])
                stamps.append(stamps[-1])
            text(f"<Video {count['video']}>: ")
            for i in range(0, frames.shape[0], 2):
                text("<%.1f seconds>" % ((stamps[i] + stamps[i + 1]) / 2.0))
                vision(frames[i : i + 2])
        else:
            raise H3Error(f"presentation item kind {it.kind!r}: use image, audio or video")
    text(prompt)
    if not ids:
        ids, tags = [PAD_ID], [1]
    return Presentation(ids, torch.tensor(tags, dtype=torch.long))


class QwenTextEncoder:
    """Qwen3-VL language model (transformers) returning the last layer's unnormalized states."""

    def __init__(self, model):
        self.model = model.eval()
        self._grab = None
        self.model.layers[-1].register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self._grab = out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def encode(self, pres: Presentation) -> TextConditioning:
        ids = torch.tensor([PAD_ID if t == VISION_PAD else t for t in pres.token_ids], dtype=torch.long)[None]
        self.model(input_ids=ids)
        return TextConditioning(self._grab.float(), pres.tags.clone())


def tiny_config(vocab_size: int = 151936):
    from transformers import Qwen3VLTextConfig

    return Qwen3VLTextConfig(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [4, 4, 4], "mrope_interleaved": True})


def make_tiny_text_encoder(seed: int = 0) -> QwenTextEncoder:
    """A random tiny Qwen3-VL text model (2 layers, hidden 96 = the tiny DiT's text_dim), fp32."""
    from transformers import Qwen3VLTextModel

    with torch.random.fork_rng(devices=[]):  # transformers' init draws from the global RNG
        model = Qwen3VLTextModel(tiny_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return QwenTextEncoder(model)


def _strip(key: str):
    for pre in KEY_PREFIXES[:-1]:
        if key.startswith(pre):
            return key[len(pre) :]
    return key


def load_text_encoder(path, config=None, dtype: torch.dtype | None = None) -> QwenTextEncoder:
    """Load a ComfyUI-format Qwen3-VL text-encoder safetensors (bf16/fp16/fp32 weights).

    `dtype`: the dtype weights are held and run in; default: as stored (a 32B bf16 file stays bf16 —
    upcasting it would need ~128 GB)."""
    from safetensors.torch import load_file
    from transformers import Qwen3VLTextModel

    sd = load_file(str(path))
    weights = {}
    for k, v in sd.items():
        if ".visual." in k or k.startswith("visual.") or k.endswith(".comfy_quant") or "weight_scale" in k:
            if k.endswith(".comfy_quant") or "weight_scale" in k:
                raise CheckpointError(f"quantized text-encoder weights ({k}) are not supported yet; use a bf16 file or --text-embeds", path=path)
            continue
        weights[_strip(k)] = v
    if config is None:
        config = _config_from_weights(weights, path)
    with torch.device("meta"):
        model = Qwen3VLTextModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(f"text-encoder keys do not match Qwen3-VL: missing {missing[:3]}, unexpected {unexpected[:3]}", path=path)
    model.load_state_dict({k: (v if dtype is None else v.to(dtype)) for k, v in weights.items()}, assign=True)
    rot = model.rotary_emb
    rot.inv_freq = rot.original_inv_freq = _inv_freq(config)
    return QwenTextEncoder(model)


def _inv_freq(config) -> torch.Tensor:
    theta = config.rope_parameters["rope_theta"]
    dim = config.head_dim
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _config_from_weights(w: dict, path):
    from transformers import Qwen3VLTextConfig

    try:
        vocab, hidden = w["embed_tokens.weight"].shape
        layers = 1 + max(int(k.split(".")[1]) for k in w if k.startswith("layers."))
        head_dim = w["layers.0.self_attn.q_norm.weight"].shape[0]
        heads = w["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim
        kv = w["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim
        inter = w["layers.0.mlp.gate_proj.weight"].shape[0]
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"not a Qwen3-VL text encoder (missing {e})", path=path) from None
    sections = [24, 20, 20] if head_dim == 128 else [head_dim // 6] * 3
    return Qwen3VLTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": sections, "mrope_interleaved": True})


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
