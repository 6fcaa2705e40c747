"""`h3direct generate`: prompt + references in, mp4 (H.264, 24 fps) with AAC stereo audio out.

With no model arguments at all, the bundled tiny random models are used (`h3direct.app.bundled`), with small
defaults (96×64, 22 frames, 4 steps) that run in seconds on a CPU. Each model argument that is left out
falls back to its bundled counterpart (so `--checkpoint tiny.safetensors` alone works for a tiny DiT). The small
size defaults hold with --checkpoint too (a note on stderr says so); give --width/--height/--frames/--steps for a
full-size clip.

Task from the inputs: none -> t2va; --first-frame / --last-frame -> fl2va; --ref-image / --ref-video /
--ref-audio -> ref2va (a reference video's soundtrack is used when the file has one).

Frames snap up to the model's 17k+5 grid exactly like ComfyUI's H3 nodes (`length` 5..3600; e.g. 100 -> 107; a
note on stderr says so); width and height must be multiples of 32; request limits: `h3direct.app.limits`. Every
input file is opened and the output folder probed before any model is loaded. Stdout: one JSON line (unless
--quiet); progress bars on stderr when it is a terminal (or --progress); errors: one stderr line, exit 2. The mp4
is written to a temporary file next to --output and renamed into place; its `comment` tag holds the provenance
JSON (prompt, seed, sampler, references and weights with sha256, h3direct version).
"""

from __future__ import annotations

import argparse
import os

from h3direct.errors import H3Error

MAX_FRAMES = 3600  # ComfyUI's node limit
MAX_SIZE = 16384  # ComfyUI's MAX_RESOLUTION
FFMPEG_LOGLEVELS = ("quiet", "panic", "fatal", "error", "warning", "info", "verbose", "debug")
CACHE_DEFAULTS = {"threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "subsample_factor": 8}
# choices named here so `--help` needs no torch import; tests hold them equal to the runtime's own tables
SAMPLERS = ("euler", "heun", "dpmpp_2m")  # h3direct.sampling.sampler.SAMPLERS
SCHEDULERS = ("simple", "normal", "sgm_uniform")  # h3direct.sampling.schedules.SCHEDULERS
CACHE_MODES = ("off", "easycache", "h3_cache")  # h3direct.sampling.caches.CACHE_MODES
# dit.attention.backends()
ATTENTION = ("sdpa", "cudnn_sdpa", "fa3", "fa3_fp8", "sage2", "ck_int8", "kj_head_sliced", "sol_attn")
VAE_DTYPES = ("fp32", "fp16")  # = h3direct.vae.config.VAE_DTYPES (not imported here: that imports torch)
REF_CAPS = {"image": 9, "video": 3, "audio": 3}  # h3direct.sampling.conditioning.MAX_REF_{IMAGES,VIDEOS,AUDIOS}


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless there is none to show (None, empty, a plain switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if "%(default)" in text or d is None or d is argparse.SUPPRESS or d is False or d == [] or d == "":
            return text
        return f"{text} (default: %(default)s)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from h3direct.app import bundled, limits

    parser.formatter_class = HelpFormatter
    size = ("(the size flags default to a small clip that takes seconds on a CPU with the bundled models; give all "
            "four for a real one, e.g. 1344 768 124 8)")
    g = parser.add_argument_group("models (each omitted one: the bundled tiny model)")
    g.add_argument("--checkpoint", help="H3 DiT safetensors (ComfyUI format, bf16 or NVFP4)")
    g.add_argument("--vae", help="video VAE safetensors")
    g.add_argument("--audio-vae", help="audio VAE safetensors")
    g.add_argument("--vae-config", help="video VAE constructor args: JSON file (vae_config_public.json layout) or "
                   "preset tiny|full (default full for --vae)")
    g.add_argument("--audio-vae-config", help="audio VAE constructor args (default: --vae-config, else full)")
    g.add_argument("--text-encoder", help="Qwen3-VL text-encoder safetensors (ComfyUI format)")
    g.add_argument("--tokenizer", help="Qwen2 tokenizer directory for --text-encoder (env H3_TOKENIZER; default: "
                   "$H3_COMFY_ROOT/comfy/text_encoders/qwen25_tokenizer)")
    g.add_argument("--text-embeds", metavar="FILE", help="safetensors with text_states [1,L,D] + token_tags [L]; "
                   "skips the text encoder")
    g = parser.add_argument_group("request")
    g.add_argument("--prompt", default="", help="text prompt")
    g.add_argument("--negative-prompt", default="", help="negative prompt (only used with --cfg > 1)")
    for kind, cap in REF_CAPS.items():
        g.add_argument(f"--ref-{kind}", action="append", default=[], metavar="FILE", help=f"reference {kind} (≤ {cap})")
    g.add_argument("--ref-image-size", choices=("match", "max"), default="match",
                   help="reference image sizing (ComfyUI's ref_image_size)")
    g.add_argument("--first-frame", metavar="FILE", help="first frame image (fl2va)")
    g.add_argument("--last-frame", metavar="FILE", help="last frame image (fl2va)")
    g.add_argument("--width", type=int, help=f"multiple of 32 (default: {bundled.DEFAULT_WIDTH}) {size}")
    g.add_argument("--height", type=int, help=f"multiple of 32 (default: {bundled.DEFAULT_HEIGHT})")
    g.add_argument("--frames", type=int, help="frame count at 24 fps, snapped up to 17k+5 (5, 22, 39, ..., 124) "
                   f"(default: {bundled.DEFAULT_FRAMES})")
    g.add_argument("--steps", type=int, help=f"sampling steps (default: {bundled.DEFAULT_STEPS})")
    g.add_argument("--seed", type=int, default=0, help="noise seed in [0, 2^64): the same seed, the same clip")
    g.add_argument("--sampler", choices=SAMPLERS, default="euler", help="sampler")
    g.add_argument("--scheduler", choices=SCHEDULERS, default="simple", help="sigma schedule")
    g.add_argument("--cfg", type=float, default=1.0, help="classifier-free guidance (1 = off; H3 is CFG-distilled)")
    g.add_argument("--output", "-o", "--out", dest="output", default="clip.mp4", metavar="FILE.mp4",
                   help="mp4 to write (--out is an old spelling)")
    g = parser.add_argument_group("runtime")
    g.add_argument("--compute-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="DiT compute dtype (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--nvfp4-mode", choices=("auto", "w4a4", "w4a16"), default="auto",
                   help="NVFP4 layers: auto = as ComfyUI on this device (w4a4 on compute capability >= 10, else w4a16)")
    g.add_argument("--fp8-linear", nargs="?", const="stream", default="off", choices=("off", "stream", "resident"),
                   metavar="MODE", help="opt-in, approximate: the DiT block linears as FP8 e4m3 W8A8 GEMMs "
                   "(per-channel weight, per-token activation scales); bare flag = stream (NVFP4 weights stay packed, "
                   "made fp8 per call), resident = fp8 weights held (more memory); off, stream or resident")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--attention", choices=ATTENTION, default="sdpa", help="attention backend")
    g.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's, or "
                   "OMP_NUM_THREADS; 1 for the bundled tiny models, which only lose from threading)")
    g.add_argument("--mlp-chunks", type=int, default=1, help="run the DiT MLPs in this many row chunks")
    g.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="Ulysses sequence parallelism of the DiT over N processes (default under torchrun: its "
                        "whole world): torchrun --nproc-per-node N -m h3direct generate ...; rank 0 writes")
    g.add_argument("--vae-dtype", choices=VAE_DTYPES, default=None, help="video VAE dtype (env H3_VAE_DTYPE; "
                   "default: fp16 on CUDA, fp32 on CPU)")
    g.add_argument("--vae-tile-size", type=int, default=None, help="video VAE spatial tile in px (env "
                   "H3_VAE_TILE_SIZE; default: the VAE's; 0 = untiled)")
    g = parser.add_argument_group("step cache (opt-in, approximate)")
    g.add_argument("--cache-mode", choices=CACHE_MODES, default="off", help="step cache")
    g.add_argument("--cache-threshold", type=float, default=CACHE_DEFAULTS["threshold"],
                   help="relative change below which a step is reused")
    g.add_argument("--cache-start-percent", type=float, default=CACHE_DEFAULTS["start_percent"],
                   help="fraction of the schedule before which no step is reused")
    g.add_argument("--cache-end-percent", type=float, default=CACHE_DEFAULTS["end_percent"],
                   help="fraction of the schedule after which no step is reused")
    g.add_argument("--cache-subsample-factor", type=int, default=CACHE_DEFAULTS["subsample_factor"],
                   help="spatial subsampling of the change measure (h3_cache)")
    limits.add_arguments(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--progress", action="store_true", help="progress bars on stderr even when it is not a terminal")
    g.add_argument("--profile-memory", action="store_true", help="memory checkpoints per stage in the summary")
    g.add_argument("--ffmpeg-loglevel", choices=FFMPEG_LOGLEVELS, default="error", help="FFmpeg log level")
    g.add_argument("--quiet", "-q", action="store_true", help="print nothing on stdout and no progress (errors only)")


# ---- argument checks (before anything heavy is loaded) -------------------------------------------

def _check_files(args: argparse.Namespace, *, check_output: bool = True) -> None:
    """Every input file exists and reads as what it claims to be; the output can be written. No model is loaded."""
    from h3direct.app.paths import check_input, probe_media, read_text_embeds

    single = [("--checkpoint", args.checkpoint), ("--vae", args.vae), ("--audio-vae", args.audio_vae),
              ("--text-encoder", args.text_encoder)]
    for flag in ("vae_config", "audio_vae_config"):
        v = getattr(args, flag)
        if v is not None and v not in ("tiny", "full"):
            single.append(("--" + flag.replace("_", "-"), v))
    for flag, p in single:
        if p is not None:
            check_input(p, flag)
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise H3Error("--tokenizer: directory not found", path=args.tokenizer)
    media = [("--first-frame", "image", args.first_frame), ("--last-frame", "image", args.last_frame)]
    media += [(f"--ref-{kind}", kind, p) for kind in ("image", "video", "audio")
              for p in getattr(args, f"ref_{kind}")]
    for flag, kind, p in media:
        if p is not None:
            check_input(p, flag)
            probe_media(p, kind, flag)
    if args.text_embeds is not None and not hasattr(args.text_embeds, "states"):
        args.text_embeds_file = args.text_embeds
        args.text_embeds = read_text_embeds(args.text_embeds, "--text-embeds")
    if check_output:
        from h3direct.app.paths import check_output as check_out

        check_out(args.output, "--output")


def _check_text(flag: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise H3Error(f"{flag} is not valid UTF-8 text (undecodable byte at character {e.start}); pass UTF-8") from None


def _check_request(args: argparse.Namespace) -> None:
    import math

    for name in ("width", "height"):
        v = getattr(args, name)
        if v < 32 or v % 32 or v > MAX_SIZE:
            near = min(MAX_SIZE, max(32, round(v / 32) * 32))
            raise H3Error(f"--{name} {v} must be a multiple of 32 in [32, {MAX_SIZE}] (e.g. {near})")
    if not 5 <= args.frames <= MAX_FRAMES:
        raise H3Error(f"--frames {args.frames} must be in [5, {MAX_FRAMES}] (snapped up to 17k+5: 5, 22, 39, ..., 124)")
    if args.steps < 1:
        raise H3Error(f"--steps {args.steps} must be >= 1")
    if not 0 <= args.seed < 2**64:
        raise H3Error(f"--seed {args.seed} must be in [0, 2^64)")
    for flag, value, choices in (("--sampler", args.sampler, SAMPLERS), ("--scheduler", args.scheduler, SCHEDULERS),
                                 ("--cache-mode", args.cache_mode, CACHE_MODES)):
        if value not in choices:
            raise H3Error(f"{flag} {value!r} is not supported; use one of {', '.join(choices)}")
    for name in ("cfg", "cache_threshold", "cache_start_percent", "cache_end_percent"):
        v = getattr(args, name)
        if not math.isfinite(v):
            raise H3Error(f"--{name.replace('_', '-')} {v} is not a finite number")
    if args.cfg <= 0:
        raise H3Error(f"--cfg {args.cfg} must be > 0 (1 = no guidance)")
    if args.cache_mode != "off":
        from h3direct.sampling.caches import CacheSettings

        try:
            CacheSettings(args.cache_mode, args.cache_threshold, args.cache_start_percent, args.cache_end_percent,
                          args.cache_subsample_factor)
        except H3Error as e:  # its message names its fields; say which flags they are
            raise H3Error(f"--cache-*: {e}") from None
    if args.threads is not None and args.threads < 1:
        raise H3Error(f"--threads {args.threads} must be >= 1")
    if args.mlp_chunks < 1:
        raise H3Error(f"--mlp-chunks {args.mlp_chunks} must be >= 1")
    if args.ffmpeg_loglevel not in FFMPEG_LOGLEVELS:
        raise H3Error(f"--ffmpeg-loglevel {args.ffmpeg_loglevel!r}: use one of {', '.join(FFMPEG_LOGLEVELS)}")
    if args.vae_dtype not in (None, *VAE_DTYPES):
        raise H3Error(f"VAE dtype {args.vae_dtype!r} (--vae-dtype / H3_VAE_DTYPE) must be fp32 or fp16")
    if args.vae_tile_size is not None and args.vae_tile_size < 0:
        raise H3Error(f"VAE tile size {args.vae_tile_size} (--vae-tile-size / H3_VAE_TILE_SIZE) must be >= 0")
    refs = args.ref_image or args.ref_video or args.ref_audio
    if refs and (args.first_frame or args.last_frame):
        raise H3Error("--first-frame/--last-frame (fl2va) and --ref-* (ref2va) are separate tasks; give one kind")
    for kind, cap in REF_CAPS.items():
        n = len(getattr(args, f"ref_{kind}"))
        if n > cap:
            raise H3Error(f"--ref-{kind} given {n} times; H3 takes at most {cap}")
    if args.vae_config and not args.vae:
        raise H3Error("--vae-config describes --vae; give --vae too (the bundled VAE has its own config)")
    if args.audio_vae_config and not args.audio_vae:
        raise H3Error("--audio-vae-config describes --audio-vae; give --audio-vae too")
    _check_text("--prompt", args.prompt)
    _check_text("--negative-prompt", args.negative_prompt)


def resolve_args(args: argparse.Namespace, notes: list | None = None, *, check_output: bool = True,
                 limits=None) -> argparse.Namespace:
    """Fill environment-backed and size defaults, then validate (raises H3Error) — all before any compute.

    `notes` collects what the user should be told (a defaulted size with --checkpoint, a snapped frame count);
    `limits` (an `app.limits.Limits`; default: the args' --max-* flags) bounds the request."""
    from h3direct.app import bundled
    from h3direct.app import limits as lim
    from h3direct.vae.config import video_vae_settings

    args.vae_dtype, args.vae_tile_size = video_vae_settings(args.vae_dtype, args.vae_tile_size)
    defaults = {"width": bundled.DEFAULT_WIDTH, "height": bundled.DEFAULT_HEIGHT,
                "frames": bundled.DEFAULT_FRAMES, "steps": bundled.DEFAULT_STEPS}
    missing = [k for k in defaults if getattr(args, k) is None]
    for k in missing:
        setattr(args, k, defaults[k])
    if notes is not None and missing and args.checkpoint is not None:
        notes.append(f"no --{'/--'.join(missing)}: using {args.width}x{args.height}, {args.frames} frames, "
                     f"{args.steps} steps (small defaults; full size is usually 1344x768, 124 frames, 8 steps)")
    _check_request(args)
    if limits is None:
        limits = lim.Limits.from_args(args) if hasattr(args, "max_steps") else lim.Limits()
    lim.check(limits, steps=args.steps, frames=args.frames, width=args.width, height=args.height,
              prompts={"prompt": args.prompt, "negative_prompt": args.negative_prompt},
              references=len(args.ref_image) + len(args.ref_video) + len(args.ref_audio))
    _check_files(args, check_output=check_output)
    if notes is not None:  # after every check: the grid's module imports torch, which a refusal need not pay
        from h3direct.sampling.conditioning import align_frame_count

        snapped = align_frame_count(args.frames)
        if snapped != args.frames:
            notes.append(f"--frames {args.frames} snapped up to {snapped} (the model's 17k+5 frame grid)")
    return args


# ---- run -----------------------------------------------------------------------------------------

class Progress:
    """tqdm bars on stderr for each long stage of one generation: text encode, sampling steps, video decode (per
    tile), audio decode and the mp4 write. `stage(name)` / `step(event)` are the pipeline's hooks; a disabled one
    draws nothing."""

    LABELS = {"text_encode": "text encode", "decode_video": "decode video", "decode_audio": "decode audio",
              "write": "write mp4"}

    def __init__(self, steps: int, enabled: bool):
        self.enabled, self.steps = enabled, steps
        self._bar = None
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:  # plain lines instead
                self._tqdm = None

    def _open(self, desc: str, total: int, unit: str):
        import sys

        self.close()
        if self._tqdm is not None:
            self._bar = self._tqdm(total=total, file=sys.stderr, unit=unit, desc=desc, leave=True)
        else:
            print(f"h3direct generate: {desc}", file=sys.stderr, flush=True)

    def stage(self, name: str) -> None:
        if not self.enabled:
            return
        if name == "sample":
            self._open("sampling", self.steps, "step")
        elif name == "decode_video":
            self._open(self.LABELS[name], None, "tile")
        elif name == "decode_video:tile":
            if self._bar is not None:
                self._bar.update(1)
        elif name in self.LABELS:
            self._open(self.LABELS[name], 1, "stage")
        else:
            self.close()

    def step(self, ev) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"σ={ev.sigma:.4f} {ev.seconds:.2f}s", refresh=False)
            self._bar.update(1)
        else:
            import sys

            print(f"step {ev.index + 1}/{ev.total} sigma {ev.sigma:.4f} {ev.seconds:.3f}s", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            if self._bar.unit == "stage" and self._bar.n < self._bar.total:
                self._bar.update(self._bar.total - self._bar.n)
            self._bar.close()
            self._bar = None


def run(args: argparse.Namespace) -> int:
    import torch

    threads = torch.get_num_threads()
    try:
        return _generate(args)
    finally:
        torch.set_num_threads(threads)  # leave the process as found (the CLI may run in-process, e.g. in tests)


def load_pipeline(args: argparse.Namespace, *, text_encoder_always: bool = False):
    """Resolve device, dtype, threads and the bundled fallbacks, then load the models once.

    Returns (pipeline, sources, seconds {"bundle", "load", "load_<model>"}, peak memory after loading).
    `text_encoder_always`: load a text encoder even when --text-embeds is given (a server serves both kinds)."""
    import time

    import torch

    from h3direct.app import bundled
    from h3direct.app.pipeline import H3Pipeline, peak_memory, resolve_device
    from h3direct.dit.attention import check_backend

    device = resolve_device(args.device)
    args.compute_dtype = args.compute_dtype or ("bf16" if device.type == "cuda" else "fp32")
    compute_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.compute_dtype]
    check_backend(args.attention, torch.empty(0, device=device, dtype=compute_dtype))  # before any model is loaded
    all_bundled = not (args.checkpoint or args.vae or args.audio_vae or args.text_encoder)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif all_bundled and device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)  # tiny tensors: OpenMP threads cost more than they give (10x on a busy CPU)
    need_te = text_encoder_always or getattr(args, "text_embeds", None) is None
    seconds = {}
    b = None
    t = time.perf_counter()
    if not (args.checkpoint and args.vae and args.audio_vae and (args.text_encoder or not need_te)):
        b = bundled.ensure()  # made on first use (seconds), then read from the cache
    seconds["bundle"] = round(time.perf_counter() - t, 4)
    te = args.text_encoder or (b.text_encoder if need_te else None)
    tokenizer = args.tokenizer if args.text_encoder else (b.tokenizer if need_te else None)
    vae_cfg = args.vae_config if args.vae else b.video_vae_config
    avae_cfg = (args.audio_vae_config or args.vae_config) if args.audio_vae else b.audio_vae_config
    sources = {"dit": args.checkpoint or "bundled", "video_vae": args.vae or "bundled",
               "audio_vae": args.audio_vae or "bundled",
               "text_encoder": args.text_encoder or ("bundled" if need_te else None)}
    t = time.perf_counter()
    pipe = H3Pipeline.from_files(args.checkpoint or b.dit, args.vae or b.video_vae, args.audio_vae or b.audio_vae,
                                 te, tokenizer=tokenizer, video_vae_config=vae_cfg, audio_vae_config=avae_cfg,
                                 compute_dtype=args.compute_dtype, nvfp4_mode=args.nvfp4_mode, device=device,
                                 attention=args.attention, vae_dtype=args.vae_dtype,
                                 vae_tile_size=args.vae_tile_size, mlp_chunks=args.mlp_chunks, sources=sources,
                                 fp8_linear=getattr(args, "fp8_linear", "off"))
    seconds["load"] = round(time.perf_counter() - t, 4)
    seconds.update({f"load_{k}": round(v, 4) for k, v in pipe.load_seconds.items()})
    return pipe, sources, seconds, peak_memory(device)[0]


def generate_clip(pipe, args: argparse.Namespace, callback=None, on_stage=None, output=None):
    """One request on a loaded pipeline: generate, write the mp4 atomically (to `output`, default args.output) with
    its provenance in the container's `comment` tag. Returns (Result, path, write seconds)."""
    import json
    import time

    from h3direct.app import provenance
    from h3direct.app.pipeline import video_soundtrack
    from h3direct.dit import parallel
    from h3direct.sampling.caches import CacheSettings
    from h3direct.vae.mp4 import write_mp4

    cache = None
    if args.cache_mode != "off":
        cache = CacheSettings(args.cache_mode, args.cache_threshold, args.cache_start_percent,
                              args.cache_end_percent, args.cache_subsample_factor)
    res = pipe.generate(args.prompt, text_embeds=args.text_embeds, negative_prompt=args.negative_prompt,
                        width=args.width, height=args.height, frames=args.frames, steps=args.steps,
                        seed=args.seed, ref_images=args.ref_image, ref_videos=args.ref_video,
                        ref_video_audios=[video_soundtrack(p) for p in args.ref_video],
                        ref_audios=args.ref_audio, first_frame=args.first_frame, last_frame=args.last_frame,
                        ref_image_size=args.ref_image_size, sampler=args.sampler, scheduler=args.scheduler,
                        cfg=args.cfg, cache=cache, callback=callback, on_stage=on_stage)
    if on_stage is not None:
        on_stage("write")
    t = time.perf_counter()
    meta = {"comment": json.dumps(provenance_of(args, pipe), separators=(",", ":"), ensure_ascii=False),
            "encoder": f"h3direct {provenance.version()}"}
    out = output or args.output
    if parallel.is_writer():  # under torchrun every rank holds the same clip; rank 0 writes it
        out = write_mp4(out, res.frames, res.fps, res.audio, res.sample_rate, loglevel=args.ffmpeg_loglevel,
                        metadata=meta)
    if on_stage is not None:
        on_stage("done")
    return res, out, time.perf_counter() - t


def provenance_of(args: argparse.Namespace, pipe) -> dict:
    """What the clip was made from (also in the mp4's comment tag): enough to make it again."""
    from h3direct.app import provenance

    refs = [(f"--{k.replace('_', '-')}", p) for k in ("ref_image", "ref_video", "ref_audio")
            for p in getattr(args, k)]
    refs += [(f"--{k.replace('_', '-')}", getattr(args, k)) for k in ("first_frame", "last_frame")
             if getattr(args, k)]
    embeds = getattr(args, "text_embeds_file", None)
    if embeds:
        refs.append(("--text-embeds", embeds))
    return {"h3direct": provenance.version(), "prompt": args.prompt, "negative_prompt": args.negative_prompt,
            "seed": args.seed, "width": args.width, "height": args.height, "frames": args.frames,
            "steps": args.steps, "sampler": args.sampler, "scheduler": args.scheduler, "cfg": args.cfg,
            "attention": args.attention, "cache_mode": args.cache_mode,
            **({"fp8_linear": args.fp8_linear} if getattr(args, "fp8_linear", "off") != "off" else {}),
            "references": provenance.references(refs), "weights": provenance.weights(pipe.files)}


def summary_of(args: argparse.Namespace, res, out, pipe, sources: dict, timings: dict, load_memory: int) -> dict:
    """The one-line JSON summary of a generation (shared by the CLI and the HTTP service)."""
    import torch

    from h3direct.app.pipeline import peak_memory

    peak, kind = peak_memory(pipe.device)
    summary = {
        "output": os.path.abspath(out), "task": res.task, "frames": res.frame_count, "fps": res.fps, "width": res.width,
        "height": res.height, "audio_samples": int(res.audio.shape[0]), "sample_rate": res.sample_rate,
        "seconds_of_video": round(res.frame_count / res.fps, 4),
        "steps": res.steps, "seed": args.seed, "sampler": args.sampler, "scheduler": args.scheduler, "cfg": args.cfg,
        "cache_mode": args.cache_mode, "reused_steps": res.reused_steps,
        "timings": timings, "peak_memory_bytes": peak, "peak_memory_kind": kind,
        "device": str(pipe.device), "compute_dtype": args.compute_dtype,
        "vae_dtype": str(pipe.vae_dtype).replace("torch.", ""),
        "attention": args.attention, "cpu_threads": torch.get_num_threads(), "models": sources,
        "provenance": provenance_of(args, pipe),
    }
    from h3direct.dit.attention import attention_stats

    if attention_stats():  # backends that count their calls (sol_attn: kernel vs documented fallback)
        summary["attention_calls"] = attention_stats()
    fp8 = getattr(args, "fp8_linear", "off")
    if fp8 != "off":  # opt-in approximate path: its mode and how its GEMMs ran (scaled_mm vs emulated, with why)
        from h3direct.checkpoint.quant.w8a8 import fp8_linear_stats

        summary["fp8_linear"] = {"mode": fp8, "calls": fp8_linear_stats()}
    if res.frame_count != args.frames:
        summary["frames_requested"] = args.frames
    if args.progress:
        summary["step_seconds"] = [round(s, 4) for s in res.step_seconds]
    if args.profile_memory:
        summary["memory"] = {"load": load_memory, **res.memory, "write": peak}
    return summary


def _generate(args: argparse.Namespace) -> int:
    import sys
    import time

    from h3direct.dit import parallel

    t_start = time.perf_counter()
    notes: list[str] = []
    resolve_args(args, notes)  # every check before any model is loaded
    if not args.quiet:
        for n in notes:
            print(f"h3direct generate: note: {n}", file=sys.stderr, flush=True)
    sp = parallel.init_from_env(args.sequence_parallel, args.device)  # under torchrun: join its process group
    try:
        return _generate_on(args, sp, t_start)
    finally:
        parallel.shutdown()


def _generate_on(args: argparse.Namespace, sp, t_start: float) -> int:
    import json
    import sys
    import time

    from h3direct.dit import parallel

    if sp is not None:
        args.device = str(sp.device)  # each rank on its own GPU (cuda:LOCAL_RANK)
    pipe, sources, seconds, load_mem = load_pipeline(args)
    progress = Progress(args.steps, args.progress or (not args.quiet and sys.stderr.isatty()))
    try:
        res, out, write_s = generate_clip(pipe, args, callback=progress.step, on_stage=progress.stage)
    finally:
        progress.close()
    timings = {**seconds, **res.timings, "write": round(write_s, 4),
               "total": round(time.perf_counter() - t_start, 4)}
    summary = summary_of(args, res, out, pipe, sources, timings, load_mem)
    if sp is not None:
        summary.update(parallel.manifest_fields())
    if not args.quiet and parallel.is_writer():
        print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0
