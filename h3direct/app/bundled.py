"""The embedded default models: a tiny random H3 DiT, tiny video/audio VAEs and a tiny random Qwen3-VL text
encoder, made deterministically from a seed on first use and cached on disk.

Nothing is downloaded and nothing is read from outside the package: the DiT comes from `make_checkpoint`'s
recipe (preset `tiny`, seed 0 -> bit for bit the oracle's `h3_tiny_bf16.safetensors`), the VAEs from
`vae.synthetic.make_state_dict` with the `tiny` presets of `vae.config` (the constructor numbers of the oracle's
`vae_config_public.json`), the text encoder from `text.qwen.make_tiny_text_encoder` (hidden 96 = the tiny
DiT's text_dim). The models are random: the clip they produce is noise-like, but every stage of the real
pipeline runs on them.

Cache: `$H3_CACHE_DIR/bundled-<VERSION>/` (default root `~/.cache/h3direct`). The directory is built under a
temporary name and renamed into place, so a crashed or concurrent first run never leaves a half-written bundle;
`manifest.json` is the last file written and marks a complete bundle.

The text of a prompt reaches the random tiny encoder through a byte tokenizer (UTF-8 bytes as token ids):
the encoder is random, so any deterministic tokenizer is as good as Qwen's, and it needs no vocabulary files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "1"
SEED = 0
DIT_PRESET = "tiny"
VAE_PRESET = "tiny"
TOKENIZER = "bytes"
FILES = {"dit": "dit.safetensors", "video_vae": "video_vae.safetensors", "audio_vae": "audio_vae.safetensors",
         "text_encoder": "text_encoder.safetensors"}
MANIFEST = "manifest.json"
TEXT_ENCODER_PREFIX = "text_encoders.qwen3vl_32b.transformer.model."

# generation defaults sized for the tiny models on a small CPU (well under a minute end to end)
DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_FRAMES, DEFAULT_STEPS = 96, 64, 22, 4


@dataclass(frozen=True)
class Bundle:
    root: Path
    dit: Path
    video_vae: Path
    audio_vae: Path
    text_encoder: Path
    video_vae_config: str = VAE_PRESET  # preset names of `h3direct.vae.config`
    audio_vae_config: str = VAE_PRESET
    tokenizer: str = TOKENIZER


def cache_dir() -> Path:
    from h3direct.app.paths import cache_root

    return cache_root() / f"bundled-{VERSION}"


def _bundle(root: Path) -> Bundle:
    return Bundle(root, *(root / FILES[k] for k in ("dit", "video_vae", "audio_vae", "text_encoder")))


def _write_all(dest: Path, seed: int) -> None:
    import torch

    from h3direct.checkpoint.synthetic import write_dit_checkpoint, write_state_dict
    from h3direct.config import H3Config
    from h3direct.text.qwen import make_tiny_text_encoder
    from h3direct.vae.synthetic import make_state_dict

    write_dit_checkpoint(dest / FILES["dit"], H3Config.from_name(DIT_PRESET), seed=seed)
    for comp in ("video_vae", "audio_vae"):
        write_state_dict(dest / FILES[comp], make_state_dict(comp, VAE_PRESET, seed=seed))
    enc = make_tiny_text_encoder(seed)
    sd = {TEXT_ENCODER_PREFIX + k: v.detach().to(torch.float32).contiguous()
          for k, v in enc.model.state_dict().items()}
    write_state_dict(dest / FILES["text_encoder"], sd)
    manifest = {"version": VERSION, "seed": seed, "dit_preset": DIT_PRESET, "vae_preset": VAE_PRESET,
                "tokenizer": TOKENIZER, "files": FILES}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def is_complete(root: Path) -> bool:
    return (root / MANIFEST).is_file() and all((root / f).is_file() for f in FILES.values())


def ensure(root: str | Path | None = None) -> Bundle:
    """The bundled models' files, made on first use (a few seconds) and reused afterwards."""
    from h3direct.errors import H3Error

    root = Path(root) if root is not None else cache_dir()
    if is_complete(root):
        return _bundle(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700
    except OSError as exc:
        raise H3Error(f"cannot create the bundled-model cache ({exc.strerror}); set H3_CACHE_DIR to a writable "
                      "directory", path=root.parent) from None
    try:
        _write_all(tmp, SEED)
        if root.exists() and not is_complete(root):
            shutil.rmtree(root)  # a stale, incomplete bundle (never one of ours: ours appear by rename)
        try:
            os.rename(tmp, root)
        except OSError:
            if not is_complete(root):  # lost a race to another process that finished first: use theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return _bundle(root)
