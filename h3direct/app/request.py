"""`GenerateRequest`: one generation, as a frozen dataclass that validates itself once, where it is built.

The command line parses its flags into it (`app/cli_generate.py`), the HTTP service maps its JSON body onto it field
for field (`app/serve/schema.py`, made from these fields), and `H3Pipeline.generate(request, options)` takes it.
Everything that can be checked without a model is checked in its constructor, and each rule once: the fields' types,
choices and ranges (declared with each field), the task (first/last frame and references are separate tasks), the
reference caps, the step cache settings, the request limits (`app/limits.py`), and the files: every input file
exists under the input root (or is an upload of this request) and is what it claims to be (image, video, audio,
text embeddings, UTF-8 prompt), the output can be written and, unless `overwrite` is on, names no existing file
(a 'conflict': HTTP 409). A problem is one `RequestError` naming the field.

Where files are is the request's `roots` (not a field of the API): on the command line names are paths; in the
service they are names under `--input-root` (uploads: `upload:NN-name`) and `output` is a name under `--output-root`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3direct.app import bundled
from h3direct.app.limits import Limits
from h3direct.errors import RequestError
from h3direct.fields import check, field, positive, spec_of
from h3direct.sampling import rules

KINDS = {"ref_images": "image", "ref_videos": "video", "ref_audios": "audio", "first_frame": "image",
         "last_frame": "image"}


def _text_ok(v: str) -> bool:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in v


TEXT = "UTF-8 text without NUL characters (an undecodable byte or a lone surrogate is not)"


@dataclass(frozen=True)
class Roots:
    """Where a request's file names point. `input_root` None: names are paths on this machine (the command line);
    else relative names under it, plus `uploads` (name -> path of a file sent with the request). `output_root` None:
    `output` is a path; else a relative name inside it."""

    input_root: Path | None = None
    output_root: Path | None = None
    uploads: Mapping[str, Path] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class InputFile:
    field: str  # the field that names it ("ref_images[0]")
    name: str  # as the request gave it (messages and provenance show this)
    path: Path | None  # on this machine (None: an in-memory tensor, `value`)
    value: Any = None  # a tensor (image / video / audio) or TextConditioning handed over in-memory (Python API)


@dataclass(frozen=True)
class Resolved:
    """What validation found: each input file, the output path, the loaded text embeddings, the prompt's text."""

    files: dict[str, tuple[InputFile, ...]]
    output: Path | None
    save_latent: Path | None
    text_embeds: Any  # TextConditioning | None
    prompt: str
    defaulted: tuple[str, ...]  # size fields the request left out (their small defaults were used)


def _file(help: str):
    return field(None, help, kind="file")


def _files(help: str, cap: int):
    return field((), f"{help} (at most {cap}; repeat the flag)", kind="files")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: what to make (the options of how to compute it are `dit.options.Options`)."""

    prompt: str = field("", "text prompt")
    prompt_file: str | None = _file("a UTF-8 file holding the prompt (for prompts too long for a command line)")
    negative_prompt: str = field("", "negative prompt (only used with cfg > 1)")
    width: int | None = field(None, f"multiple of 32 (default: {bundled.DEFAULT_WIDTH})", kind=int,
                              rule=rules.canvas_side_ok, expect=rules.CANVAS_SIDE)
    height: int | None = field(None, f"multiple of 32 (default: {bundled.DEFAULT_HEIGHT})", kind=int,
                               rule=rules.canvas_side_ok, expect=rules.CANVAS_SIDE)
    frames: int | None = field(None, f"frame count at 24 fps, snapped up to 17k+5 (5, 22, 39, ..., 124) (default: "
                               f"{bundled.DEFAULT_FRAMES})", kind=int, rule=rules.frames_ok, expect=rules.FRAMES)
    steps: int | None = field(None, f"sampling steps (default: {bundled.DEFAULT_STEPS})", kind=int,
                              rule=lambda v: v >= 1, expect="at least 1")
    seed: int = field(0, "noise seed in [0, 2^64): the same seed, the same clip", rule=lambda v: 0 <= v < 2**64,
                      expect="in [0, 2^64)")
    sampler: str = field("euler", "sampler", choices=rules.SAMPLERS)
    scheduler: str = field("simple", "sigma schedule", choices=rules.SCHEDULERS)
    cfg: float = field(1.0, "classifier-free guidance (1 = off; H3 is CFG-distilled)", rule=positive,
                       expect="> 0 (1 = no guidance)")
    ref_images: tuple = _files("reference image", rules.MAX_REF_IMAGES)
    ref_videos: tuple = _files("reference video (its soundtrack is used when it has one)", rules.MAX_REF_VIDEOS)
    ref_audios: tuple = _files("reference audio", rules.MAX_REF_AUDIOS)
    ref_image_size: str = field("match", "reference image sizing (ComfyUI's ref_image_size)", choices=("match", "max"))
    first_frame: str | None = _file("first frame image (fl2va)")
    last_frame: str | None = _file("last frame image (fl2va)")
    text_embeds: str | None = _file("safetensors with text_states [1,L,D] + token_tags [L]; skips the text encoder")
    cache_mode: str = field("off", "step cache (opt-in, approximate)", choices=rules.CACHE_MODES)
    cache_threshold: float = field(0.2, "relative change below which a step is reused")
    cache_start_percent: float = field(0.15, "fraction of the schedule before which no step is reused")
    cache_end_percent: float = field(0.95, "fraction of the schedule after which no step is reused")
    cache_subsample_factor: int = field(8, "spatial subsampling of the change measure (h3_cache)")
    output: str | None = field(None, "mp4 to write", kind=str)
    save_latent: str | None = field(None, "also write the clip's latents (video_latent, audio_latent) to this "
                                    ".safetensors file, which `h3direct decode-latent` decodes", kind=str)
    overwrite: bool = field(False, "replace an existing output or save_latent file (off: a request that names an "
                            "existing one is refused)")
    progress: bool = field(False, "progress bars on stderr even when it is not a terminal; per-step seconds in the "
                           "summary")
    profile_memory: bool = field(False, "memory checkpoints per stage in the summary")
    # where the file names point and the limits that bound the request: not fields of the API
    roots: Roots = dataclasses.field(default_factory=Roots, compare=False, repr=False)
    limits: Limits = dataclasses.field(default_factory=Limits, compare=False, repr=False)
    resolved: Resolved | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        for name in ("ref_images", "ref_videos", "ref_audios"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, list | tuple):
                raise RequestError(name, f" must be a list of files, got {type(value).__name__}", kind="type")
            object.__setattr__(self, name, tuple(value))
        defaulted = self._fill_defaults()
        for f in dataclasses.fields(self):  # a number given as an integer is that number (JSON 1 is 1.0)
            value = getattr(self, f.name)
            if spec_of(f) is not None and f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
        self._check_text()
        check(self)
        self._check_task()
        if self.cache_mode != "off":
            self.cache_settings()  # the step cache's own rules (its window and threshold)
        self._check_limits()
        object.__setattr__(self, "resolved", _resolve(self, defaulted))
        self.check_outputs_free()

    # ---- the checks -------------------------------------------------------------------------
    def _fill_defaults(self) -> tuple[str, ...]:
        defaults = {"width": bundled.DEFAULT_WIDTH, "height": bundled.DEFAULT_HEIGHT,
                    "frames": bundled.DEFAULT_FRAMES, "steps": bundled.DEFAULT_STEPS}
        missing = tuple(k for k in defaults if getattr(self, k) is None)
        for k in missing:
            object.__setattr__(self, k, defaults[k])
        return missing

    def _check_text(self) -> None:
        """Every text value (prompts, file names, names of choices) is UTF-8 text without NUL characters: a string
        from undecodable command-line bytes, or a JSON string with a lone surrogate, is refused before it is used."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for i, v in enumerate(value if isinstance(value, tuple) else (value,)):
                if isinstance(v, str) and not _text_ok(v):
                    name = f"{f.name}[{i}]" if isinstance(value, tuple) else f.name
                    raise RequestError(name, f" is not {TEXT}; pass UTF-8", kind="type")

    def _check_task(self) -> None:
        refs = self.ref_images or self.ref_videos or self.ref_audios
        if refs and (self.first_frame is not None or self.last_frame is not None):
            raise RequestError("first_frame/last_frame", " (fl2va) and reference files (ref2va) are separate "
                               "tasks; give one kind")
        for name, cap in rules.REF_CAPS.items():
            n = len(getattr(self, name))
            if n > cap:
                raise RequestError(name, f": {n} files; H3 takes at most {cap}")
        if self.prompt and self.prompt_file is not None:
            raise RequestError("prompt/prompt_file", " are both given; give one")

    def cache_settings(self) -> rules.CacheSettings | None:
        """The step cache this request asks for (None: mode off, no cache code runs)."""
        if self.cache_mode == "off":
            return None
        return rules.CacheSettings(self.cache_mode, self.cache_threshold, self.cache_start_percent,
                                   self.cache_end_percent, self.cache_subsample_factor)

    def _check_limits(self) -> None:
        from h3direct.app import limits

        limits.check(self.limits, steps=self.steps, frames=self.frames, width=self.width, height=self.height,
                     prompts={"prompt": self.prompt, "negative_prompt": self.negative_prompt},
                     references=len(self.ref_images) + len(self.ref_videos) + len(self.ref_audios))

    # ---- what the pipeline and the provenance read ---------------------------------------------
    @property
    def task(self) -> str:
        if self.ref_images or self.ref_videos or self.ref_audios:
            return "ref2va"
        return "fl2va" if self.first_frame is not None or self.last_frame is not None else "t2va"

    @property
    def prompt_text(self) -> str:
        """The prompt: `prompt`, or the text of `prompt_file`."""
        return self.resolved.prompt

    def inputs(self, name: str) -> tuple[InputFile, ...]:
        """The resolved input files of a file field (empty when it names none)."""
        return self.resolved.files.get(name, ())

    def check_outputs_free(self) -> None:
        """A 'conflict' RequestError when an output file (`output`, `save_latent`) exists and `overwrite` is off.
        Run when the request is built; the service runs it again as it queues the job (a file may have appeared)."""
        if self.overwrite:
            return
        for name in ("output", "save_latent"):
            path = getattr(self.resolved, name)
            if path is not None and (path.exists() or path.is_symlink()):
                where = " in the output folder" if self.roots.output_root is not None else ""
                hint = '"overwrite": true' if self.roots.output_root is not None else "overwrite on (--overwrite)"
                raise RequestError(name, f" {getattr(self, name)!r} exists already{where}; choose another name, or "
                                   f"set {hint} to replace it", kind="conflict")

    def fields(self) -> dict:
        """{field: value} of every field of the API (what the provenance records, with the prompt's text)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if spec_of(f) is not None}


def _resolve(req: GenerateRequest, defaulted: tuple[str, ...]) -> Resolved:
    """Every file of the request, checked in field order; the output path; the prompt's text."""
    from h3direct.app import paths

    files: dict[str, tuple[InputFile, ...]] = {}
    for name in ("ref_images", "ref_videos", "ref_audios", "first_frame", "last_frame", "text_embeds", "prompt_file"):
        value = getattr(req, name)
        items = list(value) if isinstance(value, tuple) else [] if value is None else [value]
        labels = [f"{name}[{i}]" for i in range(len(items))] if isinstance(value, tuple) else [name] * len(items)
        got = tuple(_input(req.roots, label, item) for label, item in zip(labels, items, strict=True))
        for f in got:
            if f.path is not None and name in KINDS:
                paths.probe_media(f.path, KINDS[name], name, f.name)
        if got:
            files[name] = got
    embeds = None
    if "text_embeds" in files:
        f = files["text_embeds"][0]
        embeds = f.value if f.path is None else paths.read_text_embeds(f.path, "text_embeds", f.name)
    prompt = req.prompt
    if "prompt_file" in files:
        f = files["prompt_file"][0]
        prompt = paths.read_prompt_file(f.path, "prompt_file", f.name, req.limits.max_prompt_chars)
        if not _text_ok(prompt):
            raise RequestError("prompt_file", ": holds a NUL character", path=f.name)
        from h3direct.app import limits

        limits.check_prompt(req.limits, "prompt_file", prompt)
    return Resolved(files, _output(req, "output", ".mp4"), _output(req, "save_latent", ".safetensors"), embeds,
                    prompt, defaulted)


def _input(roots: Roots, field_label: str, item) -> InputFile:
    from h3direct.app import paths

    if not isinstance(item, str | os.PathLike):  # the Python API: a tensor or a TextConditioning
        return InputFile(field_label, f"<{type(item).__name__}>", None, item)
    name = str(item)
    base = field_label.split("[")[0]
    if name in roots.uploads:
        path = roots.uploads[name]
    elif roots.input_root is None:
        path = Path(name)
    else:
        path = paths.confined(roots.input_root, name, field_label, must_exist=True)
    paths.check_input(path, base, name)
    return InputFile(field_label, name, path)


def _output(req: GenerateRequest, name: str, suffix: str) -> Path | None:
    """The path an output field (`output`, `save_latent`) names: a writable file with the right extension; under the
    output root, a relative name inside it whose folder exists."""
    from h3direct.app import paths

    given = getattr(req, name)
    if given is None:
        return None
    root = req.roots.output_root
    if root is None:
        return paths.check_output(given, name, suffix)
    if not given.lower().endswith(suffix) or Path(given).name.startswith("."):
        raise RequestError(name, f" {given!r} must be a file name ending in {suffix} (not hidden), e.g. clip{suffix}")
    target = paths.confined(root, given, name, must_exist=False)
    try:
        if not target.parent.is_dir():
            raise RequestError(name, f" {given!r}: its folder does not exist under the output folder")
        if target.is_dir():
            raise RequestError(name, f" {given!r} is a folder")
    except OSError as e:
        raise RequestError(name, f" {given!r}: not a usable file name ({e.strerror})") from None
    return target
