"""The files a command or the service is given, checked before any compute, so a bad one is a one-line error at the
start and never a traceback after minutes of work.

Where files may be written and read: `check_output` proves an output path can be written (its folder exists, or can
be made, and takes a file; the path is not a folder; the extension fits) by creating and removing a probe file, since
permission bits lie for root and for pseudo-filesystems (/proc). `confined` resolves a client-given relative path
under a root folder and refuses absolute paths, `..` and symlinks that lead out of it.

What the input files hold: `probe_media` opens reference media (headers and the first frame), `read_text_embeds`
parses a text-embeddings file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from h3direct.errors import H3Error, RequestError

MAX_TEXT_EMBEDS_BYTES = 1 << 30  # a [1, L, D] float tensor; anything larger is not a text-embeddings file
CACHE_ENV = "H3_CACHE_DIR"


def cache_root() -> Path:
    """Where h3direct keeps what it can rebuild (the bundled models, remembered file hashes): $H3_CACHE_DIR, default
    ~/.cache/h3direct."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "h3direct"))


def check_output(path: str | os.PathLike, field: str, suffix: str | None = ".mp4") -> Path:
    """An output file: the right extension, not a folder, in a folder that exists (or can be made) and takes files.
    `field`: the request field (or flag) that named it."""
    p = Path(path)
    if suffix is not None and p.suffix.lower() != suffix:
        raise RequestError(field, f" {str(p)!r} must end in {suffix} (e.g. clip{suffix}); no other format is written")
    if p.is_dir():
        raise RequestError(field, f" is a folder; give a file name like clip{suffix or ''}", path=p)
    _writable(Path(os.path.abspath(p)).parent, field, p)  # `..` taken lexically, as a later mkdir(parents=True)
    return p


def check_output_dir(path: str | os.PathLike, field: str) -> Path:
    """An output folder: exists (or can be made) and takes files."""
    p = Path(path)
    _writable(Path(os.path.abspath(p)), field, p)
    return p


def _writable(folder: Path, field: str, shown: Path) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RequestError(field, f": {str(existing)!r} is a file, not a folder", path=shown)
    try:
        fd, probe = tempfile.mkstemp(prefix=".h3probe.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RequestError(field, f": cannot write into {str(existing)!r} ({e.strerror or e})", path=shown) from None


def check_input(path: str | os.PathLike, field: str, shown: str | None = None) -> Path:
    """A readable file; `shown`: how messages name it (default: the path)."""
    p = Path(path)
    shown = str(p) if shown is None else shown
    if not p.is_file():
        raise RequestError(field, ": file not found", path=shown)
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise RequestError(field, f": cannot read it ({e.strerror or e})", path=shown) from None
    return p


def confined(root: Path, name: str, field: str, *, must_exist: bool) -> Path:
    """`name` (relative, no `..`) resolved under `root`; symlinks may not lead out of it.

    With `must_exist`, a missing file and a refused one get the same answer, so a client cannot probe the host."""
    refused = RequestError(field, f" {name!r}: no such file under the input folder" if must_exist else
                           f" {name!r} must be a relative path inside the output folder (no '..', not absolute)")
    if not name or len(name) > 1024 or "\x00" in name or "\\" in name:
        raise refused
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or any(len(part) > 255 for part in rel.parts):
        raise refused
    root = root.resolve()
    try:
        target = (root / rel).resolve(strict=must_exist)
        if not target.is_relative_to(root) or target == root:
            raise refused
        if must_exist and not target.is_file():
            raise refused
    except (OSError, RuntimeError):  # a name too long, a loop of links, ...
        raise refused from None
    return target


def probe_media(path: str | os.PathLike, kind: str, field: str, shown: str | None = None) -> None:
    """Open `path` as an image / video / audio file (headers and the first frame only); a RequestError of `field`
    if it is not one (`shown`: how the message names the file)."""
    p = Path(path)
    shown = str(p) if shown is None else shown
    if kind == "image":
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(p) as im:
                im.verify()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise RequestError(field, f": not a readable image ({e.__class__.__name__}); use PNG/JPEG/WebP",
                               path=shown) from None
        return
    import av

    try:
        with av.open(str(p)) as box:
            streams = box.streams.video if kind == "video" else box.streams.audio
            if not streams:
                raise RequestError(field, f": has no {kind} stream", path=shown)
            for _ in box.decode(streams[0]):
                break
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, IndexError) as e:
        raise RequestError(field, f": not a readable {kind} file ({e.__class__.__name__})", path=shown) from None


def read_text_embeds(path: str | os.PathLike, field: str = "text_embeds", shown: str | None = None):
    """A TextConditioning from a safetensors file of `text_states` [1, L, D] + `token_tags` [L]."""
    from h3direct.checkpoint.safetensors_header import read_header
    from h3direct.text.load import load_text_embeds

    p = Path(path)
    shown = str(p) if shown is None else shown
    if not p.is_file():
        raise RequestError(field, ": file not found", path=shown)
    size = p.stat().st_size
    if size > MAX_TEXT_EMBEDS_BYTES:
        raise RequestError(field, f": {size} bytes is too large for a text-embeddings file", path=shown)
    try:
        read_header(p, check=True)  # the header parses and its tensors span the file, before any tensor is read
    except H3Error:
        raise RequestError(field, ": not a safetensors file (needs text_states [1,L,D] and token_tags [L])",
                           path=shown) from None
    try:
        text = load_text_embeds(p)
    except H3Error as e:
        raise RequestError(field, f": {str(e).removeprefix(str(p) + ': ')}", path=shown) from None
    except Exception as e:  # the safetensors parser's own errors: a damaged or foreign file
        raise RequestError(field, f": not a readable safetensors file ({type(e).__name__})", path=shown) from None
    if text.states.shape[1] == 0:
        raise RequestError(field, ": text_states has no tokens", path=shown)
    if not bool(text.states.isfinite().all()):
        raise RequestError(field, ": text_states holds NaN or infinite values", path=shown)
    return text


def read_prompt_file(path: str | os.PathLike, field: str = "prompt_file", shown: str | None = None,
                     max_chars: int | None = None) -> str:
    """The text of a prompt file (UTF-8; one trailing newline dropped); over `max_chars` is refused unread."""
    p = check_input(path, field, shown)
    shown = str(p) if shown is None else shown
    limit = None if max_chars is None else 4 * max_chars + 4  # bytes: UTF-8 takes at most 4 per character
    with open(p, "rb") as f:
        data = f.read(limit + 1 if limit is not None else -1)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(field, f": not UTF-8 text (undecodable byte at offset {e.start})", path=shown) from None
    return text[:-1] if text.endswith("\n") else text
