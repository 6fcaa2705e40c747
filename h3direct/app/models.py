"""`ModelSpec`: the models a command loads and how (files, device, dtypes), validated when it is built: every given
file is read as far as its header, and must be what its field says (a DiT checkpoint, a video VAE, an audio VAE, a
Qwen3-VL text encoder, with its tokenizer), before anything is built or loaded. `load_pipeline(spec, kernels)`
then loads them once; each model left out is its bundled tiny counterpart (`app/bundled.py`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from h3direct.errors import H3Error, RequestError
from h3direct.fields import check, field

COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
NVFP4_MODES = ("auto", "w4a4", "w4a16")  # = h3direct.dit.linear.NVFP4_MODES (a test holds them equal)
VAE_DTYPES = ("fp32", "fp16")  # = h3direct.vae.config.VAE_DTYPES
VAE_PRESETS = ("tiny", "full")  # = the presets of h3direct.vae.config
TEXT_ENCODER_POLICIES = ("auto", "resident", "offload", "unload")  # = h3direct.app.residency.POLICIES


def _model_file(help: str):
    return field(None, help, kind="file")


@dataclass(frozen=True)
class ModelSpec:
    checkpoint: str | None = _model_file("H3 DiT safetensors (ComfyUI format, bf16 or NVFP4)")
    vae: str | None = _model_file("video VAE safetensors")
    audio_vae: str | None = _model_file("audio VAE safetensors")
    vae_config: str | None = field(None, "video VAE constructor args: a JSON file (vae_config_public.json layout) or "
                                   "a preset, tiny or full (default: the preset whose shapes the file has)", kind=str)
    audio_vae_config: str | None = field(None, "audio VAE constructor args (default: vae_config, else the preset "
                                         "whose shapes the file has)", kind=str)
    text_encoder: str | None = _model_file("Qwen3-VL text-encoder safetensors (ComfyUI format)")
    tokenizer: str | None = field(None, "Qwen2 tokenizer folder for the text encoder (default: the one beside its "
                                  "file, or in a tokenizer/ or qwen25_tokenizer/ folder beside it)", kind=str,
                                  env=True)
    compute_dtype: str | None = field(None, "DiT compute dtype (default: bf16 on CUDA, fp32 on CPU)", kind=str,
                                      choices=COMPUTE_DTYPES)
    nvfp4_mode: str = field("auto", "NVFP4 layers: auto = as ComfyUI on this device (w4a4 on compute capability "
                            ">= 10, else w4a16)", choices=NVFP4_MODES)
    device: str | None = field(None, "torch device (default: cuda if available, else cpu)", kind=str)
    threads: int | None = field(None, "CPU intra-op threads (default: torch's, or OMP_NUM_THREADS; 1 for the "
                                "bundled tiny models, which only lose from threading)", kind=int,
                                rule=lambda v: v >= 1, expect="at least 1")
    vae_dtype: str | None = field(None, "video VAE dtype (default: fp16 on CUDA, fp32 on CPU)", kind=str,
                                  choices=VAE_DTYPES, env=True)
    vae_tile_size: int | None = field(None, "video VAE spatial tile in px (default: the VAE's; 0 = untiled)",
                                      kind=int, rule=lambda v: v >= 0, expect="an integer >= 0 (0 = untiled)",
                                      env=True)
    text_encoder_policy: str = field("auto", "where the text encoder stays between requests (never changes a "
                                     "result): resident = on the device; offload = in host memory, moved to the "
                                     "device to encode; unload = freed after encoding, read again from its file; "
                                     "auto = resident when the weights and a working margin fit the device's memory, "
                                     "else unload on unified memory (GB10) and offload on a discrete GPU",
                                     choices=TEXT_ENCODER_POLICIES, env=True)

    def __post_init__(self):
        check(self)
        for cfg, f in (("vae_config", "vae"), ("audio_vae_config", "audio_vae")):
            if getattr(self, cfg) is not None and getattr(self, f) is None:
                raise RequestError(cfg, f" describes {f}; give {f} too (the bundled one has its own config)")
        self._check_files()

    def _check_files(self) -> None:
        from h3direct.app.paths import check_input
        from h3direct.checkpoint.inspect import inspect_checkpoint

        for name in ("checkpoint", "vae", "audio_vae", "text_encoder", "vae_config", "audio_vae_config"):
            p = getattr(self, name)
            if p is not None and not (name.endswith("_config") and p in VAE_PRESETS):
                check_input(p, name)
        if self.checkpoint is not None:
            _header(self.checkpoint, "checkpoint", inspect_checkpoint)
        for name, kind in (("vae", "video"), ("audio_vae", "audio")):
            if getattr(self, name) is not None:
                _header(getattr(self, name), name, lambda p, kind=kind: vae_kind(p, kind))
        if self.text_encoder is not None:  # (a tokenizer without one is not used: the bundled encoder has its own)
            from h3direct.text.load import find_tokenizer

            _header(self.text_encoder, "text_encoder", text_encoder_header)
            find_tokenizer(self.text_encoder, self.tokenizer)

    @property
    def all_bundled(self) -> bool:
        return not (self.checkpoint or self.vae or self.audio_vae or self.text_encoder)

    def compute_dtype_on(self, device) -> str:
        """The DiT's compute dtype on `device`: as given, else bf16 on CUDA and fp32 elsewhere."""
        return self.compute_dtype or ("bf16" if device.type == "cuda" else "fp32")

    def dit_config(self):
        """The DiT's config from its header (the bundled preset without a checkpoint); nothing is loaded."""
        from h3direct.app import bundled
        from h3direct.config import H3Config

        if self.checkpoint is None:
            return H3Config.from_name(bundled.DIT_PRESET)
        from h3direct.checkpoint.inspect import inspect_checkpoint

        return H3Config.from_dict(inspect_checkpoint(self.checkpoint)["config"])


def _header(path, field_name: str, read) -> None:
    """`read(path)` (a header-only check); its CheckpointError becomes a RequestError naming the field."""
    try:
        read(path)
    except H3Error as e:
        raise RequestError(field_name, f": {str(e).removeprefix(str(path) + ': ')}", path=path) from None


def vae_kind(path, want: str | None = None) -> str:
    """'video' or 'audio' from a VAE file's header; an error when it is neither (or not `want`)."""
    from h3direct.checkpoint.safetensors_header import read_header
    from h3direct.vae.loader import detect_kind

    kind = detect_kind(read_header(path, check=True).tensors)
    if want is not None and kind != want:
        raise H3Error(f"this is an {kind} VAE; a {want} VAE was expected")
    return kind


def text_encoder_header(path) -> None:
    """A Qwen3-VL text encoder's header: its language model's layers under one of the known key prefixes."""
    from h3direct.checkpoint.safetensors_header import read_header
    from h3direct.text.load import FILE_PREFIXES

    names = read_header(path, check=True).tensors
    stripped = {n.removeprefix(next((p for p in FILE_PREFIXES if n.startswith(p)), "")) for n in names}
    if not any(n.startswith(("model.layers.0.", "layers.0.")) for n in stripped):
        raise H3Error("not a Qwen3-VL text encoder (no model.layers.0.* tensors)")


def set_threads(spec: ModelSpec, device) -> None:
    """CPU intra-op threads: `spec.threads`, else 1 for the bundled tiny models on the CPU (their tiny tensors lose
    more to OpenMP threads than they gain: 10x on a busy CPU) unless OMP_NUM_THREADS says otherwise."""
    import torch

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    elif spec.all_bundled and device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)


def load_pipeline(spec: ModelSpec, kernels=None, *, text_encoder: bool = True):
    """Resolve device, dtype, threads and the bundled fallbacks, then load the models once.

    Returns (pipeline, sources, seconds {"bundle", "load", "load_<model>"}, peak memory after loading).
    `text_encoder` False: no text encoder (the request brings text embeddings)."""

    from h3direct.app import bundled
    from h3direct.app.pipeline import H3Pipeline, peak_memory, resolve_device

    device = resolve_device(spec.device)
    compute = spec.compute_dtype_on(device)
    set_threads(spec, device)
    seconds = {}
    b = None
    t = time.perf_counter()
    if not (spec.checkpoint and spec.vae and spec.audio_vae and (spec.text_encoder or not text_encoder)):
        b = bundled.ensure()  # made on first use (seconds), then read from the cache
    seconds["bundle"] = round(time.perf_counter() - t, 4)
    te = spec.text_encoder or (b.text_encoder if text_encoder else None)
    tokenizer = spec.tokenizer if spec.text_encoder else (b.tokenizer if text_encoder else None)
    sources = {"dit": spec.checkpoint or "bundled", "video_vae": spec.vae or "bundled",
               "audio_vae": spec.audio_vae or "bundled",
               "text_encoder": spec.text_encoder or ("bundled" if text_encoder else None)}
    t = time.perf_counter()
    pipe = H3Pipeline.from_files(spec.checkpoint or b.dit, spec.vae or b.video_vae, spec.audio_vae or b.audio_vae,
                                 te, tokenizer=tokenizer, video_vae_config=vae_config(spec, "video", b),
                                 audio_vae_config=vae_config(spec, "audio", b), compute_dtype=compute,
                                 nvfp4_mode=spec.nvfp4_mode, device=device, vae_dtype=spec.vae_dtype,
                                 vae_tile_size=spec.vae_tile_size, sources=sources, kernels=kernels,
                                 text_encoder_policy=spec.text_encoder_policy)
    seconds["load"] = round(time.perf_counter() - t, 4)
    seconds.update({f"load_{k}": round(v, 4) for k, v in pipe.load_seconds.items()})
    return pipe, sources, seconds, peak_memory(device)[0]


def vae_config(spec: ModelSpec, kind: str, b):
    """The VAE config: the given one (the audio VAE falls back to the video VAE's), else the preset the file's shapes
    match, else the released sizes; the bundled VAE's own preset when no file was given."""
    path = spec.vae if kind == "video" else spec.audio_vae
    if path is None:
        return None if b is None else b.video_vae_config if kind == "video" else b.audio_vae_config
    given = spec.vae_config if kind == "video" else (spec.audio_vae_config or spec.vae_config)
    if given is not None:
        return given
    from h3direct.vae.loader import preset_of

    return preset_of(path, kind)

