"""Input files opened before any compute: reference media probed, text-embedding files parsed, so a bad file is a
one-line error at the start and never a traceback after minutes of work."""

from __future__ import annotations

import os
from pathlib import Path

from h3direct.errors import H3Error

MAX_TEXT_EMBEDS_BYTES = 1 << 30  # a [1, L, D] float tensor; anything larger is not a text-embeddings file


def probe_media(path: str | os.PathLike, kind: str, what: str) -> None:
    """Open `path` as an image / video / audio file (headers and the first frame only); H3Error if it is not one."""
    p = Path(path)
    if kind == "image":
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(p) as im:
                im.verify()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise H3Error(f"{what}: not a readable image ({e.__class__.__name__}); use PNG/JPEG/WebP", path=p) from None
        return
    import av

    try:
        with av.open(str(p)) as box:
            streams = box.streams.video if kind == "video" else box.streams.audio
            if not streams:
                raise H3Error(f"{what}: has no {kind} stream", path=p)
            for _ in box.decode(streams[0]):
                break
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, IndexError) as e:
        raise H3Error(f"{what}: not a readable {kind} file ({e.__class__.__name__})", path=p) from None


def read_text_embeds(path: str | os.PathLike, what: str = "--text-embeds"):
    """A TextConditioning from a safetensors file of `text_states` [1, L, D] + `token_tags` [L]."""
    from h3direct.checkpoint.safetensors_header import read_header
    from h3direct.text.encoder import load_text_embeds

    p = Path(path)
    if not p.is_file():
        raise H3Error(f"{what}: file not found", path=p)
    size = p.stat().st_size
    if size > MAX_TEXT_EMBEDS_BYTES:
        raise H3Error(f"{what}: {size} bytes is too large for a text-embeddings file", path=p)
    try:
        read_header(p, check=True)  # the header parses and its tensors span the file, before any tensor is read
    except H3Error:
        raise H3Error(f"{what}: not a safetensors file (needs text_states [1,L,D] and token_tags [L])",
                      path=p) from None
    try:
        text = load_text_embeds(p)
    except H3Error as e:
        raise H3Error(f"{what}: {e}") from None
    except Exception as e:  # the safetensors parser's own errors: a damaged or foreign file
        raise H3Error(f"{what}: not a readable safetensors file ({type(e).__name__})", path=p) from None
    if text.states.shape[1] == 0:
        raise H3Error(f"{what}: text_states has no tokens", path=p)
    if not bool(text.states.isfinite().all()):
        raise H3Error(f"{what}: text_states holds NaN or infinite values", path=p)
    return text
