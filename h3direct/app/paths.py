"""Where files may be read and written: the checks every command and the service make before any compute.

`check_output` proves an output path can be written (its folder exists, or can be made, and takes a file; the path is
not a folder; the extension fits) by creating and removing a probe file, since permission bits lie for root and for
pseudo-filesystems (/proc). `confined` resolves a client-given relative path under a root folder and refuses
absolute paths, `..` and symlinks that lead out of it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from h3direct.errors import H3Error


def check_output(path: str | os.PathLike, flag: str, suffix: str | None = ".mp4") -> Path:
    """An output file: the right extension, not a folder, in a folder that exists (or can be made) and takes files."""
    p = Path(path)
    if suffix is not None and p.suffix.lower() != suffix:
        raise H3Error(f"{flag} {str(p)!r} must end in {suffix} (e.g. clip{suffix}); no other format is written")
    if p.is_dir():
        raise H3Error(f"{flag} is a folder; give a file name like clip{suffix or ''}", path=p)
    _writable(Path(os.path.abspath(p)).parent, flag, p)  # `..` taken lexically, as a later mkdir(parents=True)
    return p


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """An output folder: exists (or can be made) and takes files."""
    p = Path(path)
    _writable(Path(os.path.abspath(p)), flag, p)
    return p


def _writable(folder: Path, flag: str, shown: Path) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise H3Error(f"{flag}: {str(existing)!r} is a file, not a folder", path=shown)
    try:
        fd, probe = tempfile.mkstemp(prefix=".h3probe.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise H3Error(f"{flag}: cannot write into {str(existing)!r} ({e.strerror or e})", path=shown) from None


def check_input(path: str | os.PathLike, flag: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise H3Error(f"{flag}: file not found", path=p)
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise H3Error(f"{flag}: cannot read it ({e.strerror or e})", path=p) from None
    return p


def confined(root: Path, name: str, field: str, *, must_exist: bool) -> Path:
    """`name` (relative, no `..`) resolved under `root`; symlinks may not lead out of it.

    With `must_exist`, a missing file and a refused one get the same answer, so a client cannot probe the host."""
    refused = H3Error(f"{field} {name!r}: no such file under the input folder" if must_exist else
                      f"{field} {name!r} must be a relative path inside the output folder (no '..', not absolute)")
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
