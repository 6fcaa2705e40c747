"""Load ComfyUI-format VAE safetensors strictly into `VideoVAE` / `AudioVAE`.

The module is built on the `meta` device and the checkpoint assigned into it (cast to the compute dtype, as
ComfyUI's `VAE(dtype=...)` does). Missing, unexpected or misshapen keys are errors naming the key. One exception
is documented: a video checkpoint without `latents_mean` / `latents_std` gets the model's constants (ComfyUI
registers them as defaults). Quantized (int8/convrot) video decoders are not supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from h3direct.errors import CheckpointError
from h3direct.vae.audio import AudioVAE
from h3direct.vae.config import VIDEO_LATENTS_MEAN, VIDEO_LATENTS_STD, AudioVAEConfig, VideoVAEConfig
from h3direct.vae.video import VideoVAE

# keys that tell the two VAEs apart (the ones ComfyUI's loader looks for)
VIDEO_MARKERS = ("decoder.transformer_blocks.0.scale1", "encoder.down.0.block.0.conv1.weight")
AUDIO_MARKERS = ("pre_block.attn.zero_k_bias",)


def detect_kind(keys) -> str:
    """'video' or 'audio' from a state dict's keys."""
    keys = set(keys)
    if all(k in keys for k in VIDEO_MARKERS):
        return "video"
    if all(k in keys for k in AUDIO_MARKERS):
        return "audio"
    raise CheckpointError(f"not an H3 video or audio VAE: none of {VIDEO_MARKERS + AUDIO_MARKERS} present")


def preset_of(path: str | Path, kind: str) -> str | None:
    """The preset (`vae.config` tiny / full) whose tensor shapes a `kind` (video / audio) VAE file has, read from its
    header (None: none has them; then pass its config)."""
    from h3direct.checkpoint.safetensors_header import read_header
    from h3direct.vae.config import AUDIO_PRESETS, VIDEO_PRESETS

    shapes = read_header(path, check=True).shapes()
    presets, cls = (VIDEO_PRESETS, VideoVAE) if kind == "video" else (AUDIO_PRESETS, AudioVAE)
    for name, cfg in presets.items():
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in cls(cfg).state_dict().items()}
        if set(shapes) <= set(want) and all(want[k] == tuple(s) for k, s in shapes.items()):
            return name
    return None


def load_state_dict_strict(model: torch.nn.Module, sd: Mapping[str, torch.Tensor], dtype: torch.dtype,
                           source: str | Path, float_dtypes: Mapping[str, torch.dtype] | None = None) -> None:
    """Assign `sd` into a meta-built `model`; every floating tensor cast to `dtype` (or `float_dtypes[key]`)."""
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for key in sorted(expected):
        if key not in sd:
            raise CheckpointError(f"missing key {key} (expected shape {list(expected[key].shape)})", path=source)
    for key in sorted(sd):
        if key not in expected:
            raise CheckpointError(f"unexpected key {key} {list(sd[key].shape)} for this VAE config", path=source)
        if tuple(sd[key].shape) != tuple(expected[key].shape):
            raise CheckpointError(f"key {key} has shape {list(sd[key].shape)}, expected "
                                  f"{list(expected[key].shape)} (wrong --vae-config?)", path=source)
        if not sd[key].is_floating_point():
            raise CheckpointError(f"key {key} has dtype {sd[key].dtype}; quantized VAEs are not supported",
                                  path=source)
    cast = {k: v.to((float_dtypes or {}).get(k, dtype)) for k, v in sd.items()}
    model.load_state_dict(cast, strict=True, assign=True)


def _read(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError("no such file", path=path) from None
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read safetensors ({exc})", path=path) from None


def load_video_vae(path: str | Path, config: VideoVAEConfig | None = None, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> VideoVAE:
    return video_vae_of(_read(path), config, dtype, device, path)


def video_vae_of(sd: dict, config: VideoVAEConfig | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", source=None) -> VideoVAE:
    """The video VAE holding a file's tensors `sd` (`meta` tensors: as it would be held, with no data)."""
    if detect_kind(sd) != "video":
        raise CheckpointError("this is an audio VAE; a video VAE was expected", path=source)
    sd.setdefault("latents_mean", torch.tensor(VIDEO_LATENTS_MEAN))
    sd.setdefault("latents_std", torch.tensor(VIDEO_LATENTS_STD))
    with torch.device("meta"):
        model = VideoVAE(config or VideoVAEConfig())
    load_state_dict_strict(model, sd, dtype, source, {k: torch.float32 for k in VideoVAE.FP32_KEYS})
    return model.to(device).eval()


def load_audio_vae(path: str | Path, config: AudioVAEConfig | None = None,
                   device: str | torch.device = "cpu") -> AudioVAE:
    return audio_vae_of(_read(path), config, device, path)


def audio_vae_of(sd: dict, config: AudioVAEConfig | None = None, device: str | torch.device = "cpu",
                 source=None) -> AudioVAE:
    """The audio VAE holding a file's tensors `sd` (`meta` tensors: as it would be held, with no data)."""
    if detect_kind(sd) != "audio":
        raise CheckpointError("this is a video VAE; an audio VAE was expected", path=source)
    with torch.device("meta"):
        model = AudioVAE(config or AudioVAEConfig())
    load_state_dict_strict(model, sd, torch.float32, source)
    return model.to(device).eval()


def load_vae(path: str | Path, constructor_args: Mapping[str, Any] | None = None,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> VideoVAE | AudioVAE:
    """Either VAE, told by its keys; `constructor_args` in the `vae_config_public.json` layout."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            kind = detect_kind(f.keys())
    except FileNotFoundError:
        raise CheckpointError("no such file", path=path) from None
    args = constructor_args or {}
    if kind == "video":
        return load_video_vae(path, VideoVAEConfig.from_constructor_args(args), dtype, device)
    return load_audio_vae(path, AudioVAEConfig.from_constructor_args(args), device)
