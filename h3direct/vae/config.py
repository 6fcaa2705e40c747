"""Config dataclasses of the H3 video and audio VAEs.

Field names are the constructor arguments of ComfyUI's `MiniMaxH3VideoVAE` / `ViT3DDecoder` /
`MiniMaxH3AudioVAE`, so a `vae_config_public.json` (`constructor_args`) rebuilds any size with
`from_constructor_args`. Defaults are the released sizes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3direct.errors import ConfigError

# Per-channel statistics of the video latent space (the model's own constants; a checkpoint that
# lacks `latents_mean` / `latents_std` gets these, like ComfyUI's registered defaults).
VIDEO_LATENTS_MEAN: tuple[float, ...] = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075, -0.2727581858634949,
    -1.3675414323806763, -0.2553254961967468, -0.26907554268836975, -0.5376840829849243, -0.0464097298681736,
    0.6657370328903198, 0.19690127670764923, -0.5460608005523682, -0.4035342037677765, -0.23683024942874908,
    0.25928452610969543, -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)
VIDEO_LATENTS_STD: tuple[float, ...] = (
    1.2223774194717407, 1.2767263650894165, 1.6831774711608887, 1.7549455165863037, 1.5636216402053833,
    2.194143533706665, 0.9653137922286987, 1.0569885969161987, 0.841948926448822, 0.7729952931404114,
    1.8955937623977661, 0.946841835975647, 0.7996809482574463, 0.44988900423049927, 0.7197399735450745,
    0.6936293244361877, 2.961095094680786, 2.7694199085235596, 3.0496184825897217, 2.1088054180145264,
    3.276226282119751, 3.1627357006073, 2.2816812992095947, 2.6127843856811523,
)
# decoder output space: ImageNet-normalised RGB
PIXEL_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
PIXEL_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive integer, got {v!r}")


def _kwargs(cls: type, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Constructor-args dict -> dataclass kwargs (lists become tuples; `note` is documentation)."""
    known = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in args.items():
        if k == "note":
            continue
        if k not in known:
            raise ConfigError(f"{where}: unknown constructor argument {k!r}; known: {', '.join(sorted(known))}")
        out[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
    return out


def _constructor_section(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """Accept the whole `vae_config_public.json` or just its `constructor_args` object."""
    return d.get("constructor_args", d)


@dataclass(frozen=True)
class VideoVAEConfig:
    # MiniMaxH3VideoVAE
    in_channels: int = 3
    out_ch: int = 3
    ch: int = 128
    embed_dim: int = 24
    z_channels: int = 24
    ch_mult: tuple[int, ...] = (1, 2, 2, 4, 4, 8)
    num_res_blocks: int = 2
    space_down: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    time_down: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    clip_length: int = 17
    token_drop: int = 3
    tile_size: int = 256
    tile_overlap_min: int = 64
    tiling: bool = True
    # ViT3DDecoder
    num_layers: int = 36
    heads: int = 32
    dim_head: int = 64
    rope_theta: float = 100.0
    rope_dim_ratio: float = 0.75
    bias: bool = True
    eps: float = 1e-5
    num_register_tokens: int = 4
    ff_mult: int = 4

    def __post_init__(self):
        _positive(self, "in_channels", "out_ch", "ch", "embed_dim", "z_channels", "num_res_blocks", "clip_length",
                  "num_layers", "heads", "dim_head", "ff_mult")
        n = len(self.ch_mult)
        if n == 0 or len(self.space_down) != n or len(self.time_down) != n:
            raise ConfigError(f"ch_mult / space_down / time_down must have one entry per level, got "
                              f"{len(self.ch_mult)} / {len(self.space_down)} / {len(self.time_down)}")
        if self.ch * min(self.ch_mult) % 32:
            raise ConfigError(f"encoder widths ch×ch_mult = {[self.ch * m for m in self.ch_mult]} must be multiples "
                              "of 32 (GroupNorm with 32 groups)")
        if self.token_drop < 0:
            raise ConfigError(f"token_drop must be >= 0, got {self.token_drop}")
        if self.rope_pairs_per_axis < 1:
            raise ConfigError(f"rope_dim_ratio {self.rope_dim_ratio} × dim_head {self.dim_head} rotates no pairs")
        check_tile_geometry(self.tile_size, self.tile_overlap_min, self.vae_ratio)

    # ---- derived ----
    @property
    def vae_ratio(self) -> int:
        """Spatial compression (16)."""
        return math.prod(self.space_down)

    @property
    def vae_ratio_t(self) -> int:
        """Temporal compression of one clip (4)."""
        return math.prod(self.time_down)

    @property
    def dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def rope_pairs_per_axis(self) -> int:
        """Frequencies per (t, h, w) axis: len(arange(0, 1, 6 / int(dim_head·ratio)))."""
        rope_dim = int(self.dim_head * self.rope_dim_ratio)
        return math.ceil(rope_dim / 6)

    @property
    def frame_pre_padding(self) -> int:
        return (-self.clip_length) % self.vae_ratio_t

    @property
    def tokens_chunk_size(self) -> int:
        return math.ceil(self.clip_length / self.vae_ratio_t)

    @property
    def token_overlap(self) -> int:
        return (-self.token_drop) % self.tokens_chunk_size

    @property
    def frame_overlap(self) -> int:
        return max(self.token_overlap * self.vae_ratio_t - self.frame_pre_padding, 0)

    def replace(self, **kw) -> VideoVAEConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_constructor_args(cls, d: Mapping[str, Any]) -> VideoVAEConfig:
        """From `{"MiniMaxH3VideoVAE": {...}, "ViT3DDecoder": {...}}` (or a whole vae_config_public.json)."""
        d = _constructor_section(d)
        kw = _kwargs(cls, d.get("MiniMaxH3VideoVAE", {}), "MiniMaxH3VideoVAE")
        kw.update(_kwargs(cls, d.get("ViT3DDecoder", {}), "ViT3DDecoder"))
        return cls(**kw)


def check_tile_geometry(tile_size: int, overlap_min: int, ratio: int) -> None:
    """Spatial tiles are whole latent cells and must advance: 0 < overlap < tile, both multiples of `ratio`."""
    if not isinstance(tile_size, int) or tile_size <= 0 or tile_size % ratio:
        raise ConfigError(f"tile size {tile_size!r} px must be a positive multiple of {ratio}")
    if not isinstance(overlap_min, int) or overlap_min <= 0 or overlap_min % ratio or overlap_min >= tile_size:
        raise ConfigError(f"tile overlap {overlap_min!r} px must be a positive multiple of {ratio} below the tile "
                          f"size {tile_size}")


@dataclass(frozen=True)
class AudioVAEConfig:
    # MiniMaxH3AudioVAE
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    decoder_dim: int = 1024
    vae_latent_channels: int = 32
    # fixed inside ComfyUI's classes, exposed for completeness
    attn_heads: int = 8
    mlp_ratio: int = 2
    upsample_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sample_rate: int = 32000

    def __post_init__(self):
        _positive(self, "encoder_dim", "latent_dim", "decoder_dim", "vae_latent_channels", "attn_heads", "sample_rate")
        if self.latent_dim % self.attn_heads:
            raise ConfigError(f"latent_dim {self.latent_dim} is not divisible by attn_heads {self.attn_heads}")
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ConfigError("upsample_rates and upsample_kernel_sizes differ in length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ConfigError("resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        if self.decoder_dim % (2 ** len(self.upsample_rates)):
            raise ConfigError(f"decoder_dim {self.decoder_dim} does not survive {len(self.upsample_rates)} channel "
                              f"halvings (needs a multiple of {2 ** len(self.upsample_rates)})")
        if math.prod(self.upsample_rates) != self.hop_length:
            raise ConfigError(f"decoder upsamples ×{math.prod(self.upsample_rates)} but the encoder hop is "
                              f"{self.hop_length} samples")

    @property
    def hop_length(self) -> int:
        """Audio samples per latent frame (800)."""
        return math.prod(self.encoder_rates)

    @property
    def latents_per_second(self) -> float:
        return self.sample_rate / self.hop_length

    def replace(self, **kw) -> AudioVAEConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_constructor_args(cls, d: Mapping[str, Any]) -> AudioVAEConfig:
        """From `{"MiniMaxH3AudioVAE": {...}}` (or a whole vae_config_public.json)."""
        return cls(**_kwargs(cls, _constructor_section(d).get("MiniMaxH3AudioVAE", {}), "MiniMaxH3AudioVAE"))


VIDEO_PRESETS: dict[str, VideoVAEConfig] = {
    "full": VideoVAEConfig(),
    # shared/oracle/vae_video_tiny.safetensors
    "tiny": VideoVAEConfig(ch=32, ch_mult=(1, 1, 1, 1, 1, 2), num_res_blocks=1, tile_size=64, tile_overlap_min=16,
                           num_layers=2, heads=2, dim_head=32),
}
AUDIO_PRESETS: dict[str, AudioVAEConfig] = {
    "full": AudioVAEConfig(),
    # shared/oracle/vae_audio_tiny.safetensors
    "tiny": AudioVAEConfig(encoder_dim=4, latent_dim=64, decoder_dim=128),
}


VAE_DTYPES = ("fp32", "fp16")  # compute dtypes of the video VAE (the audio VAE runs fp32)


def read_constructor_args(path: str | Path | None) -> Mapping[str, Any]:
    """A JSON file in `vae_config_public.json` layout (or just its `constructor_args`); None -> {} (real sizes)."""
    if path is None:
        return {}
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such VAE config file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def resolve_vae_config(kind: str, spec):
    """A VAE config from None (the released sizes), a preset name, a JSON file (vae_config_public.json layout),
    a constructor-args dict or a config dataclass."""
    cls, presets = (VideoVAEConfig, VIDEO_PRESETS) if kind == "video" else (AudioVAEConfig, AUDIO_PRESETS)
    if spec is None:
        return cls()
    if isinstance(spec, cls):
        return spec
    if isinstance(spec, dict):
        return cls.from_constructor_args(spec)
    if isinstance(spec, str) and spec in presets:
        return presets[spec]
    if isinstance(spec, str | os.PathLike):
        return cls.from_constructor_args(read_constructor_args(spec))
    raise ConfigError(f"{kind} VAE config {spec!r}: give a preset ({', '.join(presets)}), a JSON file or a dict")
