"""Every tensor of a ComfyUI-format H3 DiT checkpoint, as data: key -> stored shape, storage dtype, role.

Derived from ComfyUI's `MiniMaxH3Model` (`comfy/ldm/minimax/model.py`, snapshot 0f1fa67a):

- fp32 island (declared ``dtype=torch.float32`` in the model): `video_patch_proj`, `audio_patch_proj`,
  `time_embedder.*` (full adaLN form), `final_layer.video_out`, `final_layer.audio_out`; in the curve form
  also every `adaln_proj.linear` (``adaln_dtype = float32``);
- buffers (fp32): `rope.inv_freq` and, curve form only, `adaln_t_table` [grid, time_embed_dim];
- everything else at the model dtype; released and synthetic checkpoints store it as bf16;
- NVFP4 (``quant="nvfp4"``): `attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`, `mlp.fc2` of every DiT block and,
  as in the shared tiny files, of every token-refiner block (``nvfp4_refiner=False`` gives the 50 × 4 = 200
  DiT linears only). Each becomes `.weight` uint8, `.weight_scale` float8_e4m3fn (swizzled),
  `.weight_scale_2` fp32 scalar and `.comfy_quant` uint8 (the 19 bytes ``{"format": "nvfp4"}``).

`dit_keys` is what `make-checkpoint` writes and `inspect` checks a file against; the strict loader checks the same
keys through `H3DiT`, whose module paths are these keys (`tests/test_dit.py` holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from h3direct.checkpoint.quant import NVFP4_MARKER
from h3direct.checkpoint.quant.nvfp4 import storage_shapes
from h3direct.config import H3Config

ROLES = ("bf16", "fp32_island", "buffer", "nvfp4_weight", "nvfp4_block_scale", "nvfp4_global_scale", "comfy_quant")
QUANT_MODES = ("none", "nvfp4")
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")  # per block: what NVFP4 / FP8 replace

_ROLE_DTYPE = {
    "bf16": "bfloat16",
    "fp32_island": "float32",
    "buffer": "float32",
    "nvfp4_weight": "uint8",
    "nvfp4_block_scale": "float8_e4m3fn",
    "nvfp4_global_scale": "float32",
    "comfy_quant": "uint8",
}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor. `kind` says what the tensor is to the model (used for initialisation):
    ``linear.weight``, ``linear.bias``, ``norm.weight``, ``rope.inv_freq``, ``adaln_t_table``, or for NVFP4
    companions ``nvfp4.weight_scale``, ``nvfp4.weight_scale_2``, ``nvfp4.comfy_quant``. `logical_shape`
    is the dense [out, in] of a linear weight (equal to `shape` unless the weight is NVFP4-packed)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16", "float8_e4m3fn"
    role: str
    kind: str
    logical_shape: tuple[int, ...]

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def module(self) -> str:
        """Module path (key without the parameter name)."""
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _ITEMSIZE[self.dtype]


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class _Linear:
    path: str
    in_features: int
    out_features: int
    bias: bool
    role: str  # "bf16" or "fp32_island"


def _block_linears(prefix: str, c: H3Config) -> list[_Linear]:
    inner = c.num_attention_heads * c.attention_head_dim
    return [
        _Linear(f"{prefix}.attn.qkv_proj", c.hidden_size, 3 * inner, False, "bf16"),
        _Linear(f"{prefix}.attn.out_proj", inner, c.hidden_size, False, "bf16"),
        _Linear(f"{prefix}.mlp.fc1", c.hidden_size, 2 * c.ffn_hidden_size, False, "bf16"),
        _Linear(f"{prefix}.mlp.fc2", c.ffn_hidden_size, c.hidden_size, False, "bf16"),
    ]


def _block_norms(prefix: str, c: H3Config) -> list[tuple[str, int]]:
    return [(f"{prefix}.norm1", c.hidden_size), (f"{prefix}.norm2", c.hidden_size),
            (f"{prefix}.attn.q_norm", c.attention_head_dim), (f"{prefix}.attn.k_norm", c.attention_head_dim)]


def _modules(c: H3Config) -> tuple[list[_Linear], list[tuple[str, int]], list[tuple[str, tuple[int, ...]]]]:
    """(linears, RMSNorm (path, dim), fp32 buffers (key, shape)) of MiniMaxH3Model for config `c`."""
    adaln_role = "fp32_island" if c.is_curve else "bf16"
    linears = [
        _Linear("video_patch_proj", c.video_patch_dim, c.hidden_size, True, "fp32_island"),
        _Linear("audio_patch_proj", c.audio_latents_dim, c.hidden_size, True, "fp32_island"),
        _Linear("condition_proj", c.text_dim, c.hidden_size, True, "bf16"),
        _Linear("final_layer.adaln_proj.linear", c.time_embed_dim, 2 * c.hidden_size, True, adaln_role),
        _Linear("final_layer.video_out", c.hidden_size, c.video_patch_dim, True, "fp32_island"),
        _Linear("final_layer.audio_out", c.hidden_size, c.audio_latents_dim, True, "fp32_island"),
    ]
    norms = [("final_layer.norm", c.hidden_size), ("token_refiner.final_norm", c.hidden_size)]
    buffers: list[tuple[str, tuple[int, ...]]] = [("rope.inv_freq", (c.rope_inv_freq_len,))]
    if c.is_curve:
        buffers.append(("adaln_t_table", (c.adaln_curve_grid, c.time_embed_dim)))
    else:
        linears += [
            _Linear("time_embedder.proj_in", c.timestep_input_dim, c.time_embed_hidden_size, True, "fp32_island"),
            _Linear("time_embedder.proj_out", c.time_embed_hidden_size, c.time_embed_dim, True, "fp32_island"),
        ]
    for i in range(c.token_refiner_num_layers):
        linears += _block_linears(f"token_refiner.blocks.{i}", c)
        norms += _block_norms(f"token_refiner.blocks.{i}", c)
    for i in range(c.num_layers):
        # 6 modulation chunks (shift/scale/gate for attn and mlp) x 3 modality rows
        linears.append(_Linear(f"blocks.{i}.adaln_proj.linear", c.time_embed_dim, 6 * c.hidden_size * 3, True,
                               adaln_role))
        linears += _block_linears(f"blocks.{i}", c)
        norms += _block_norms(f"blocks.{i}", c)
    return linears, norms, buffers


def nvfp4_layer_names(config: H3Config, nvfp4_refiner: bool = True) -> list[str]:
    """Module paths of the linears stored in NVFP4 (sorted)."""
    prefixes = [f"blocks.{i}" for i in range(config.num_layers)]
    if nvfp4_refiner:
        prefixes += [f"token_refiner.blocks.{i}" for i in range(config.token_refiner_num_layers)]
    return sorted(f"{p}.{name}" for p in prefixes for name in BLOCK_LINEARS)


def _spec(name, shape, role, kind, logical=None) -> TensorSpec:
    shape = tuple(shape)
    return TensorSpec(name, shape, _ROLE_DTYPE[role], role, kind, tuple(logical) if logical is not None else shape)


def dit_keys(config: H3Config, quant: str = "none", nvfp4_refiner: bool = True) -> dict[str, TensorSpec]:
    """Every key of a ComfyUI-format H3 DiT checkpoint for `config`, sorted by key."""
    if quant not in QUANT_MODES:
        from h3direct.errors import ConfigError

        raise ConfigError(f"quant must be one of {', '.join(QUANT_MODES)}, got {quant!r}")
    quantized = set(nvfp4_layer_names(config, nvfp4_refiner)) if quant == "nvfp4" else set()
    linears, norms, buffers = _modules(config)
    specs: list[TensorSpec] = []
    for lin in linears:
        dense = (lin.out_features, lin.in_features)
        if lin.path in quantized:
            stored = storage_shapes(dense)
            specs += [
                _spec(f"{lin.path}.weight", stored["weight"], "nvfp4_weight", "linear.weight", dense),
                _spec(f"{lin.path}.weight_scale", stored["weight_scale"], "nvfp4_block_scale", "nvfp4.weight_scale"),
                _spec(f"{lin.path}.weight_scale_2", (), "nvfp4_global_scale", "nvfp4.weight_scale_2"),
                _spec(f"{lin.path}.comfy_quant", (len(NVFP4_MARKER),), "comfy_quant", "nvfp4.comfy_quant"),
            ]
        else:
            specs.append(_spec(f"{lin.path}.weight", dense, lin.role, "linear.weight"))
        if lin.bias:
            specs.append(_spec(f"{lin.path}.bias", (lin.out_features,), lin.role, "linear.bias"))
    specs += [_spec(f"{path}.weight", (dim,), "bf16", "norm.weight") for path, dim in norms]
    specs += [_spec(key, shape, "buffer", key) for key, shape in buffers]  # kind = key for the two buffers
    return {s.name: s for s in sorted(specs, key=lambda s: s.name)}
