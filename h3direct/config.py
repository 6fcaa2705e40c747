"""The one H3 DiT config dataclass, with presets and derivation from a checkpoint's tensor shapes.

Field names are ComfyUI's (`comfy/ldm/minimax/model.py` MiniMaxH3Model arguments and
`comfy/model_detection.py`), so a config printed by `h3direct inspect` reads like ComfyUI's
`unet_config_detected` and can be compared key by key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from h3direct.errors import ConfigError

PATCH_SIZE = (1, 2, 2)


@dataclass(frozen=True)
class H3Config:
    hidden_size: int = 5376
    num_layers: int = 50
    token_refiner_num_layers: int = 2
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    ffn_hidden_size: int = 14336
    latents_dim: int = 24
    audio_latents_dim: int = 32
    text_dim: int = 5120
    # full adaLN form (time embedder); ignored when adaln_curve_grid is set
    timestep_input_dim: int = 256
    time_embed_hidden_size: int = 5376
    time_embed_dim: int = 2688
    rope_inv_freq_len: int = 16
    # curve ("pruned") adaLN form: adaln_t_table [adaln_curve_grid, time_embed_dim]
    adaln_curve_grid: int | None = None
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    sigma_shift_video: float = 12.0
    sigma_shift_audio: float = 3.0
    patch_size: tuple[int, int, int] = field(default=PATCH_SIZE)

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_attention_heads", "attention_head_dim", "ffn_hidden_size",
                     "latents_dim", "audio_latents_dim", "text_dim", "time_embed_dim", "rope_inv_freq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {v!r}")
        if self.token_refiner_num_layers < 0:
            raise ConfigError(f"token_refiner_num_layers must be >= 0, got {self.token_refiner_num_layers}")
        if self.rope_dim > self.attention_head_dim:
            raise ConfigError(f"rope rotates 6×rope_inv_freq_len = {self.rope_dim} dims, wider than a head "
                              f"({self.attention_head_dim})")
        if self.adaln_curve_grid is not None and self.adaln_curve_grid < 2:
            raise ConfigError(f"adaln_curve_grid must be >= 2, got {self.adaln_curve_grid}")

    # ---- derived ----
    @property
    def is_curve(self) -> bool:
        return self.adaln_curve_grid is not None

    @property
    def rope_dim(self) -> int:
        """Head dims rotated by the split-half partial rope: 3 axes × inv_freq, duplicated."""
        return 6 * self.rope_inv_freq_len

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.latents_dim * pt * ph * pw

    def comfy_dict(self) -> dict:
        """The config as ComfyUI's detection reports it (only the fields it derives from shapes)."""
        d = {
            "num_layers": self.num_layers,
            "token_refiner_num_layers": self.token_refiner_num_layers,
            "hidden_size": self.hidden_size,
            "latents_dim": self.latents_dim,
            "audio_latents_dim": self.audio_latents_dim,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "text_dim": self.text_dim,
        }
        if self.is_curve:
            d["adaln_curve_grid"] = self.adaln_curve_grid
            d["time_embed_dim"] = self.time_embed_dim
        else:
            d["timestep_input_dim"] = self.timestep_input_dim
            d["time_embed_hidden_size"] = self.time_embed_hidden_size
            d["time_embed_dim"] = self.time_embed_dim
        d["rope_inv_freq_len"] = self.rope_inv_freq_len
        return d

    def replace(self, **kw) -> H3Config:
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_name(cls, name: str) -> H3Config:
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None

    @classmethod
    def from_dict(cls, d: dict) -> H3Config:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if k == "patch_size" else v) for k, v in d.items() if k in known}
        return cls(**kw)

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple[int, ...]]) -> H3Config:
        """The config of a checkpoint with these tensor shapes (`shape_fields`, then validated)."""
        return cls(**shape_fields(shapes))


# the tensors ComfyUI's H3 detection reads, and the rank it needs of each (besides the time embedder / curve table)
DETECTION_KEYS: dict[str, int] = {
    "video_patch_proj.weight": 1, "audio_patch_proj.weight": 1, "final_layer.video_out.weight": 1,
    "final_layer.audio_out.weight": 1, "blocks.0.attn.q_norm.weight": 1, "blocks.0.attn.qkv_proj.weight": 1,
    "blocks.0.mlp.fc1.weight": 1, "condition_proj.weight": 2, "rope.inv_freq": 1,
}


def shape_fields(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The config fields ComfyUI's detection (`comfy/model_detection.py`) derives from tensor name -> shape, in its
    order (as `H3Config.comfy_dict`), not yet validated. A file without the detection's gate keys
    (`video_patch_proj.weight`, `audio_patch_proj.weight`) or without a tensor it reads is a `ConfigError`.

    Detection reads out-features of qkv/fc1 and in-features of condition_proj; NVFP4 packing halves only K and pads
    to 16, so callers pass logical [N, K] shapes (packed ones give what ComfyUI reads from the stored tensor)."""
    if "video_patch_proj.weight" not in shapes or "audio_patch_proj.weight" not in shapes:
        raise ConfigError("not an H3 DiT checkpoint: no video_patch_proj.weight / audio_patch_proj.weight (the keys "
                          "ComfyUI's detection looks for)")
    curve = "adaln_t_table" in shapes
    ranks = {**DETECTION_KEYS, **({"adaln_t_table": 2} if curve else
                                  {"time_embedder.proj_in.weight": 2, "time_embedder.proj_out.weight": 1})}
    for key, rank in ranks.items():
        if key not in shapes:
            raise ConfigError(f"not a complete H3 DiT checkpoint: missing {key} (ComfyUI's detection reads it)")
        if len(shapes[key]) < rank:
            raise ConfigError(f"not an H3 DiT checkpoint: {key} has shape {list(shapes[key])}, expected {rank}-D")
    head_dim = shapes["blocks.0.attn.q_norm.weight"][0]
    if head_dim == 0:
        raise ConfigError("not an H3 DiT checkpoint: blocks.0.attn.q_norm.weight is empty (head_dim 0)")

    def count(prefix: str) -> int:  # contiguous from 0, like ComfyUI's count_blocks
        present = {k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)}
        n = 0
        while str(n) in present:
            n += 1
        return n

    d = dict(
        num_layers=count("blocks."),
        token_refiner_num_layers=count("token_refiner.blocks."),
        hidden_size=shapes["video_patch_proj.weight"][0],
        latents_dim=shapes["final_layer.video_out.weight"][0] // 4,  # patch 1x2x2
        audio_latents_dim=shapes["final_layer.audio_out.weight"][0],
        attention_head_dim=head_dim,
        num_attention_heads=shapes["blocks.0.attn.qkv_proj.weight"][0] // (3 * head_dim),
        ffn_hidden_size=shapes["blocks.0.mlp.fc1.weight"][0] // 2,
        text_dim=shapes["condition_proj.weight"][1],
    )
    if curve:
        d.update(adaln_curve_grid=shapes["adaln_t_table"][0], time_embed_dim=shapes["adaln_t_table"][1])
    else:
        te_in = shapes["time_embedder.proj_in.weight"]
        d.update(timestep_input_dim=te_in[1], time_embed_hidden_size=te_in[0],
                 time_embed_dim=shapes["time_embedder.proj_out.weight"][0])
    d["rope_inv_freq_len"] = shapes["rope.inv_freq"][0]
    return d


PRESETS: dict[str, H3Config] = {
    # the released H3 sizes (full adaLN form)
    "full": H3Config(),
    # the released pruned files: curve adaLN, adaln_t_table [1025, 8]
    "full-curve": H3Config(adaln_curve_grid=1025, time_embed_dim=8),
    # the shared oracle's tiny DiT (`../shared/oracle/checkpoint_info.json`)
    "tiny": H3Config(hidden_size=128, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4,
                     attention_head_dim=32, ffn_hidden_size=256, text_dim=96, timestep_input_dim=64,
                     time_embed_hidden_size=128, time_embed_dim=64, rope_inv_freq_len=4),
    "tiny-curve": H3Config(hidden_size=128, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4,
                           attention_head_dim=32, ffn_hidden_size=256, text_dim=96, rope_inv_freq_len=4,
                           adaln_curve_grid=33, time_embed_dim=8),
    # head_dim 128 (what the GPU attention kernels are built for) at a size small enough to commit its checkpoints
    # and GPU traces (fixtures/gpu/): 2 heads x 128, 2 blocks, 1 refiner block, the released rope width (16)
    "small": H3Config(hidden_size=256, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2,
                      attention_head_dim=128, ffn_hidden_size=512, text_dim=64, timestep_input_dim=64,
                      time_embed_hidden_size=256, time_embed_dim=128, rope_inv_freq_len=16),
    "small-curve": H3Config(hidden_size=256, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2,
                            attention_head_dim=128, ffn_hidden_size=512, text_dim=64, rope_inv_freq_len=16,
                            adaln_curve_grid=33, time_embed_dim=8),
}
