"""Deterministic synthetic VAE weights in ComfyUI's key layout (for `h3direct make-checkpoint --component ...`).

The init keeps activations O(1) through the untrained network so decode/encode outputs are finite and
non-trivial: weights N(0, (gain/sqrt(fan_in))²), biases N(0, 0.02²), norm scales 1 + N(0, 0.05²), layer scales
0.8 + N(0, 0.2²), snake parameters near their neutral values. Weights are rounded to fp16 (as the shared tiny VAEs
are); buffers (latent statistics, kaiser-sinc filters) stay fp32. One generator, keys drawn in sorted order.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from h3direct.errors import ConfigError
from h3direct.vae.audio import AudioVAE
from h3direct.vae.audio_blocks import kaiser_sinc_filter
from h3direct.vae.config import (
    AUDIO_PRESETS,
    VIDEO_LATENTS_MEAN,
    VIDEO_LATENTS_STD,
    VIDEO_PRESETS,
    AudioVAEConfig,
    VideoVAEConfig,
)
from h3direct.vae.video import VideoVAE

COMPONENTS = ("video_vae", "audio_vae")

# (key regex, gain) for weights whose output feeds a residual sum or the final output: smaller init
SMALL_GAIN = [
    (r"decoder\.proj_out\.weight", 0.5),
    (r"decoder\.conv_post\.weight", 0.3),
    (r"decoder\.resblocks\.\d+\.convs2\.\d+\.weight", 0.3),
    (r"encoder\.block\.\d+\.block\.[0-2]\.block\.3\.weight", 0.3),
]


def _fan_in(module: nn.Module, weight: torch.Tensor) -> float:
    if isinstance(module, nn.ConvTranspose1d):  # [in, out, k]: each output sees in·k/stride taps
        return weight.shape[0] * weight.shape[2] / module.stride[0]
    return math.prod(weight.shape[1:])


def _init(key: str, module: nn.Module, like: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    shape = tuple(like.shape)
    normal = lambda std, mean=0.0: torch.randn(shape, generator=g) * std + mean  # noqa: E731
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "filter":
        return _filter_for(module, shape)
    if leaf == "zero_k_bias":
        return torch.zeros(shape)
    if leaf in ("register_tokens", "mask_token"):
        return normal(1.0)
    if leaf in ("scale1", "scale2"):
        return normal(0.2, 0.8)
    if leaf in ("alpha", "beta"):
        return normal(0.1, 1.0 if like.ndim == 3 else 0.0)  # Snake1d α [1, C, 1]; SnakeBeta log α/β [C]
    if isinstance(module, nn.LayerNorm | nn.GroupNorm) or re.search(r"norm\d?\.weight$", key):
        return normal(0.05, 1.0) if leaf == "weight" else normal(0.02)
    if leaf == "bias" or leaf in ("q_bias", "v_bias"):
        return normal(0.02)
    if leaf == "weight":
        gain = next((gn for pat, gn in SMALL_GAIN if re.fullmatch(pat, key)), 1.0)
        return normal(gain / math.sqrt(_fan_in(module, like)))
    raise ConfigError(f"synthetic init has no rule for key {key}")


def _filter_for(module: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    ratio = getattr(module, "ratio", None) or getattr(module, "stride", 2)
    return kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, shape[-1])


def _config(component: str, config) -> VideoVAEConfig | AudioVAEConfig:
    presets = VIDEO_PRESETS if component == "video_vae" else AUDIO_PRESETS
    kind = VideoVAEConfig if component == "video_vae" else AudioVAEConfig
    if config is None:
        return kind()
    if isinstance(config, str):
        if config not in presets:
            raise ConfigError(f"unknown {component} preset {config!r}; known: {', '.join(sorted(presets))}")
        return presets[config]
    if isinstance(config, dict):
        return kind.from_constructor_args(config)
    if not isinstance(config, kind):
        raise ConfigError(f"{component} needs a {kind.__name__}, got {type(config).__name__}")
    return config


def make_state_dict(component: str, config=None, seed: int = 0) -> dict[str, torch.Tensor]:
    """ComfyUI-format state dict for `component` ('video_vae' | 'audio_vae').

    `config`: a config dataclass, a preset name ('full', 'tiny'), a constructor-args dict, or None (full size).
    """
    if component not in COMPONENTS:
        raise ConfigError(f"unknown VAE component {component!r}; known: {', '.join(COMPONENTS)}")
    cfg = _config(component, config)
    with torch.device("meta"):
        model = VideoVAE(cfg) if component == "video_vae" else AudioVAE(cfg)
    g = torch.Generator().manual_seed(seed + (100 if component == "video_vae" else 200))
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    sd = {}
    for key in sorted(tensors):
        owner = model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
        if key == "latents_mean":
            known = component == "video_vae" and tensors[key].shape[0] == len(VIDEO_LATENTS_MEAN)
            sd[key] = torch.tensor(VIDEO_LATENTS_MEAN) if known else torch.randn(tensors[key].shape, generator=g) * 0.1
        elif key == "latents_std":
            known = component == "video_vae" and tensors[key].shape[0] == len(VIDEO_LATENTS_STD)
            sd[key] = (torch.tensor(VIDEO_LATENTS_STD) if known
                       else torch.rand(tensors[key].shape, generator=g) * 0.4 + 0.8)
        else:
            t = _init(key, owner, tensors[key], g)
            sd[key] = t if key.endswith(".filter") else t.to(torch.float16)
    return sd
