"""Public VAE entry points: `decode_video` (and `decode_video_frames`, the same chunk by chunk), `encode_video`,
`decode_audio`, `encode_audio`.

They reproduce what ComfyUI's `comfy.sd.VAE.decode` / `.encode` do for the H3 VAEs:

- video decode: latent (normalised) -> cast to the compute dtype -> ×latents_std + latents_mean -> temporal chunks ->
  spatial tiles -> raw ImageNet-normalised pixels -> ×std + mean in float32, clamped to [0, 1] -> [B, T, H, W, 3].
- video encode: pixels [T, H, W, C] in [0, 1] -> centre-crop H, W to multiples of 16 -> ×2−1 -> compute dtype ->
  ImageNet normalisation -> clips / tiles -> posterior mean (float32) -> (mean − latents_mean) / latents_std.
- audio (fp32 only, 32 kHz, 800 samples per latent frame): stereo channels run as a batch of mono signals;
  encode centre-crops the waveform to a multiple of 800 samples first.

Tile geometry matters: the ViT decoder's rope positions are the cell centres of the *tile* normalised to
[-1, 1] (not of the whole frame), and tiles are stitched with linear blends. A different `tile_size` or
`tile_overlap` therefore gives a (slightly) different picture; to match ComfyUI use the checkpoint's defaults
(256-px tiles, at least 64-px overlap for the released VAE), which is what `tile_size=None` does.

fp16: ComfyUI runs the video VAE in fp16 on GPUs with no fp32 islands; an fp16 overflow would surface as
Inf/NaN (the clamp to [0, 1] would hide Inf). Every tile's raw output is checked and a non-finite value raises
`H3Error` asking for fp32 instead of returning a silently broken clip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from h3direct.errors import H3Error
from h3direct.vae.audio import AudioVAE
from h3direct.vae.config import PIXEL_MEAN, PIXEL_STD, check_tile_geometry
from h3direct.vae.video import VideoVAE
from h3direct.vae.video_tiling import decode_chunked, decoded_parts, encode_chunked, split_tiles, tiled

VIDEO_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, vae: torch.nn.Module) -> torch.dtype:
    if dtype is None:
        return next(vae.parameters()).dtype
    if isinstance(dtype, str):
        if dtype not in VIDEO_DTYPES:
            raise H3Error(f"VAE dtype {dtype!r} is not one of fp32, fp16")
        return VIDEO_DTYPES[dtype]
    if dtype not in (torch.float32, torch.float16):
        raise H3Error(f"VAE dtype {dtype} is not supported (fp32 or fp16)")
    return dtype


def _prepare(vae: VideoVAE, dtype) -> torch.dtype:
    """Cast the VAE in place to the compute dtype (like `comfy.sd.VAE(dtype=...)`; fp32 -> fp16 -> fp32 is lossy
    for weights that were not fp16 to begin with)."""
    dtype = resolve_dtype(dtype, vae)
    if vae.dtype != dtype:
        vae.set_compute_dtype(dtype)
    return dtype


def _pixel_stats(dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet mean/std [1, 3, 1, 1, 1] rounded through the compute dtype (ComfyUI keeps them as cast buffers)."""
    mean = torch.tensor(PIXEL_MEAN).view(1, 3, 1, 1, 1).to(dtype).to(device)
    std = torch.tensor(PIXEL_STD).view(1, 3, 1, 1, 1).to(dtype).to(device)
    return mean, std


def _checked(fn, what: str, dtype: torch.dtype):
    def run(x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        if not torch.isfinite(y).all():
            hint = "; rerun with fp32 (--vae-dtype fp32 / H3_VAE_DTYPE=fp32)" if dtype == torch.float16 else ""
            raise H3Error(f"video VAE {what} produced non-finite values in {str(dtype).replace('torch.', '')} "
                          f"(tile of shape {list(x.shape)}){hint}")
        return y

    return run


def _tile_geometry(vae: VideoVAE, tile_size: int | None, tile_overlap: int | None) -> tuple[int, int] | None:
    cfg = vae.cfg
    if tile_size == 0 or (tile_size is None and not cfg.tiling):
        return None
    size = cfg.tile_size if tile_size is None else tile_size
    overlap = cfg.tile_overlap_min if tile_overlap is None else tile_overlap
    if tile_overlap is None and overlap >= size:
        overlap = max(cfg.vae_ratio, size // 4 // cfg.vae_ratio * cfg.vae_ratio)
    check_tile_geometry(size, overlap, cfg.vae_ratio)
    return size, overlap


@torch.inference_mode()
def decode_video(vae: VideoVAE, latent: torch.Tensor, dtype: torch.dtype | str | None = None,
                 tile_size: int | None = None, tile_overlap: int | None = None,
                 on_tile: Callable[[], None] | None = None) -> torch.Tensor:
    """Normalised latent [B, 24, t, h, w] -> pixels [B, T, 16h, 16w, 3] float32 in [0, 1].

    `dtype`: compute dtype (fp32 / fp16; default: the VAE's). `tile_size` / `tile_overlap`: spatial tile geometry in
    px (default: the config's, 256 / 64 for the released VAE; 0 = no tiling). T = 1 for t = 1, else 17k+5 for
    t = 5k+2 (see `video_tiling.plan_decode`). `on_tile()` is called after each decoder call (a spatial tile of a
    temporal chunk): progress, and a place where a caller may raise to abandon the decode.
    """
    z, decode_fn, finalize = _video_decoder(vae, latent, dtype, tile_size, tile_overlap, on_tile)
    return decode_chunked(z, decode_fn, finalize, vae.cfg).movedim(1, -1)


def decode_video_frames(vae: VideoVAE, latent: torch.Tensor, dtype: torch.dtype | str | None = None,
                        tile_size: int | None = None, tile_overlap: int | None = None,
                        on_tile: Callable[[], None] | None = None) -> Iterator[torch.Tensor]:
    """`decode_video` chunk by chunk: pixels [B, n, 16h, 16w, 3] float32 in [0, 1] of each temporal chunk, in order,
    as soon as they are final; together bit for bit the frames `decode_video` returns, and the whole clip is never
    held at once. The latent is checked when this is called, the decoding runs as the chunks are taken."""
    with torch.inference_mode():
        z, decode_fn, finalize = _video_decoder(vae, latent, dtype, tile_size, tile_overlap, on_tile)
    return _chunks(z, decode_fn, finalize, vae.cfg)


@torch.inference_mode()
def _chunks(z, decode_fn, finalize, cfg) -> Iterator[torch.Tensor]:
    for part in decoded_parts(z, decode_fn, finalize, cfg):
        yield part.movedim(1, -1)


def _video_decoder(vae: VideoVAE, latent: torch.Tensor, dtype, tile_size: int | None, tile_overlap: int | None,
                   on_tile: Callable[[], None] | None):
    """(de-normalised latent, decode of one temporal chunk (tiled, checked), finalize) of a video decode."""
    cfg = vae.cfg
    if latent.ndim != 5 or latent.shape[1] != cfg.embed_dim:
        raise H3Error(f"video latent must be [B, {cfg.embed_dim}, t, h, w], got {list(latent.shape)}")
    dtype = _prepare(vae, dtype)
    geometry = _tile_geometry(vae, tile_size, tile_overlap)
    z = latent.to(device=vae.device, dtype=dtype)
    z = z * vae.latents_std.view(1, -1, 1, 1, 1).to(dtype) + vae.latents_mean.view(1, -1, 1, 1, 1).to(dtype)

    one = _checked(vae.decode_pixels, "decode", dtype)
    if on_tile is not None:
        decode_one = one

        def one(zc: torch.Tensor) -> torch.Tensor:
            out = decode_one(zc)
            on_tile()
            return out

    if geometry is None:
        decode_fn = one
    else:
        r = cfg.vae_ratio
        ys = split_tiles(z.shape[-2] * r, *geometry, r)
        xs = split_tiles(z.shape[-1] * r, *geometry, r)
        decode_fn = lambda zc: tiled(zc, one, ys, xs, in_div=r, out_div=1)  # noqa: E731
    mean, std = _pixel_stats(dtype, z.device)
    mean32, std32 = mean.float(), std.float()

    def finalize(raw: torch.Tensor) -> torch.Tensor:
        return (raw * std32 + mean32).clamp_(0.0, 1.0)

    return z, decode_fn, finalize


def crop_to_multiple(x: torch.Tensor, dims: tuple[int, ...], m: int) -> torch.Tensor:
    """Centre-crop each of `dims` down to a multiple of m (offset (n mod m) // 2), as ComfyUI's encode does."""
    for d in dims:
        n = x.shape[d]
        keep = n // m * m
        if keep != n:
            x = x.narrow(d, (n % m) // 2, keep)
    return x


@torch.inference_mode()
def encode_video(vae: VideoVAE, pixels: torch.Tensor, dtype: torch.dtype | str | None = None,
                 tile_size: int | None = None, tile_overlap: int | None = None) -> torch.Tensor:
    """Frames [T, H, W, C] in [0, 1] -> normalised latent [1, 24, t, H//16, W//16] float32.

    T frames give t = 1 (T = 1) or 5·ceil(T/17) − 3 latent frames (17k+5 frames -> 5k+2).
    """
    cfg = vae.cfg
    if pixels.ndim != 4 or pixels.shape[-1] < cfg.in_channels:
        raise H3Error(f"pixels must be [T, H, W, {cfg.in_channels}] in [0, 1], got {list(pixels.shape)}")
    pixels = crop_to_multiple(pixels, (1, 2), cfg.vae_ratio)[..., : cfg.in_channels]
    if pixels.shape[1] == 0 or pixels.shape[2] == 0:
        raise H3Error(f"frames of {list(pixels.shape[1:3])} px are smaller than one {cfg.vae_ratio}-px latent cell")
    dtype = _prepare(vae, dtype)
    geometry = _tile_geometry(vae, tile_size, tile_overlap)
    x = (pixels.movedim(-1, 0).unsqueeze(0) * 2.0 - 1.0).to(device=vae.device, dtype=dtype)
    mean, std = _pixel_stats(dtype, x.device)
    x = (x + 1.0) * 0.5
    x = (x - mean) / std

    one = _checked(vae.encode_moments, "encode", dtype)
    if geometry is None:
        encode_fn = one
    else:
        r = cfg.vae_ratio
        ys = split_tiles(x.shape[-2], *geometry, r)
        xs = split_tiles(x.shape[-1], *geometry, r)
        encode_fn = lambda xc: tiled(xc, one, ys, xs, in_div=1, out_div=r)  # noqa: E731
    moments = encode_chunked(x, encode_fn, cfg)
    mu = moments.float()[:, : cfg.embed_dim]
    return (mu - vae.latents_mean.float().view(1, -1, 1, 1, 1)) / vae.latents_std.float().view(1, -1, 1, 1, 1)


@torch.inference_mode()
def decode_audio(vae: AudioVAE, latent: torch.Tensor) -> torch.Tensor:
    """Normalised latent [B, 32, 2, t] -> stereo waveform [B, 800·t, 2] float32 in [-1, 1] at 32 kHz (fp32 only)."""
    c = vae.cfg.vae_latent_channels
    if latent.ndim != 4 or latent.shape[1] != c or latent.shape[2] != 2:
        raise H3Error(f"audio latent must be [B, {c}, 2, t], got {list(latent.shape)}")
    z = latent.to(device=vae.device, dtype=torch.float32)
    return vae.decode(z).movedim(1, -1)


@torch.inference_mode()
def encode_audio(vae: AudioVAE, waveform: torch.Tensor) -> torch.Tensor:
    """Waveform [B, L, C] at 32 kHz in [-1, 1] -> normalised latent [B, 32, 2, L // 800] float32.

    L is centre-cropped to a multiple of 800 samples; mono (C = 1) is duplicated to stereo, extra channels dropped.
    """
    hop = vae.cfg.hop_length
    if waveform.ndim != 3 or waveform.shape[-1] < 1:
        raise H3Error(f"waveform must be [B, samples, channels], got {list(waveform.shape)}")
    if waveform.shape[1] < hop:
        raise H3Error(f"waveform of {waveform.shape[1]} samples is shorter than one latent frame ({hop} samples)")
    w = crop_to_multiple(waveform, (1,), hop)
    if w.shape[-1] == 1:
        w = w.expand(-1, -1, 2)
    w = w[..., :2].movedim(-1, 1).to(device=vae.device, dtype=torch.float32)
    return vae.encode(w)
