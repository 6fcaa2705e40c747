"""The hot runtime's footprint: the bytes of weights each model holds on its device once loaded, exact.

The loaders themselves run on `meta` tensors (shapes and dtypes, no data), so the dtype each tensor is held in is
decided where loading decides it (the DiT's dtype policy in `dit/loader.py`, `vae/loader.py`, `text/load.py`) and
no size is written down here:

- `of_preset(preset, weights)`: from the shapes of a preset in a weight format (`h3direct footprint`): the DiT's
  keys as `make-checkpoint` writes them (`checkpoint/keys.py`), the text encoder's and the VAEs' module trees (their
  module paths are their keys; the text encoder's `nvfp4`: `text.load.NVFP4_LINEARS` of every decoder layer);
- `of_files(files, held)`: from the headers of the files a command is about to load (`app/residency.py`).

Weights only (every parameter and buffer, each tensor once): no activations, workspaces or allocator caches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

COMPONENTS = ("text_encoder", "dit", "video_vae", "audio_vae")
WEIGHTS = ("bf16", "nvfp4")  # the DiT's and the text encoder's formats (their loaders take no other; VAEs are dense)
# the text encoder's and the VAEs' presets that go with a DiT preset's size (its name before "-curve")
SIZES = {"full": ("qwen3vl_32b", "full"), "tiny": ("tiny", "tiny"), "small": ("tiny", "tiny")}


@dataclass(frozen=True)
class Held:
    """How the models are held; the defaults are the pipeline's on CUDA (the text encoder is held as stored)."""

    compute_dtype: torch.dtype = torch.bfloat16  # the DiT's
    vae_dtype: torch.dtype = torch.float16  # the video VAE's (the audio VAE's is fp32)
    fp8_linear: str | None = None  # the kernel option fixed at load (`--fp8-linear`)
    video_vae_config: object = None  # anything `vae.config.resolve_vae_config` takes
    audio_vae_config: object = None
    fp8_linear_layers: str | None = None  # which block linears `fp8_linear` makes 8-bit (None: all four)
    fp8_linear_format: str = "e4m3"


def tensors(module) -> list[torch.Tensor]:
    """A model's parameters and buffers, each tensor once."""
    module = getattr(module, "net", module)  # the text encoder wraps its torch module
    return list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())


def by_dtype(module) -> dict[str, int]:
    """{dtype: bytes} of a model's parameters and buffers, each tensor once."""
    out: dict[str, int] = {}
    for t in tensors(module):
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out


def held_bytes(module) -> int:
    return sum(by_dtype(module).values())


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _marker() -> torch.Tensor:
    from h3direct.checkpoint.quant import NVFP4_MARKER

    return torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8)  # read by the loaders: a real tensor


def hold(component: str, sd: dict, held: Held = Held()):
    """The model `component` as its loader holds the tensors `sd` (meta tensors: on the meta device, no data)."""
    if component == "dit":
        from h3direct.dit.loader import load_state_dict

        return load_state_dict(sd, compute_dtype=held.compute_dtype, device="meta", fp8_linear=held.fp8_linear,
                               fp8_linear_layers=held.fp8_linear_layers, fp8_linear_format=held.fp8_linear_format)
    if component == "text_encoder":
        from h3direct.text.load import text_encoder_of

        return text_encoder_of(sd)
    from h3direct.vae.config import resolve_vae_config
    from h3direct.vae.loader import audio_vae_of, video_vae_of

    if component == "video_vae":
        return video_vae_of(sd, resolve_vae_config("video", held.video_vae_config), held.vae_dtype, "meta")
    return audio_vae_of(sd, resolve_vae_config("audio", held.audio_vae_config), "meta")


# ---- the shapes of a preset ---------------------------------------------------------------------

def dit_schema(config, weights: str) -> dict:
    from h3direct.checkpoint.keys import dit_keys

    specs = dit_keys(config, "nvfp4" if weights == "nvfp4" else "none")
    return {k: _marker() if s.role == "comfy_quant" else _meta(s.shape, s.torch_dtype) for k, s in specs.items()}


def text_encoder_schema(config, weights: str) -> dict:
    from h3direct.checkpoint.quant.nvfp4 import STORAGE_DTYPES, storage_shapes
    from h3direct.text.load import nvfp4_layer_names
    from h3direct.text.qwen import QwenVL

    with torch.device("meta"):
        net = QwenVL(config)
    sd = {k: _meta(t.shape, torch.bfloat16) for k, t in net.state_dict().items()}
    if weights == "nvfp4":
        for layer in nvfp4_layer_names(config):
            stored = storage_shapes(tuple(sd.pop(f"{layer}.weight").shape))
            sd.update({f"{layer}.{s}": _meta(shape, STORAGE_DTYPES[s]) for s, shape in stored.items()})
            sd[f"{layer}.comfy_quant"] = _marker()
    return sd


def vae_schema(component: str, config) -> dict:
    from h3direct.vae.audio import AudioVAE
    from h3direct.vae.video import VideoVAE

    with torch.device("meta"):
        model = VideoVAE(config) if component == "video_vae" else AudioVAE(config)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def of_preset(preset: str, weights: str, held: Held = Held()) -> dict[str, int]:
    """{component: bytes held} of a DiT preset (`config.PRESETS`) with the text encoder and VAEs of its size
    (`SIZES`), the DiT and the text encoder in `weights` (bf16 or nvfp4)."""
    from h3direct.config import H3Config
    from h3direct.errors import ConfigError
    from h3direct.text.qwen import PRESETS as TEXT_PRESETS
    from h3direct.vae.config import AUDIO_PRESETS, VIDEO_PRESETS

    if weights not in WEIGHTS:
        raise ConfigError(f"weight format {weights!r} is not one of {', '.join(WEIGHTS)}")
    config = H3Config.from_name(preset)
    text, vae = SIZES[preset.removesuffix("-curve")]
    held = dataclasses.replace(held, video_vae_config=VIDEO_PRESETS[vae], audio_vae_config=AUDIO_PRESETS[vae])
    sds = {"text_encoder": text_encoder_schema(TEXT_PRESETS[text], weights), "dit": dit_schema(config, weights),
           "video_vae": vae_schema("video_vae", VIDEO_PRESETS[vae]),
           "audio_vae": vae_schema("audio_vae", AUDIO_PRESETS[vae])}
    return {c: held_bytes(hold(c, sds[c], held)) for c in COMPONENTS}


# ---- the files a command loads ------------------------------------------------------------------

def header_state_dict(path) -> dict:
    """A file's tensors as meta tensors of their stored shapes and dtypes (read from its header); its `comfy_quant`
    markers are read (their bytes say the format)."""
    from safetensors import safe_open

    from h3direct.checkpoint.quant import MARKER
    from h3direct.checkpoint.safetensors_header import TORCH_DTYPE_NAMES, read_header
    from h3direct.errors import CheckpointError

    sd = {}
    for name, t in read_header(path).tensors.items():
        dtype = getattr(torch, TORCH_DTYPE_NAMES.get(t.dtype, ""), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{name}: dtype {t.dtype} has no torch counterpart here", path=path)
        sd[name] = _meta(t.shape, dtype)
    markers = [n for n in sd if n.endswith("." + MARKER)]
    if markers:
        with safe_open(str(path), "pt") as f:
            sd.update({n: f.get_tensor(n) for n in markers})
    return sd


def of_files(files: dict, held: Held = Held()) -> dict[str, int]:
    """{component: bytes held} of the files {component: path or None} (None: not loaded, left out)."""
    return {c: held_bytes(hold(c, header_state_dict(p), held)) for c, p in files.items() if p is not None}
