"""`h3direct decode-latent LATENT -o clip.mp4`: the command line's edge of `vae.decode_latent.decode`.

The VAEs default to the bundled tiny ones (what `h3direct generate --save-latent F` used with no model flags); a
given VAE's config defaults to the preset (tiny or full) whose shapes its file has, and `--vae-config` takes a
preset or a JSON file, as `h3direct generate` does. Every file is checked (headers, kinds, the latents against the
VAEs' configs) before anything is decoded.
"""

from __future__ import annotations

import argparse

from h3direct.app.cli_flags import FFMPEG_LOGLEVELS, HelpFormatter, add_fields, given

VAE_FLAGS = ("vae", "vae_config", "audio_vae", "audio_vae_config", "vae_dtype", "vae_tile_size", "device", "threads")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from h3direct.app.models import ModelSpec

    parser.formatter_class = HelpFormatter
    parser.add_argument("latent", help="safetensors with video_latent [1,24,t,h,w] (+ audio_latent [1,32,2,t']), "
                        "e.g. from h3direct generate --save-latent F")
    parser.add_argument("--output", "-o", "--out", dest="out", required=True, metavar="FILE.mp4",
                        help="mp4 to write (--out is an old spelling)")
    add_fields(parser, ModelSpec, VAE_FLAGS, env=True)
    parser.add_argument("--ffmpeg-loglevel", choices=FFMPEG_LOGLEVELS, default="error", help="FFmpeg log level")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")


def run(args: argparse.Namespace) -> int:
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    import json

    from h3direct.app import bundled, env
    from h3direct.app.models import ModelSpec, set_threads, vae_config
    from h3direct.app.pipeline import resolve_device
    from h3direct.vae.decode_latent import decode

    fields = {**env.read_settings(), **given(args, VAE_FLAGS)}
    fields.pop("tokenizer", None)
    spec = ModelSpec(**fields)  # files, headers, kinds and configs checked here
    b = None if spec.vae and spec.audio_vae else bundled.ensure()
    set_threads(spec, resolve_device(spec.device))
    summary = decode(latent=args.latent, out=args.out, video_vae=spec.vae or b.video_vae,
                     audio_vae=spec.audio_vae or (b.audio_vae if spec.vae is None else None),
                     video_config=vae_config(spec, "video", b), audio_config=vae_config(spec, "audio", b),
                     vae_dtype=spec.vae_dtype, vae_tile_size=spec.vae_tile_size, device=spec.device,
                     ffmpeg_loglevel=args.ffmpeg_loglevel)
    if not args.quiet:
        print(json.dumps(summary))
    return 0
