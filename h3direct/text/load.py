"""Loading H3's text encoder from a ComfyUI-format file, its tokenizer, and text-embeddings files.

Files: ComfyUI-format safetensors, keys `model.*` (LM) and `visual.*` (vision tower), optionally under
`text_encoders.qwen3vl_32b.transformer.`; LM keys without `model.` are accepted (older h3direct files).
Quantized layers use ComfyUI's mixed-precision layout (`<layer>.comfy_quant` JSON); NVFP4 is supported
(with AWQ `pre_quant_scale`; decoded per call, see `qwen_vision.Linear`). `model.norm.weight` and
`lm_head.weight` are ignored (ComfyUI builds this encoder without them and loads non-strictly).

Tokenizer: the Qwen2 tokenizer files (`vocab.json`, `merges.txt`) of `--tokenizer DIR`, else the ones that come with
the text encoder's file: beside it, or in a `tokenizer/` or `qwen25_tokenizer/` folder beside it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from h3direct.errors import CheckpointError, H3Error
from h3direct.text.presentation import TextConditioning, Tokenize
from h3direct.text.qwen import QwenTextEncoder, QwenVL, TextEncoderConfig
from h3direct.text.vision import VISION_PRESETS, Linear

FILE_PREFIXES = ("text_encoders.qwen3vl_32b.transformer.", "qwen3vl_32b.transformer.", "transformer.")
_QUANT_SIDE = ("weight_scale_2", "pre_quant_scale", "input_scale")  # kept as stored whatever `dtype` says
IGNORED_KEYS = ("model.norm.weight", "lm_head.weight", "model.lm_head.weight")
TOKENIZER_FILES = ("vocab.json", "merges.txt")
TOKENIZER_FOLDERS = ("", "tokenizer", "qwen25_tokenizer")  # beside the text encoder's file


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

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise CheckpointError("text-encoder file not found", path=p)
    try:
        sd = load_file(str(p))
    except SafetensorError as e:
        raise CheckpointError(f"not a readable safetensors file ({e})", path=p) from None
    return text_encoder_from_state_dict(sd, config, dtype, compute_dtype, path=p)


def text_encoder_from_state_dict(sd: dict, config: TextEncoderConfig | None = None, dtype: torch.dtype | None = None,
                                 compute_dtype: torch.dtype = torch.float32, *, path=None) -> QwenTextEncoder:
    """`load_text_encoder` of a state dict in the file's layout (keys, dtypes, NVFP4 layers; tensors on any device,
    taken as they are: `assign`); `path` names it in errors. Strict: a missing, unexpected or misshapen key is an
    error."""
    sd = _normalize_keys(sd, path)
    for k in IGNORED_KEYS:
        sd.pop(k, None)
    quant = _quant_layers(sd, path)
    if config is None:
        config = config_from_weights(sd, path)
    with torch.device("meta"):
        net = QwenVL(config)
    _prepare_nvfp4(net, sd, quant, path)
    expected = net.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"text-encoder keys do not match Qwen3-VL ({len(missing)} missing, e.g. {missing[:3]}; "
                              f"{len(unexpected)} unexpected, e.g. {unexpected[:3]})", path=path)
    for k, t in expected.items():
        if t.numel() and tuple(t.shape) != tuple(sd[k].shape):
            raise CheckpointError(f"{k}: shape {list(sd[k].shape)}, the config expects {list(t.shape)}", path=path)
        if dtype is not None and sd[k].is_floating_point() and sd[k].element_size() > 1 and not k.endswith(_QUANT_SIDE):
            sd[k] = sd[k].to(dtype)
    net.load_state_dict(sd, assign=True)
    for mod in net.modules():
        if isinstance(mod, Linear):
            mod.weight.requires_grad_(False)
    return QwenTextEncoder(net, compute_dtype)


def load_text_embeds(path) -> TextConditioning:
    """`--text-embeds FILE`: safetensors with `text_states` [1,L,D] (or [L,D]) and `token_tags` [L]."""

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


def find_tokenizer(text_encoder, tokenizer=None) -> Path:
    """The Qwen2 tokenizer folder of a text encoder: `tokenizer` when given, else the one that comes with the text
    encoder's file (beside it, or its `tokenizer/` or `qwen25_tokenizer/` folder). A RequestError naming the field
    when there is none (checked before any model loads)."""
    from h3direct.errors import RequestError

    if tokenizer is not None:
        d = Path(tokenizer)
        if not d.is_dir():
            raise RequestError("tokenizer", ": folder not found", path=d)
        missing = [f for f in TOKENIZER_FILES if not (d / f).is_file()]
        if missing:
            raise RequestError("tokenizer", f": not a Qwen2 tokenizer folder (no {', '.join(missing)})", path=d)
        return d
    base = Path(text_encoder).parent
    for sub in TOKENIZER_FOLDERS:
        d = base / sub
        if all((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    raise RequestError("text_encoder", f": no tokenizer comes with it ({' or '.join(TOKENIZER_FILES)} beside it, or "
                       f"in a tokenizer/ or qwen25_tokenizer/ folder beside it); pass tokenizer DIR (a Qwen2 "
                       f"tokenizer folder, e.g. ComfyUI's comfy/text_encoders/qwen25_tokenizer)", path=text_encoder)


def make_tokenizer(spec) -> Tokenize:
    """Text -> Qwen token ids (no special tokens). `spec`: a callable, 'bytes' (the bundled tokenizer: UTF-8 bytes
    as ids) or a Hugging Face Qwen2 tokenizer folder (`find_tokenizer`)."""
    if callable(spec):
        return spec
    if spec == "bytes":
        return lambda s: list(s.encode("utf-8"))
    try:
        from transformers import Qwen2Tokenizer
    except ImportError:
        raise H3Error("the Qwen tokenizer needs transformers: pip install 'h3direct[text]'") from None
    tok = Qwen2Tokenizer.from_pretrained(str(spec))
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]
