"""End-to-end H3 generation as a reusable object: load the models once, generate many clips.

    pipe = H3Pipeline.from_files(dit="h3.safetensors", video_vae="vae.safetensors", audio_vae="avae.safetensors",
                                 text_encoder="qwen3vl.safetensors", tokenizer="qwen25_tokenizer/")
    request = GenerateRequest(prompt="a cat plays the piano", width=960, height=544, frames=124, steps=8, seed=1)
    result = pipe.generate(request, Options(AttentionOptions("fa3")))
    result.frames  # uint8 [T, H, W, 3];  result.audio  # float32 [L, 2] at result.sample_rate
    result.calls   # this generation's counted calls (attention fallbacks, FP8 GEMM paths)

`H3Pipeline.bundled()` uses the embedded tiny models (`h3direct.app.bundled`). The request was validated when it was
built (`app/request.py`); the options are this generation's own (`dit/options.py`): nothing of the pipeline is
changed by a request.

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
5. decode: video VAE -> uint8 frames, each temporal chunk handed on as it is done (`on_frames`: the mp4 encoder
   runs while the decoder does), audio VAE -> stereo waveform.
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

from h3direct.dit.options import DEFAULT_OPTIONS, KernelOptions, Options
from h3direct.errors import H3Error, RequestError

FPS = 24
TASKS = ("t2va", "fl2va", "ref2va")

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
    calls: dict = field(default_factory=dict)  # this generation's counted calls (`h3direct.counts`)
    provenance: dict | None = None  # what the clip was made from (`app.provenance`; set by `app.generate.clip`)

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


def check_text(config, text) -> None:
    """RequestError (field text_embeds) unless `text` (a TextConditioning) fits a DiT of `config` (`H3Config`):
    states [1, L, text_dim], tags [L]. Checked before the models load (`app/cli_generate.py`, from the checkpoint's
    header) and when a pipeline takes text (the service's door)."""
    states = text.states
    if states.ndim != 3 or states.shape[0] != 1 or states.shape[-1] not in (config.text_dim, config.hidden_size):
        raise RequestError("text_embeds", f": text states {list(states.shape)} do not fit the DiT: width "
                           f"{states.shape[-1]}, expected [1, L, {config.text_dim}] (its text_dim); pass matching "
                           "text embeddings (or use the text encoder)")
    if text.tags.shape[0] != states.shape[1]:
        raise RequestError("text_embeds", f": token tags ({text.tags.shape[0]}) and text states "
                           f"({states.shape[1]}) differ in length")


# ---- the pipeline ------------------------------------------------------------------------------

class H3Pipeline:
    """Loaded models + what was fixed when they loaded; `generate` may be called many times (not concurrently)."""

    def __init__(self, dit, video_vae, audio_vae, text_encoder=None, tokenize: Callable[[str], list] | None = None,
                 *, device: torch.device | str | None = None, vae_dtype: torch.dtype | None = None,
                 vae_tile_size: int | None = None, sources: dict | None = None,
                 kernels: KernelOptions | None = None):
        from h3direct.app.residency import TextEncoderSlot

        self.device = resolve_device(device)
        self.dit, self.video_vae, self.audio_vae = dit, video_vae, audio_vae
        # the text encoder under its residency policy (`app/residency.py`); a loaded one given here stays resident
        self.text = (text_encoder if isinstance(text_encoder, TextEncoderSlot)
                     else TextEncoderSlot.holding(text_encoder, self.device))
        self.tokenize = tokenize
        self.vae_dtype = vae_dtype if vae_dtype is not None else next(video_vae.parameters()).dtype
        self.vae_tile_size = vae_tile_size  # None: the VAE's own; 0: untiled (checked by `app.models.ModelSpec`)
        # the kernel options fixed when the weights loaded (`KernelOptions.load_time()`)
        self.kernels = kernels or KernelOptions(fp8_linear=getattr(dit, "fp8_linear", "off"))
        self.sources = dict(sources or {})
        self.load_seconds: dict = {}
        self.files: dict = {}  # component -> the weight file it was loaded from (from_files)
        self.held = None  # how from_files held the models (`app.footprint.Held`)
        self._footprint: dict | None = None

    @property
    def text_encoder(self):
        """The text encoder when it is loaded (None when there is none, or its policy has unloaded it)."""
        return self.text.encoder

    def footprint(self) -> dict | None:
        """{component: bytes of weights held} of the files loaded (`app/footprint.py`); None without files."""
        if self._footprint is None and self.files and self.held is not None:
            from h3direct.app.footprint import of_files

            self._footprint = of_files(self.files, self.held)
        return self._footprint

    # ---- construction ----
    @classmethod
    def from_files(cls, dit, video_vae, audio_vae, text_encoder=None, *, tokenizer=None, video_vae_config=None,
                   audio_vae_config=None, compute_dtype: str = "fp32", nvfp4_mode: str = "auto",
                   device: str | torch.device | None = None, vae_dtype: str | torch.dtype | None = None,
                   vae_tile_size: int | None = None, sources: dict | None = None,
                   kernels: KernelOptions | None = None, text_encoder_policy: str = "auto") -> H3Pipeline:
        """Load ComfyUI-format files. `text_encoder` None: generate() then needs `text_embeds`; `tokenizer`: a Qwen2
        tokenizer folder, 'bytes' or a callable (None: the one that comes with the text encoder's file).
        `kernels`: its load-time options (`KernelOptions.load_time()`: FP8 W8A8 DiT block linears, opt-in and
        approximate, and their settings; the NVFP4 dequantization path). `vae_dtype` None: fp16 on CUDA, fp32 on the CPU
        (ComfyUI's choice). `text_encoder_policy`: where the text encoder stays between requests
        (`app/residency.py`: auto, resident, offload, unload)."""
        from h3direct.app.footprint import Held
        from h3direct.dit.loader import load_dit, parse_compute_dtype
        from h3direct.text.load import find_tokenizer, make_tokenizer
        from h3direct.vae.config import resolve_vae_config
        from h3direct.vae.loader import load_audio_vae, load_video_vae

        dev = resolve_device(device)
        kernels = kernels or KernelOptions()
        files = {"dit": dit, "video_vae": video_vae, "audio_vae": audio_vae, "text_encoder": text_encoder}
        for what, p in zip(("DiT checkpoint", "video VAE", "audio VAE", "text encoder"), files.values(), strict=True):
            if p is not None and not Path(p).is_file():
                raise H3Error(f"{what} file not found", path=p)
        files = {k: None if p is None else str(p) for k, p in files.items()}
        vcfg, acfg = resolve_vae_config("video", video_vae_config), resolve_vae_config("audio", audio_vae_config)
        vae_dtype = _vae_dtype(vae_dtype, dev)
        held = Held(parse_compute_dtype(compute_dtype), vae_dtype, kernels.fp8_linear, vcfg, acfg,
                    kernels.fp8_linear_layers, kernels.fp8_linear_format)
        slot, hot = _text_slot(files, text_encoder_policy, dev, held)
        seconds = {}
        t = time.perf_counter()
        model = load_dit(dit, compute_dtype=compute_dtype, nvfp4_mode=nvfp4_mode, device=dev, **kernels.load_time())
        seconds["dit"] = time.perf_counter() - t
        t = time.perf_counter()
        vvae = load_video_vae(video_vae, vcfg, dtype=vae_dtype, device=dev)
        avae = load_audio_vae(audio_vae, acfg, device=dev)
        seconds["vae"] = time.perf_counter() - t
        tok = None
        if text_encoder is not None:
            t = time.perf_counter()
            tok = make_tokenizer(tokenizer if tokenizer is not None else find_tokenizer(text_encoder))
            slot.start()
            seconds["text_encoder"] = time.perf_counter() - t
        pipe = cls(model, vvae, avae, slot, tok, device=dev, vae_dtype=vae_dtype, vae_tile_size=vae_tile_size,
                   sources={**files, **(sources or {})}, kernels=kernels)
        pipe.load_seconds, pipe.files, pipe.held, pipe._footprint = seconds, files, held, hot
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
        from h3direct.text.presentation import build_presentation

        if not self.text.present:
            raise H3Error("no text encoder is loaded: pass --text-encoder FILE or --text-embeds FILE")
        self.text.acquire()  # (on the device already within a generation)
        return self.text_encoder.encode(build_presentation(prompt, list(presentation), self.tokenize))

    def check_text(self, text) -> None:
        check_text(self.dit.config, text)

    def effective(self, options: Options) -> Options:
        """`options` with the kernel options this pipeline was loaded with; a different load-time choice in
        `options` is a RequestError (it would need a reload)."""
        import dataclasses

        loaded, asked = self.kernels.load_time(), options.kernels.load_time()
        default = KernelOptions().load_time()
        for name, value in asked.items():
            if value != loaded[name] and value != default[name]:
                raise RequestError(name, f" {value!r} is fixed when the models load; these run {loaded[name]!r} "
                                   f"(a server flag, or reload with it)")
        return dataclasses.replace(options, kernels=dataclasses.replace(options.kernels, **loaded))

    def check_options(self, options: Options) -> Options:
        """The effective options (`effective`), their attention backend able to run here (RequestError if not)."""
        from h3direct.dit.attention import check_backend

        options = self.effective(options)
        check_backend(options.attention, torch.empty(0, device=self.device, dtype=self.dit.compute_dtype))
        return options

    def _context(self, text, options: Options) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_text(text)
        ctx = self.dit.preprocess_text(text.states.to(self.device), options=options)
        return ctx, text.tags.to(self.device)

    def build_conditioning(self, width: int, height: int, frames: int, *, ref_images=(), ref_videos=(),
                           ref_video_audios=(), ref_audios=(), first_frame=None, last_frame=None,
                           ref_image_size: str = "match"):
        """The task's conditioning (geometry and reference latents) from images / videos / audio given as tensors
        or files (the task was checked by the request)."""
        from h3direct.sampling import conditioning as hc

        if ref_images or ref_videos or ref_audios:
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

    def _request_conditioning(self, request):
        def given(name):
            return [f.value if f.path is None else f.path for f in request.inputs(name)]

        videos = given("ref_videos")
        one = lambda name: (given(name) or [None])[0]  # noqa: E731
        return self.build_conditioning(
            request.width, request.height, request.frames, ref_images=given("ref_images"), ref_videos=videos,
            ref_video_audios=[None if isinstance(v, torch.Tensor) else video_soundtrack(v) for v in videos],
            ref_audios=given("ref_audios"), first_frame=one("first_frame"), last_frame=one("last_frame"),
            ref_image_size=request.ref_image_size)

    def _dit_conditioning(self, cond, tags: torch.Tensor, seed: int):
        from h3direct.dit.model import Conditioning

        fields = cond.comfy_fields() if cond is not None else {}
        move = lambda d: {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}  # noqa: E731
        return Conditioning(text_token_tags=tags, keyframes=[move(k) for k in fields.get("minimax_keyframes", [])],
                            refs=[move(r) for r in fields.get("minimax_refs", [])], seed=int(seed))

    # ---- the whole thing ----
    def generate(self, request, options: Options = DEFAULT_OPTIONS, *,
                 callback: Callable[[StepEvent], None] | None = None, on_stage: Callable[[str], None] | None = None,
                 decode: bool = True, on_frames: Callable[[np.ndarray], None] | None = None) -> Result:
        """One clip of `request` (an `app.request.GenerateRequest`, validated when built) with this generation's
        `options`. `on_stage(name)` is called as each stage starts (conditioning, text_encode, sample,
        decode_video, decode_audio) and after each video-decoder tile ("decode_video:tile"); like `callback`, it
        may raise to abandon the run (a cancelled or timed-out request). `on_frames(frames)` gets the clip's uint8
        frames [n, H, W, 3] in order, each temporal chunk as soon as the video decoder has finished it (an mp4
        encoder: `vae.mp4.Mp4Stream.add`); they are `Result.frames` too. The calls counted during the run are
        `Result.calls`."""
        from h3direct.counts import counting

        options = self.check_options(options)
        run = _Run(self, request, options, callback, on_stage or (lambda name: None), on_frames)
        with counting() as calls, torch.inference_mode():
            res = run.all(decode)
        res.calls = calls.as_dict()
        return res


class _Run:
    """One `H3Pipeline.generate`: its stages in order, each timed (and its peak memory noted)."""

    def __init__(self, pipe: H3Pipeline, request, options: Options, callback, stage, on_frames=None):
        self.pipe, self.request, self.options, self.callback, self.stage = pipe, request, options, callback, stage
        self.on_frames = on_frames
        self.timings: dict = {}
        self.memory: dict = {}
        self.dev = pipe.device
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)

    def mark(self, stage: str, t0: float) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        now = time.perf_counter()
        self.timings[stage] = round(self.timings.get(stage, 0.0) + now - t0, 4)
        self.memory[stage] = peak_memory(self.dev)[0]
        return now

    def all(self, decode: bool) -> Result:
        pipe, req = self.pipe, self.request
        self.stage("conditioning")
        t = time.perf_counter()
        cond = pipe._request_conditioning(req)
        t = self.mark("conditioning", t)
        self.stage("text_encode")
        text, neg_text, t = self.texts(cond, t)
        positive, negative = self.denoisers(cond, text, neg_text)
        t = self.mark("text_preprocess", t)
        self.stage("sample")
        video_latent, audio_latent, sigmas, reused, step_times = self.sample(cond, positive, negative)
        t = self.mark("sample", t)
        pixels = wave = None
        if decode:
            pixels, wave = self.decode(video_latent, audio_latent, t)
        return Result(frames=pixels, audio=wave, sample_rate=pipe.audio_vae.cfg.sample_rate,
                      video_latent=video_latent.cpu(), audio_latent=audio_latent.cpu(), task=cond.task,
                      width=req.width, height=req.height, frame_count=cond.frame_count, steps=req.steps,
                      sigmas=[float(s) for s in sigmas], timings=self.timings, memory=self.memory,
                      reused_steps=reused, step_seconds=step_times)

    def texts(self, cond, t: float):
        """(positive TextConditioning, negative one or None, now): given embeddings or the text encoder's. The
        encoder is brought to the device for the encode and released after it (`app/residency.py`); each move is a
        stage of its own (text_encoder_load, _to_device, _to_host, _free)."""
        pipe, req = self.pipe, self.request
        given = req.resolved.text_embeds
        negative = not np.isclose(req.cfg, 1.0)
        if negative and given is not None and not pipe.text.present:
            raise RequestError("cfg", f" {req.cfg} needs a negative prompt, which needs a text encoder (these "
                               "models have none loaded)")
        if given is not None and not negative:
            return given, None, self.mark("text_encode", t)
        t = self.moved(pipe.text.acquire(), t)
        try:
            text = given if given is not None else pipe.text_states(req.prompt_text, cond.presentation)
            neg_text = pipe.text_states(req.negative_prompt, ()) if negative else None
            t = self.mark("text_encode", t)
        finally:
            move = pipe.text.release()
        return text, neg_text, self.moved(move, t)

    def moved(self, move: str | None, t: float) -> float:
        return t if move is None else self.mark(f"text_encoder_{move}", t)

    def denoisers(self, cond, text, neg_text):
        from h3direct.dit.denoiser import Denoiser, audio_scale_of

        pipe, seed = self.pipe, self.request.seed
        context, tags = pipe._context(text, self.options)
        scale = audio_scale_of(pipe.dit)
        positive = Denoiser(pipe.dit, context, pipe._dit_conditioning(cond, tags, seed), scale, options=self.options)
        negative = None
        if neg_text is not None:
            nctx, ntags = pipe._context(neg_text, self.options)
            negative = Denoiser(pipe.dit, nctx, pipe._dit_conditioning(None, ntags, seed), scale,
                                options=self.options)
        return positive, negative

    def sample(self, cond, positive, negative):
        from h3direct.dit.denoiser import audio_scale_of
        from h3direct.sampling import caches, noise, schedules
        from h3direct.sampling import sampler as hs

        pipe, req, dev = self.pipe, self.request, self.dev
        shift = pipe.dit.config.sigma_shift_video
        sigmas = schedules.sigmas_for(req.steps, req.scheduler, shift=shift)
        nz = noise.initial_noise(req.seed, cond.video_shape, cond.audio_shape)
        den, neg, step_cache = caches.with_cache(positive, req.cache_settings(), shift, negative)
        step_times: list = []
        last = [time.perf_counter()]

        def on_step(info) -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now
            if self.callback is not None:
                self.callback(StepEvent(info.index, info.total, info.sigma, step_times[-1], info))

        zeros_v = torch.zeros(cond.video_shape, device=dev)
        zeros_a = torch.zeros(cond.audio_shape, device=dev)
        last[0] = time.perf_counter()
        out = hs.sample(den, nz.video.to(dev), nz.audio.to(dev), sigmas.to(dev), latent_video=zeros_v,
                        latent_audio=zeros_a, sampler=req.sampler, audio_scale=audio_scale_of(pipe.dit),
                        cfg=req.cfg, denoise_negative=neg, callback=on_step)
        reused = step_cache.reused_steps(sigmas) if step_cache is not None else []
        return out.video.float(), out.audio.float(), sigmas, reused, step_times

    def decode(self, video_latent, audio_latent, t: float):
        from h3direct.vae.api import decode_audio, decode_video_frames
        from h3direct.vae.mp4 import pixels_to_uint8

        pipe = self.pipe
        self.stage("decode_video")
        chunks = []
        for px in decode_video_frames(pipe.video_vae, video_latent, dtype=pipe.vae_dtype,
                                      tile_size=pipe.vae_tile_size, on_tile=lambda: self.stage("decode_video:tile")):
            chunks.append(pixels_to_uint8(px[0]))
            del px
            if self.on_frames is not None:
                self.on_frames(chunks[-1])
        pixels = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        del chunks
        t = self.mark("decode_video", t)
        self.stage("decode_audio")
        wave = decode_audio(pipe.audio_vae, audio_latent)[0].float().cpu().numpy()
        self.mark("decode_audio", t)
        return pixels, wave


def _vae_dtype(vae_dtype, dev: torch.device) -> torch.dtype:
    from h3direct.vae.api import VIDEO_DTYPES

    if vae_dtype is None:
        return torch.float16 if dev.type == "cuda" else torch.float32
    return VIDEO_DTYPES[vae_dtype] if isinstance(vae_dtype, str) else vae_dtype


def _text_slot(files: dict, asked: str, dev: torch.device, held):
    """(the text encoder's slot under the policy `asked` resolves to, the footprint of `files` when `auto` needed
    it, else None): `auto` on CUDA reads the files' headers (`app/footprint.py`)."""
    from h3direct.app import footprint, residency
    from h3direct.text.load import load_text_encoder

    path = files["text_encoder"]
    if path is None:
        return residency.TextEncoderSlot.holding(None, dev), None
    machine = residency.machine_of(dev)
    hot = footprint.of_files(files, held) if asked == "auto" and machine.device_type == "cuda" else None
    policy, why = residency.choose(asked, sum((hot or {}).values()), machine)
    if policy == "unload" and hot is None:  # loaded only per request: its keys and shapes are checked now, as a
        footprint.hold("text_encoder", footprint.header_state_dict(path))  # load would (meta tensors, no data)
    return residency.TextEncoderSlot(lambda d: load_text_encoder(path, device=d), policy, dev, why=why,
                                     asked=asked), hot
