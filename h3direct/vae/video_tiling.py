"""Spatial tiling and temporal chunking of the H3 video VAE (the geometry ComfyUI's `MiniMaxH3VideoVAE` uses).

Spatial: a side of L px is covered by N tiles of `tile` px (N minimal with N·tile − (N−1)·overlap_min ≥ L); the
slack is handed out to the overlaps one latent cell (16 px) at a time, round-robin, so the last tile ends exactly at
L. Every tile is decoded on its own; a tile is linearly blended with the *raw* (unblended) edge strips of its upper
and left neighbours over the overlap, then its own lower/right overlap is cut off.

Temporal (decode): latent frames are split in chunks of `tokens_chunk_size` (5) tokens plus `token_overlap` (2)
overlap tokens; the latent is first extended by repeating its last frame so the chunks tile it. Each chunk decodes
to 4 frames per token; of its first 20 frames the `frame_pre_padding` (3) leading ones are dropped and the rest are
written; of the following frames (again minus 3) the result is kept and blended (linear, `frame_overlap` = 5 frames)
into the start of the next chunk. The output length is cut to the frame count of the un-padded latent (17k+5 frames
for 5k+2 latent frames). A single latent frame decodes to one image (the last of its 4 frames).

Temporal (encode): clips of `clip_length` (17) frames, the last one padded by repeating its last frame; each clip
encodes to 5 latent frames; the last `token_drop` (3) latent frames of the whole video are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from h3direct.vae.config import VideoVAEConfig

TileFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TileSplit:
    """Tiles along one side, in pixels: starts, common size, overlap between tile i and i+1."""

    starts: tuple[int, ...]
    size: int
    overlaps: tuple[int, ...]


def split_tiles(length: int, tile: int, overlap_min: int, cell: int) -> TileSplit:
    if tile >= length:
        return TileSplit((0,), length, ())
    n = math.ceil(length / tile)
    while tile * n - overlap_min * (n - 1) < length:
        n += 1
    overlaps = [overlap_min] * (n - 1)
    slack = tile * n - overlap_min * (n - 1) - length
    for k in range(slack // cell):
        overlaps[k % (n - 1)] += cell
    starts = [0]
    for ov in overlaps:
        starts.append(starts[-1] + tile - ov)
    return TileSplit(tuple(starts), tile, tuple(overlaps))


def blend(prev: torch.Tensor, cur: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the last `extent` entries of `prev` into the first of `cur` along `dim`; returns `cur`'s extent."""
    e = min(prev.shape[dim], cur.shape[dim], extent)
    shape = [1] * cur.ndim
    shape[dim] = e
    w = (torch.arange(e, device=cur.device, dtype=cur.dtype) / e).view(shape)
    mixed = prev.narrow(dim, prev.shape[dim] - e, e) * (1 - w) + cur.narrow(dim, 0, e) * w
    return torch.cat([mixed, cur.narrow(dim, e, cur.shape[dim] - e)], dim=dim)


def tiled(x: torch.Tensor, fn: TileFn, ys: TileSplit, xs: TileSplit, in_div: int, out_div: int) -> torch.Tensor:
    """Run `fn` tile by tile (row-major) over the last two dims of x and stitch the blended results.

    Splits are in pixels; x is indexed at pixel/in_div, fn's output at pixel/out_div.
    """
    canvas = None
    above: list[torch.Tensor | None] = [None] * len(xs.starts)
    y_out = 0
    for i, y0 in enumerate(ys.starts):
        last_row = i == len(ys.starts) - 1
        left = None
        x_out = 0
        for j, x0 in enumerate(xs.starts):
            last_col = j == len(xs.starts) - 1
            raw = fn(x[..., y0 // in_div : (y0 + ys.size) // in_div, x0 // in_div : (x0 + xs.size) // in_div])
            tile = raw
            if i > 0:
                tile = blend(above[j], tile, ys.overlaps[i - 1] // out_div, dim=-2)
            if j > 0:
                tile = blend(left, tile, xs.overlaps[j - 1] // out_div, dim=-1)
            if not last_row:
                ov = ys.overlaps[i] // out_div
                above[j] = raw[..., -ov:, :].clone()
                tile = tile[..., :-ov, :]
            if not last_col:
                ov = xs.overlaps[j] // out_div
                left = raw[..., -ov:].clone()
                tile = tile[..., :-ov]
            if canvas is None:
                out_h = (ys.starts[-1] + ys.size) // out_div
                out_w = (xs.starts[-1] + xs.size) // out_div
                canvas = tile.new_empty(*tile.shape[:-2], out_h, out_w)
            canvas[..., y_out : y_out + tile.shape[-2], x_out : x_out + tile.shape[-1]] = tile
            x_out += tile.shape[-1]
        y_out += tile.shape[-2]
    return canvas


# --------------------------------------------------------------------------------------------- temporal


@dataclass(frozen=True)
class DecodePlan:
    """How a latent of `t_lat` frames is decoded: padding, chunk token ranges, output frames."""

    t_lat: int
    pad_tokens: int
    chunks: tuple[tuple[int, int], ...]
    frames: int


def token_frames(index: int, cfg: VideoVAEConfig) -> int:
    """Pixel frames one latent token yields: the first token of a clip yields clip_length mod ratio_t, if nonzero."""
    head = cfg.clip_length % cfg.vae_ratio_t
    return head if head and index % cfg.tokens_chunk_size == 0 else cfg.vae_ratio_t


def plan_decode(t_lat: int, cfg: VideoVAEConfig) -> DecodePlan:
    """Chunking of a T-token latent for the decoder (c = tokens_chunk_size, d = token_drop, o = token_overlap).

    The latent is extended by p repeated last tokens so that T + d + p is a multiple of c; chunk i covers
    tokens [i·c, i·c + c + o) (clipped to T + p), for n = (T + d + p)/c − [d > 0] chunks, and at least one:
    a latent shorter than that gets c more padding tokens. The output keeps every chunk's main frames and the
    last chunk's tail, minus the frames the padding tokens produced.
    """
    if t_lat == 1:
        return DecodePlan(1, 0, ((0, 1),), 1)
    size, drop = cfg.tokens_chunk_size, cfg.token_drop
    pad = (-(t_lat + drop)) % size
    n = (t_lat + drop + pad) // size - (1 if drop > 0 else 0)
    if n < 1:  # e.g. T = 2: n would be 0
        pad += size
        n += 1
    total = t_lat + pad
    chunks = tuple((i * size, min(i * size + size + cfg.token_overlap, total)) for i in range(n))
    written = 0
    last_tail = 0
    for a, b in chunks:
        main, tail = _chunk_split_lengths((b - a) * cfg.vae_ratio_t, cfg)
        written += main
        last_tail = tail
    written += last_tail
    frames = written - sum(token_frames(t_lat + k, cfg) for k in range(pad))
    return DecodePlan(t_lat, pad, chunks, frames)


def _chunk_split_lengths(clip_frames: int, cfg: VideoVAEConfig) -> tuple[int, int]:
    span, pre = cfg.tokens_chunk_size * cfg.vae_ratio_t, cfg.frame_pre_padding
    main = max(0, min(span, clip_frames) - pre)
    tail = max(0, min(2 * span, clip_frames) - span - pre) if cfg.token_drop > 0 else 0
    return main, tail


def decoded_parts(z: torch.Tensor, decode_fn: TileFn, finalize: Callable[[torch.Tensor], torch.Tensor],
                  cfg: VideoVAEConfig) -> Iterator[torch.Tensor]:
    """De-normalised latent [B, C, t, h, w] -> finalized pixels [B, 3, n, H, W] (float32) of each temporal chunk,
    in order, as soon as they are final (a chunk's tail is blended into the next chunk's head first); together the
    `plan_decode(t).frames` frames of the clip.

    `decode_fn` maps a latent chunk to raw pixels (spatially tiled); `finalize` maps raw pixels to float32 [0, 1]
    (elementwise).
    """
    plan = plan_decode(z.shape[2], cfg)
    if plan.t_lat == 1:
        yield finalize(decode_fn(z)[:, :, -1:])
        return
    if plan.pad_tokens:
        z = torch.cat([z, z[:, :, -1:].expand(-1, -1, plan.pad_tokens, -1, -1)], dim=2)
    span, pre = cfg.tokens_chunk_size * cfg.vae_ratio_t, cfg.frame_pre_padding
    left = plan.frames

    def final(part: torch.Tensor) -> torch.Tensor | None:
        nonlocal left
        n = min(part.shape[2], left)
        if n <= 0:
            return None
        left -= n
        return finalize(part[:, :, :n])

    carry = None
    for a, b in plan.chunks:
        raw = decode_fn(z[:, :, a:b])
        main = raw[:, :, pre:span]
        if carry is not None:
            main = blend(carry, main, cfg.frame_overlap, dim=2)
        carry = raw[:, :, span + pre : 2 * span].clone() if cfg.token_drop > 0 else None
        part = final(main)
        del raw, main
        if part is not None:
            yield part
    if carry is not None and (part := final(carry)) is not None:
        yield part


def decode_chunked(z: torch.Tensor, decode_fn: TileFn, finalize: Callable[[torch.Tensor], torch.Tensor],
                   cfg: VideoVAEConfig) -> torch.Tensor:
    """De-normalised latent [B, C, t, h, w] -> finalized pixels [B, 3, frames, H, W] (float32): `decoded_parts`
    written into one tensor."""
    out, pos = None, 0
    for part in decoded_parts(z, decode_fn, finalize, cfg):
        if out is None:
            out = part.new_empty(*part.shape[:2], plan_decode(z.shape[2], cfg).frames, *part.shape[3:])
        out[:, :, pos : pos + part.shape[2]] = part
        pos += part.shape[2]
    return out


def encode_chunked(x: torch.Tensor, encode_fn: TileFn, cfg: VideoVAEConfig) -> torch.Tensor:
    """Normalised pixels [B, 3, T, H, W] -> moments [B, 2·embed, t, h, w]."""
    if x.shape[2] == 1:
        return encode_fn(x)[:, :, -1:]
    clip = cfg.clip_length
    parts = []
    for start in range(0, x.shape[2], clip):
        piece = x[:, :, start : start + clip]
        if piece.shape[2] < clip:
            piece = torch.cat([piece, piece[:, :, -1:].expand(-1, -1, clip - piece.shape[2], -1, -1)], dim=2)
        parts.append(encode_fn(piece))
    moments = torch.cat(parts, dim=2)
    return moments[:, :, : moments.shape[2] - cfg.token_drop]
