"""End-to-end H3 generation as a reusable object: load the models once, generate many clips.

    pipe = H3Pipeline.from_files(dit="h3.safetensors", video_vae="vae.safetensors", audio_vae="avae.safetensors",
                                 text_encoder="qwen3vl.safetensors", tokenizer="qwen25_tokenizer/")
    result = pipe.generate("a cat plays the piano", width=960, height=544, frames=124, steps=8, seed=1)
    result.frames  # uint8 [T, H, W, 3];  result.audio  # float32 [L, 2] at result.sample_rate

`H3Pipeline.bundled()` uses the embedded tiny models (`h3direct.app.bundled`).

One generation, in ComfyUI's order (`nodes_minimax_h3.py` + KSampler):
1. task from the references: none -> t2va; first/last frame -> fl2va (keyframes); reference images / videos /
   audio -> ref2va. Geometry (17k+5 frames, latent shapes) and reference preprocessing:
   `h3direct.sampling.conditioning`, references encoded with our VAEs;
2. text: the presentation (reference labels + vision pads, then the prompt) through the text encoder, or given
   states (`text_embeds`); the DiT's condition_proj + token refiner run once (`H3DiT.preprocess_text`);
3. initial noise from the seed exactly as ComfyUI draws it (`h3direct.sampling.noise`), zero clean latent;
4. sigma schedule (`h3direct.sampling.schedules`, the DiT's video shift), sampler (`h3direct.sampling.sampler`)
   around the `Denoiser` (optionally wrapped by a step cache, `h3direct.sampling.caches`); the conditioning
   payload seed is the sampler seed, as ComfyUI's `extra_conds`;
5. decode: video VAE -> uint8 frames, audio VAE -> stereo waveform.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h3direct.errors import H3Error

FPS = 24
TASKS = ("t2va", "fl2va", "ref2va")
COMFY_TOKENIZER = "comfy/text_encoders/qwen25_tokenizer"  # where ComfyUI keeps the Qwen tokenizer files

ImageLike = torch.Tensor | str | os.PathLike
AudioLike = dict | str | os.PathLike


# ---- results and progress ----------------------------------------------------------------------

@dataclass
class StepEvent:
    """One sampler step, as the per-step callback sees it."""

    index: int
    total: int
    sigma: float
    seconds: float  # wall time since the previous step's event (or since sampling started)
    info: Any = None  # h3direct.sampling.sampler.StepInfo (sampler-space tensors)


@dataclass
class Result:
    frames: np.ndarray | None  # uint8 [T, H, W, 3]; None when decode=False
    audio: np.ndarray | None  # float32 [L, 2] in [-1, 1]; None when decode=False
    sample_rate: int
    video_latent: torch.Tensor  # [1, 24, t, H/16, W/16] float32 (normalised VAE latent space)
    audio_latent: torch.Tensor  # [1, 32, 2, ta] float32
    task: str
    width: int
    height: int
    frame_count: int
    fps: int = FPS
    steps: int = 0
    sigmas: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)  # stage -> seconds
    memory: dict = field(default_factory=dict)  # stage -> peak bytes so far
    reused_steps: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)

    @property
    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.video_latent, self.audio_latent


# ---- small helpers -----------------------------------------------------------------------------

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): CUDA max allocated on a CUDA device, else this process's max RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_max_rss"


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise H3Error(f"device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise H3Error(f"device {device!r}: no CUDA device is available here (use cpu)")
    return dev


def resolve_vae_config(kind: str, spec):
    """A VAE config from None (the released sizes), a preset name, a JSON file (vae_config_public.json layout),
    a constructor-args dict or a config dataclass."""
    from h3direct.vae.config import AUDIO_PRESETS, VIDEO_PRESETS, AudioVAEConfig, VideoVAEConfig
    from h3direct.vae.loader import read_constructor_args

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
    raise H3Error(f"{kind} VAE config {spec!r}: give a preset ({', '.join(presets)}), a JSON file or a dict")


def make_tokenizer(spec) -> Callable[[str], list]:
    """Text -> Qwen token ids (no special tokens). `spec`: a callable, 'bytes' (the bundled tokenizer) or a
    Hugging Face tokenizer directory (ComfyUI's `comfy/text_encoders/qwen25_tokenizer`); None: $H3_TOKENIZER,
    then $H3_COMFY_ROOT's copy."""
    if callable(spec):
        return spec
    if spec == "bytes":
        from h3direct.app.bundled import byte_tokenize

        return byte_tokenize
    if spec is None:
        spec = os.environ.get("H3_TOKENIZER")
        if not spec and os.environ.get("H3_COMFY_ROOT"):
            spec = str(Path(os.environ["H3_COMFY_ROOT"]) / COMFY_TOKENIZER)
        if not spec:
            raise H3Error("a text encoder needs its tokenizer: pass --tokenizer DIR (Qwen2 tokenizer files, e.g. "
                          "ComfyUI's comfy/text_encoders/qwen25_tokenizer) or set H3_TOKENIZER")
    p = Path(spec)
    if not p.is_dir():
        raise H3Error("tokenizer directory not found", path=p)
    try:
        from transformers import Qwen2Tokenizer
    except ImportError:
        raise H3Error("the Qwen tokenizer needs transformers: pip install 'h3direct[text]'") from None
    tok = Qwen2Tokenizer.from_pretrained(str(p))
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]


def _as_image(x: ImageLike, what: str) -> torch.Tensor:
    from h3direct.sampling import media

    if isinstance(x, torch.Tensor):
        if x.ndim == 3:
            x = x[None]
        if x.ndim != 4 or x.shape[-1] < 3:
            raise H3Error(f"{what} must be an image [N, H, W, 3] in [0, 1], got {list(x.shape)}")
        return x.float()
    return media.load_image(x)


def _as_video(x: ImageLike, what: str) -> torch.Tensor:
    from h3direct.sampling import media

    if isinstance(x, torch.Tensor):
        return _as_image(x, what)
    return media.load_video(x)


def _as_audio(x: AudioLike | None) -> dict | None:
    from h3direct.sampling import media

    if x is None or isinstance(x, dict):
        return x
    return media.load_audio(x)


def video_soundtrack(path) -> dict | None:
    """The soundtrack of a video file at 32 kHz, or None when it has no audio stream."""
    import av

    from h3direct.sampling import media

    try:
        with av.open(str(path)) as box:
            if not box.streams.audio:
                return None
    except av.error.FFmpegError as e:
        raise H3Error(f"cannot open video ({e.__class__.__name__})", path=path) from None
    return media.load_audio(path)


# ---- the pipeline ------------------------------------------------------------------------------

class H3Pipeline:
    """Loaded models + run settings; `generate` may be called many times (not concurrently)."""

    def __init__(self, dit, video_vae, audio_vae, text_encoder=None, tokenize: Callable[[str], list] | None = None,
                 *, device: torch.device | str | None = None, attention: str = "sdpa",
                 vae_dtype: torch.dtype | str | None = None, vae_tile_size: int | None = None, mlp_chunks: int = 1,
                 sources: dict | None = None):
        from h3direct.dit.attention import check_backend

        self.device = resolve_device(device)
        self.dit, self.video_vae, self.audio_vae = dit, video_vae, audio_vae
        self.text_encoder, self.tokenize = text_encoder, tokenize
        if mlp_chunks < 1:
            raise H3Error(f"mlp_chunks={mlp_chunks} must be >= 1")
        check_backend(attention, torch.empty(0, device=self.device, dtype=dit.compute_dtype))
        self.attention, self.mlp_chunks = attention, int(mlp_chunks)
        self.vae_dtype = vae_dtype if vae_dtype is not None else next(video_vae.parameters()).dtype
        if vae_tile_size is not None and vae_tile_size < 0:
            raise H3Error(f"vae_tile_size={vae_tile_size} must be >= 0 (0 = untiled)")
        self.vae_tile_size = vae_tile_size
        self.sources = dict(sources or {})
        self.load_seconds: dict = {}
        self.files: dict = {}  # component -> the weight file it was loaded from (from_files)

    # ---- construction ----
    @classmethod
    def from_files(cls, dit, video_vae, audio_vae, text_encoder=None, *, tokenizer=None, video_vae_config=None,
                   audio_vae_config=None, compute_dtype: str = "fp32", nvfp4_mode: str = "auto",
                   device: str | torch.device | None = None, attention: str = "sdpa",
                   vae_dtype: str | torch.dtype | None = None, vae_tile_size: int | None = None,
                   mlp_chunks: int = 1, sources: dict | None = None, fp8_linear: str | None = None) -> H3Pipeline:
        """Load ComfyUI-format files. `text_encoder` None: generate() then needs `text_embeds`.
        `fp8_linear` "stream"/"resident": FP8 W8A8 DiT block linears (opt-in, approximate; `dit.linear.FP8Linear`).
        `vae_dtype` None: fp16 on CUDA, fp32 on the CPU (ComfyUI's choice)."""
        from h3direct.dit.loader import load_dit
        from h3direct.vae.loader import load_audio_vae, load_video_vae

        dev = resolve_device(device)
        for what, p in (("DiT checkpoint", dit), ("video VAE", video_vae), ("audio VAE", audio_vae),
                        ("text encoder", text_encoder)):
            if p is not None and not Path(p).is_file():
                raise H3Error(f"{what} file not found", path=p)
        vcfg, acfg = resolve_vae_config("video", video_vae_config), resolve_vae_config("audio", audio_vae_config)
        if vae_dtype is None:
            vae_dtype = torch.float16 if dev.type == "cuda" else torch.float32
        elif isinstance(vae_dtype, str):
            from h3direct.vae.api import VIDEO_DTYPES

            if vae_dtype not in VIDEO_DTYPES:
                raise H3Error(f"VAE dtype {vae_dtype!r} is not one of fp32, fp16")
            vae_dtype = VIDEO_DTYPES[vae_dtype]
        seconds = {}
        t = time.perf_counter()
        model = load_dit(dit, compute_dtype=compute_dtype, nvfp4_mode=nvfp4_mode, device=dev, fp8_linear=fp8_linear)
        seconds["dit"] = time.perf_counter() - t
        t = time.perf_counter()
        vvae = load_video_vae(video_vae, vcfg, dtype=vae_dtype, device=dev)
        avae = load_audio_vae(audio_vae, acfg, device=dev)
        seconds["vae"] = time.perf_counter() - t
        enc = tok = None
        if text_encoder is not None:
            t = time.perf_counter()
            tok = make_tokenizer(tokenizer)
            enc = _load_text_encoder(text_encoder, dev)
            seconds["text_encoder"] = time.perf_counter() - t
        src = {"dit": str(dit), "video_vae": str(video_vae), "audio_vae": str(audio_vae),
               "text_encoder": None if text_encoder is None else str(text_encoder)}
        files = dict(src)
        src.update(sources or {})
        pipe = cls(model, vvae, avae, enc, tok, device=dev, attention=attention, vae_dtype=vae_dtype,
                   vae_tile_size=vae_tile_size, mlp_chunks=mlp_chunks, sources=src)
        pipe.load_seconds = seconds
        pipe.files = files
        return pipe

    @classmethod
    def bundled(cls, *, text_encoder: bool = True, **kw) -> H3Pipeline:
        """The embedded tiny models (made and cached on first use)."""
        from h3direct.app import bundled

        b = bundled.ensure()
        src = {"dit": "bundled", "video_vae": "bundled", "audio_vae": "bundled",
               "text_encoder": "bundled" if text_encoder else None}
        return cls.from_files(b.dit, b.video_vae, b.audio_vae, b.text_encoder if text_encoder else None,
                              tokenizer=b.tokenizer, video_vae_config=b.video_vae_config,
                              audio_vae_config=b.audio_vae_config, sources=src, **kw)

    # ---- stages ----
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        from h3direct.vae.api import encode_video

        return encode_video(self.video_vae, pixels, dtype=self.vae_dtype, tile_size=self.vae_tile_size)

    def encode_audio(self, waveform: torch.Tensor) -> torch.Tensor:
        from h3direct.vae.api import encode_audio

        return encode_audio(self.audio_vae, waveform)

    def text_states(self, prompt: str, presentation: Sequence = ()):
        """TextConditioning (states [1, L, D], tags [L]) of `prompt` after the task's presentation items."""
        from h3direct.text.encoder import build_presentation

        if self.text_encoder is None:
            raise H3Error("no text encoder is loaded: pass --text-encoder FILE or --text-embeds FILE")
        return self.text_encoder.encode(build_presentation(prompt, list(presentation), self.tokenize))

    def check_text(self, text) -> None:
        """H3Error unless `text` (a TextConditioning) fits the DiT: states [1, L, text_dim], tags [L]."""
        c = self.dit.config
        states = text.states
        if states.ndim != 3 or states.shape[0] != 1 or states.shape[-1] not in (c.text_dim, c.hidden_size):
            raise H3Error(f"text states {list(states.shape)} do not fit the DiT: width {states.shape[-1]}, expected "
                          f"[1, L, {c.text_dim}] (its text_dim); pass a matching --text-encoder or --text-embeds")
        if text.tags.shape[0] != states.shape[1]:
            raise H3Error(f"token tags ({text.tags.shape[0]}) and text states ({states.shape[1]}) differ in length")

    def _context(self, text) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_text(text)
        states = text.states
        ctx = self.dit.preprocess_text(states.to(self.device), backend=self.attention)
        return ctx, text.tags.to(self.device)

    def build_conditioning(self, width: int, height: int, frames: int, *, ref_images=(), ref_videos=(),
                           ref_video_audios=(), ref_audios=(), first_frame=None, last_frame=None,
                           ref_image_size: str = "match"):
        from h3direct.sampling import conditioning as hc

        hc.check_request(width, height, frames)
        refs = bool(ref_images or ref_videos or ref_audios)
        if refs and (first_frame is not None or last_frame is not None):
            raise H3Error("first/last frames (fl2va) and references (ref2va) are separate tasks; give one kind")
        if refs:
            return hc.ref2va(width, height, frames, self.encode_video, self.encode_audio,
                             images=[_as_image(x, "ref image") for x in ref_images],
                             videos=[_as_video(x, "ref video") for x in ref_videos],
                             video_audios=[_as_audio(a) for a in ref_video_audios],
                             audios=[_as_audio(a) for a in ref_audios], sizing=ref_image_size)
        if first_frame is not None or last_frame is not None:
            return hc.fl2va(width, height, frames, self.encode_video,
                            first_frame=None if first_frame is None else _as_image(first_frame, "first frame"),
                            last_frame=None if last_frame is None else _as_image(last_frame, "last frame"))
        return hc.t2va(width, height, frames)

    def _dit_conditioning(self, cond, tags: torch.Tensor, seed: int):
        from h3direct.dit.model import Conditioning

        fields = cond.comfy_fields() if cond is not None else {}
        move = lambda d: {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}  # noqa: E731
        return Conditioning(text_token_tags=tags, keyframes=[move(k) for k in fields.get("minimax_keyframes", [])],
                            refs=[move(r) for r in fields.get("minimax_refs", [])], seed=int(seed))

    # ---- the whole thing ----
    def generate(self, prompt: str = "", *, text_embeds=None, negative_prompt: str = "", negative_text_embeds=None,
                 width: int, height: int, frames: int, steps: int, seed: int = 0,
                 ref_images: Sequence[ImageLike] = (), ref_videos: Sequence[ImageLike] = (),
                 ref_video_audios: Sequence[AudioLike | None] = (), ref_audios: Sequence[AudioLike] = (),
                 first_frame: ImageLike | None = None, last_frame: ImageLike | None = None,
                 ref_image_size: str = "match", sampler: str = "euler", scheduler: str = "simple",
                 cfg: float = 1.0, cache=None, callback: Callable[[StepEvent], None] | None = None,
                 on_stage: Callable[[str], None] | None = None, decode: bool = True) -> Result:
        """One clip. `text_embeds`: a TextConditioning (or a file for `load_text_embeds`) instead of encoding
        `prompt`. `cache`: an `h3direct.sampling.caches.CacheSettings` (None / mode 'off' = no cache code at all).
        `on_stage(name)` is called as each stage starts (conditioning, text_encode, sample, decode_video,
        decode_audio) and after each video-decoder tile ("decode_video:tile"); like `callback`, it may raise to
        abandon the run (a cancelled or timed-out request)."""
        from h3direct.dit.denoiser import Denoiser, audio_scale_of
        from h3direct.sampling import caches, noise, schedules
        from h3direct.sampling import sampler as hs
        from h3direct.text.encoder import TextConditioning, load_text_embeds

        if steps < 1:
            raise H3Error(f"steps={steps}: need at least 1 sampling step")
        if sampler not in hs.SAMPLERS:
            raise H3Error(f"sampler {sampler!r} is not supported; use one of {', '.join(hs.SAMPLERS)}")
        if scheduler not in schedules.SCHEDULERS:
            raise H3Error(f"scheduler {scheduler!r} is not supported; use one of {', '.join(schedules.SCHEDULERS)}")
        if not (0 <= int(seed) < 2**64):
            raise H3Error(f"seed={seed} must be in [0, 2^64)")
        use_cfg = not np.isclose(cfg, 1.0)
        timings: dict = {}
        memory: dict = {}
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        stage = on_stage or (lambda name: None)

        def mark(stage: str, t0: float) -> float:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            now = time.perf_counter()
            timings[stage] = round(timings.get(stage, 0.0) + now - t0, 4)
            memory[stage] = peak_memory(dev)[0]
            return now

        with torch.inference_mode():
            stage("conditioning")
            t = time.perf_counter()
            cond = self.build_conditioning(width, height, frames, ref_images=ref_images, ref_videos=ref_videos,
                                           ref_video_audios=ref_video_audios, ref_audios=ref_audios,
                                           first_frame=first_frame, last_frame=last_frame,
                                           ref_image_size=ref_image_size)
            t = mark("conditioning", t)
            stage("text_encode")

            if text_embeds is not None:
                text = text_embeds if isinstance(text_embeds, TextConditioning) else load_text_embeds(text_embeds)
            else:
                text = self.text_states(prompt, cond.presentation)
            neg_text = None
            if use_cfg:
                if negative_text_embeds is not None:
                    neg_text = (negative_text_embeds if isinstance(negative_text_embeds, TextConditioning)
                                else load_text_embeds(negative_text_embeds))
                elif self.text_encoder is not None:
                    neg_text = self.text_states(negative_prompt, ())
                else:
                    raise H3Error(f"cfg={cfg} needs a negative conditioning: load a text encoder or pass "
                                  "negative text embeds")
            t = mark("text_encode", t)

            context, tags = self._context(text)
            model = self.dit
            scale = audio_scale_of(model)
            positive = Denoiser(model, context, self._dit_conditioning(cond, tags, seed), scale,
                                backend=self.attention, mlp_chunks=self.mlp_chunks)
            negative = None
            if neg_text is not None:
                nctx, ntags = self._context(neg_text)
                negative = Denoiser(model, nctx, self._dit_conditioning(None, ntags, seed), scale,
                                    backend=self.attention, mlp_chunks=self.mlp_chunks)
            t = mark("text_preprocess", t)
            stage("sample")

            shift = model.config.sigma_shift_video
            sigmas = schedules.sigmas_for(steps, scheduler, shift=shift)
            nz = noise.initial_noise(seed, cond.video_shape, cond.audio_shape)
            den, neg, step_cache = caches.with_cache(positive, cache, shift, negative)
            step_times: list = []
            last = [time.perf_counter()]

            def on_step(info) -> None:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                now = time.perf_counter()
                step_times.append(now - last[0])
                last[0] = now
                if callback is not None:
                    callback(StepEvent(info.index, info.total, info.sigma, step_times[-1], info))

            zeros_v = torch.zeros(cond.video_shape, device=dev)
            zeros_a = torch.zeros(cond.audio_shape, device=dev)
            last[0] = time.perf_counter()
            out = hs.sample(den, nz.video.to(dev), nz.audio.to(dev), sigmas.to(dev), latent_video=zeros_v,
                            latent_audio=zeros_a, sampler=sampler, audio_scale=scale, cfg=cfg,
                            denoise_negative=neg, callback=on_step)
            t = mark("sample", t)
            reused = step_cache.reused_steps(sigmas) if step_cache is not None else []

            video_latent, audio_latent = out.video.float(), out.audio.float()
            pixels = wave = None
            sample_rate = self.audio_vae.cfg.sample_rate
            if decode:
                from h3direct.vae.api import decode_audio, decode_video
                from h3direct.vae.mp4 import pixels_to_uint8

                stage("decode_video")
                px = decode_video(self.video_vae, video_latent, dtype=self.vae_dtype, tile_size=self.vae_tile_size,
                                  on_tile=lambda: stage("decode_video:tile"))
                pixels = pixels_to_uint8(px[0])
                del px
                t = mark("decode_video", t)
                stage("decode_audio")
                wave = decode_audio(self.audio_vae, audio_latent)[0].float().cpu().numpy()
                t = mark("decode_audio", t)

        return Result(frames=pixels, audio=wave, sample_rate=sample_rate, video_latent=video_latent.cpu(),
                      audio_latent=audio_latent.cpu(), task=cond.task, width=width, height=height,
                      frame_count=cond.frame_count, steps=steps, sigmas=[float(s) for s in sigmas],
                      timings=timings, memory=memory, reused_steps=reused, step_seconds=step_times)


def _load_text_encoder(path, device: torch.device):
    from h3direct.text.encoder import load_text_encoder

    enc = load_text_encoder(path)
    enc.to(device)
    return enc
