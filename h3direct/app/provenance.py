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


# the request fields a clip's provenance records (its files as `references`, its output not at all)
REQUEST_FIELDS = ("prompt", "negative_prompt", "seed", "width", "height", "frames", "steps", "sampler", "scheduler",
                  "cfg", "ref_image_size", "cache_mode", "cache_threshold", "cache_start_percent", "cache_end_percent",
                  "cache_subsample_factor")
FILE_FIELDS = ("ref_images", "ref_videos", "ref_audios", "first_frame", "last_frame", "text_embeds")


def provenance_of(request, options, pipe) -> dict:
    """What a clip was made from, enough to make it again (`h3direct generate --from-provenance`): the request (its
    prompt's text, its files by name and sha256), every option (`dit.options.Options.flat`), the settings the models
    were loaded with, the weights (names and sha256) and the h3direct version."""
    fields = request.fields()
    out = {"h3direct": version(), **{k: fields[k] for k in REQUEST_FIELDS}, "prompt": request.prompt_text,
           "attention": options.attention.backend}
    out["references"] = references([(name, f.path) for name in FILE_FIELDS for f in request.inputs(name)
                                    if f.path is not None])
    out["options"] = options.flat()
    if options.tier is not None:  # where the options came from: the tier's name, its file and what it set
        out["tier"] = options.tier
    out["settings"] = settings_of(pipe)
    out["weights"] = weights(pipe.files)
    return out


def settings_of(pipe) -> dict:
    """How the models were loaded: compute dtype, NVFP4 mode, video VAE dtype and tile, device type."""
    dtypes = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
    modes = sorted({m.mode for m in pipe.dit.modules() if type(m).__name__ == "NVFP4Linear"})
    return {"compute_dtype": dtypes[str(pipe.dit.compute_dtype)], "nvfp4_mode": modes[0] if modes else None,
            "vae_dtype": dtypes[str(pipe.vae_dtype)], "vae_tile_size": pipe.vae_tile_size,
            "device": pipe.device.type}


def read_mp4(path: str | os.PathLike) -> dict:
    """The provenance in an mp4's `comment` tag (a RequestError naming the file when there is none)."""
    import av

    from h3direct.errors import RequestError

    try:
        with av.open(str(path)) as box:
            comment = box.metadata.get("comment")
    except (av.error.FFmpegError, OSError) as e:
        raise RequestError("from_provenance", f": not a readable mp4 ({e.__class__.__name__})", path=path) from None
    try:
        prov = json.loads(comment) if comment else None
    except ValueError:
        prov = None
    if not isinstance(prov, dict) or "h3direct" not in prov or "options" not in prov:
        raise RequestError("from_provenance", ": its comment tag holds no h3direct provenance with options (made "
                           "by another program, or by an h3direct before the provenance recorded them)", path=path)
    return prov
