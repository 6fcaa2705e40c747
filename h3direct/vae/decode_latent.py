"""`h3direct decode-latent LATENT --out clip.mp4`: decode a video latent (+ optional audio latent) to an mp4.

LATENT is a safetensors file with a normalised video latent [1, 24, t, h, w] (or [24, t, h, w]) named `video_latent`
(also accepted: `latent`, `samples`, `video`) and optionally an audio latent [1, 32, 2, t'] named `audio_latent`
(or `audio`). Output: H.264 at 24 fps, AAC stereo at 32 kHz, written atomically. Prints one JSON line.
"""

from __future__ import annotations

import argparse

from h3direct.vae.config import VAE_DTYPES

VIDEO_NAMES = ("video_latent", "latent", "samples", "video")
AUDIO_NAMES = ("audio_latent", "audio")
FPS = 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("latent", help="safetensors with video_latent [1,24,t,h,w] (+ audio_latent [1,32,2,t'])")
    parser.add_argument("--output", "-o", "--out", dest="out", required=True, metavar="FILE.mp4",
                        help="mp4 to write (--out is an old spelling)")
    parser.add_argument("--vae", required=True, help="video VAE safetensors (ComfyUI keys)")
    parser.add_argument("--vae-config", help="constructor args JSON (vae_config_public.json layout), else real sizes")
    parser.add_argument("--audio-vae", help="audio VAE safetensors; required when the file has an audio latent")
    parser.add_argument("--vae-dtype", choices=VAE_DTYPES, default=None,
                        help="video VAE compute dtype (env H3_VAE_DTYPE; default fp16 on CUDA, fp32 on CPU)")
    parser.add_argument("--vae-tile-size", type=int, default=None,
                        help="spatial tile size in px (env H3_VAE_TILE_SIZE; default: the VAE's, 256; 0 = untiled)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--ffmpeg-loglevel", default="error", help="FFmpeg log level (quiet, error, warning, info)")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")


def _pick(tensors: dict, names: tuple[str, ...]):
    for n in names:
        if n in tensors:
            return n, tensors[n]
    return None, None


def run(args: argparse.Namespace) -> int:
    import json
    import time

    import torch
    from safetensors.torch import load_file

    from h3direct.errors import H3Error
    from h3direct.vae.api import decode_audio, decode_video
    from h3direct.vae.config import AudioVAEConfig, VideoVAEConfig, video_vae_settings
    from h3direct.vae.loader import load_audio_vae, load_video_vae, read_constructor_args
    from h3direct.vae.mp4 import pixels_to_uint8, write_mp4

    t0 = time.perf_counter()
    vae_dtype, tile = video_vae_settings(args.vae_dtype, args.vae_tile_size)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp32": torch.float32, "fp16": torch.float16, None: None}[vae_dtype]
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32

    try:
        tensors = load_file(args.latent)
    except FileNotFoundError:
        raise H3Error("no such latent file", path=args.latent) from None
    vname, video = _pick(tensors, VIDEO_NAMES)
    if video is None:
        raise H3Error(f"no video latent (tried {', '.join(VIDEO_NAMES)}; found {', '.join(sorted(tensors))})",
                      path=args.latent)
    aname, audio = _pick(tensors, AUDIO_NAMES)
    video = video[None] if video.ndim == 4 else video
    if video.ndim != 5 or video.shape[0] != 1:
        raise H3Error(f"{vname} must be one clip [1, C, t, h, w], got {list(video.shape)}", path=args.latent)
    if audio is not None:
        audio = audio[None] if audio.ndim == 3 else audio
        if audio.ndim != 4 or audio.shape[0] != 1:
            raise H3Error(f"{aname} must be [1, C, 2, t], got {list(audio.shape)}", path=args.latent)
        if not args.audio_vae:
            raise H3Error(f"the file has an audio latent ({aname}); pass --audio-vae", path=args.latent)

    ctor = read_constructor_args(args.vae_config)
    vae = load_video_vae(args.vae, VideoVAEConfig.from_constructor_args(ctor), dtype=dtype, device=device)
    frames = pixels_to_uint8(decode_video(vae, video, dtype=dtype, tile_size=tile)[0])
    del vae
    wave = None
    sample_rate = 32000
    if audio is not None:
        avae = load_audio_vae(args.audio_vae, AudioVAEConfig.from_constructor_args(ctor), device=device)
        sample_rate = avae.cfg.sample_rate
        wave = decode_audio(avae, audio)[0].cpu().numpy()
    out = write_mp4(args.out, frames, FPS, wave, sample_rate, loglevel=args.ffmpeg_loglevel)
    if not args.quiet:
        print(json.dumps({
            "out": str(out), "frames": int(frames.shape[0]), "width": int(frames.shape[2]),
            "height": int(frames.shape[1]), "fps": FPS, "audio_samples": None if wave is None else int(wave.shape[0]),
            "sample_rate": sample_rate if wave is not None else None, "vae_dtype": str(dtype).replace("torch.", ""),
            "device": str(device), "seconds": round(time.perf_counter() - t0, 3)}))
    return 0
