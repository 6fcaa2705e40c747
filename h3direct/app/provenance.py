"""What a clip was made from, so it can be made again: prompt, seed, sampler, references and weights (names and
sha256), the h3direct version. Carried in the JSON summary and in the mp4's `comment` tag (as JSON).

Hashes of large weight files are remembered in `$H3_CACHE_DIR/sha256.json`, keyed by path, size and mtime, so a
40 GB checkpoint is read once, not on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

_lock = threading.Lock()
_memo: dict[tuple, str] = {}


def version() -> str:
    from h3direct import __version__

    return __version__


def _cache_file() -> Path:
    from h3direct.app.paths import cache_root

    return cache_root() / "sha256.json"


def sha256_file(path: str | os.PathLike, *, remember: bool = False) -> str:
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _memo:
            return _memo[key]
    disk = {}
    cache = _cache_file()
    if remember:
        try:
            disk = json.loads(cache.read_text())
        except (OSError, ValueError):
            disk = {}
        hit = disk.get(str(p))
        if isinstance(hit, dict) and [hit.get("size"), hit.get("mtime_ns")] == [st.st_size, st.st_mtime_ns]:
            with _lock:
                _memo[key] = hit["sha256"]
            return hit["sha256"]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    with _lock:
        _memo[key] = digest
    if remember:
        disk[str(p)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps(disk, indent=1, sort_keys=True))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only cache only costs the hash next time
    return digest


def weights(files: dict[str, str | None]) -> dict:
    """{component: {"file", "sha256"}} for the model files actually loaded."""
    return {k: {"file": Path(v).name, "sha256": sha256_file(v, remember=True)} for k, v in files.items() if v}


def references(items: list[tuple[str, str]]) -> list[dict]:
    """[(field, path)] -> [{"field", "name", "sha256"}]."""
    return [{"field": f, "name": Path(p).name, "sha256": sha256_file(p)} for f, p in items]
