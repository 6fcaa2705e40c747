"""Decode a video latent (+ optional audio latent) file to an mp4 (`h3direct decode-latent`; its command line:
`app/cli_decode.py`).

The file is a safetensors with a normalised video latent [1, 24, t, h, w] (or [24, t, h, w]) named `video_latent`
(also accepted: `latent`, `samples`, `video`) and optionally an audio latent [1, 32, 2, t'] named `audio_latent` (or
`audio`), as `h3direct generate --save-latent F` writes it. Output: H.264 at 24 fps, AAC stereo at 32 kHz, written
atomically. The latents are checked against the VAEs' configs before anything is decoded.
"""

from __future__ import annotations

import time

from h3direct.errors import H3Error

VIDEO_NAMES = ("video_latent", "latent", "samples", "video")
AUDIO_NAMES = ("audio_latent", "audio")
FPS = 24


def _pick(tensors: dict, names: tuple[str, ...]):
    for n in names:
        if n in tensors:
            return n, tensors[n]
    return None, None


def read_latents(path):
    """(video latent [1, C, t, h, w], audio latent [1, C, 2, t'] or None) of a latent file."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise H3Error("no such latent file", path=path) from None
    vname, video = _pick(tensors, VIDEO_NAMES)
    if video is None:
        raise H3Error(f"no video latent (tried {', '.join(VIDEO_NAMES)}; found {', '.join(sorted(tensors))})",
                      path=path)
    aname, audio = _pick(tensors, AUDIO_NAMES)
    video = video[None] if video.ndim == 4 else video
    if video.ndim != 5 or video.shape[0] != 1:
        raise H3Error(f"{vname} must be one clip [1, C, t, h, w], got {list(video.shape)}", path=path)
    if audio is not None:
        audio = audio[None] if audio.ndim == 3 else audio
        if audio.ndim != 4 or audio.shape[0] != 1:
            raise H3Error(f"{aname} must be [1, C, 2, t], got {list(audio.shape)}", path=path)
    return video, audio


def check_fits(video, audio, video_cfg, audio_cfg, path) -> None:
    """H3Error (one line) unless the latents have the VAEs' latent channels (before anything is decoded)."""
    if video.shape[1] != video_cfg.embed_dim:
        raise H3Error(f"the video latent {list(video.shape)} has {video.shape[1]} channels; this video VAE decodes "
                      f"{video_cfg.embed_dim} (another VAE or --vae-config?)", path=path)
    if audio is not None and audio.shape[1] != audio_cfg.vae_latent_channels:
        raise H3Error(f"the audio latent {list(audio.shape)} has {audio.shape[1]} channels; this audio VAE decodes "
                      f"{audio_cfg.vae_latent_channels} (another VAE or --vae-config?)", path=path)


def decode(*, latent, out, video_vae, audio_vae=None, video_config=None, audio_config=None, vae_dtype=None,
           vae_tile_size=None, device=None, ffmpeg_loglevel: str = "error") -> dict:
    """Decode the latent file `latent` with the VAE files (their configs: presets, JSON files or None for the
    released sizes) to the mp4 `out`; returns the summary. An audio latent needs `audio_vae`."""
    import torch

    from h3direct.vae.api import decode_audio, decode_video_frames
    from h3direct.vae.config import resolve_vae_config
    from h3direct.vae.loader import load_audio_vae, load_video_vae
    from h3direct.vae.mp4 import Mp4Stream, pixels_to_uint8

    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp32": torch.float32, "fp16": torch.float16, None: None}[vae_dtype]
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    video, audio = read_latents(latent)
    if audio is not None and audio_vae is None:
        raise H3Error("the file has an audio latent; pass --audio-vae", path=latent)
    vcfg = resolve_vae_config("video", video_config)
    acfg = resolve_vae_config("audio", audio_config)
    check_fits(video, audio, vcfg, acfg, latent)
    vae = load_video_vae(video_vae, vcfg, dtype=dtype, device=dev)
    sample_rate = acfg.sample_rate if audio is not None else None
    with Mp4Stream(out, FPS, sample_rate=sample_rate, loglevel=ffmpeg_loglevel) as stream:
        shape = None
        for px in decode_video_frames(vae, video, dtype=dtype, tile_size=vae_tile_size):  # encoded as decoded
            frames = pixels_to_uint8(px[0])
            stream.add(frames)
            shape = frames.shape
        del vae
        wave = None
        if audio is not None:
            avae = load_audio_vae(audio_vae, acfg, device=dev)
            wave = decode_audio(avae, audio)[0].cpu().numpy()
        path = stream.finish(wave)
    return {"out": str(path), "frames": stream.frames, "width": int(shape[2]), "height": int(shape[1]), "fps": FPS,
            "audio_samples": None if wave is None else int(wave.shape[0]), "sample_rate": sample_rate,
            "vae_dtype": str(dtype).replace("torch.", ""), "device": str(dev),
            "seconds": round(time.perf_counter() - t0, 3)}
