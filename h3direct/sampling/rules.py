"""What a request may ask of the sampling stage, in one place and without torch (the command line and the request
check it before anything heavy is imported): the sampler and schedule names, the canvas and frame grid, the
reference caps, the step cache settings. The sampling modules take their tables from here.

Facts (ComfyUI's H3 nodes): frame counts snap up to 17k+5 (`length` 5..3600); width and height are multiples of 32
up to 16384 (`MAX_RESOLUTION`); at most 9 reference images, 3 videos and 3 audios.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3direct.errors import RequestError

SAMPLERS = ("euler", "heun", "dpmpp_2m")
SCHEDULERS = ("simple", "normal", "sgm_uniform")
CACHE_MODES = ("off", "easycache", "h3_cache")
CANVAS_MULTIPLE = 32
MAX_SIZE = 16384  # ComfyUI's MAX_RESOLUTION
MIN_FRAMES, MAX_FRAMES = 5, 3600  # ComfyUI's node limits on `length`
MAX_REF_IMAGES, MAX_REF_VIDEOS, MAX_REF_AUDIOS = 9, 3, 3
REF_CAPS = {"ref_images": MAX_REF_IMAGES, "ref_videos": MAX_REF_VIDEOS, "ref_audios": MAX_REF_AUDIOS}


def align_frame_count(n: int) -> int:
    """Smallest frame count of the form 17k + 5 that is ≥ n."""
    return n + (5 - n) % 17


def canvas_side_ok(v: int) -> bool:
    return CANVAS_MULTIPLE <= v <= MAX_SIZE and v % CANVAS_MULTIPLE == 0


CANVAS_SIDE = f"a multiple of {CANVAS_MULTIPLE} in [{CANVAS_MULTIPLE}, {MAX_SIZE}]"


def frames_ok(v: int) -> bool:
    return MIN_FRAMES <= v <= MAX_FRAMES


FRAMES = f"at least {MIN_FRAMES} and at most {MAX_FRAMES} (snapped up to 17k+5: 5, 22, 39, ..., 124)"


def check_canvas(width: int, height: int, frames: int) -> None:
    """RequestError naming the first of width, height, frames off the grid."""
    for name, v in (("width", width), ("height", height)):
        if not canvas_side_ok(v):
            near = min(MAX_SIZE, max(CANVAS_MULTIPLE, round(v / CANVAS_MULTIPLE) * CANVAS_MULTIPLE))
            raise RequestError(name, f" {v} must be {CANVAS_SIDE} (e.g. {near})")
    if not frames_ok(frames):
        raise RequestError("frames", f" {frames} must be {FRAMES}")


@dataclass(frozen=True)
class CacheSettings:
    """An opt-in step cache (`sampling/caches.py`); mode off runs no cache code at all. The rules of its mode,
    window and threshold, wherever the settings come from (a request, a trace's manifest)."""

    mode: str = "off"
    threshold: float = 0.2
    start_percent: float = 0.15
    end_percent: float = 0.95
    subsample_factor: int = 8

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise RequestError("cache_mode", f" {self.mode!r}: not one of {', '.join(CACHE_MODES)}")
        if not 0.0 <= self.start_percent <= self.end_percent <= 1.0:
            raise RequestError("cache_*", f": cache start_percent={self.start_percent}, "
                               f"end_percent={self.end_percent}: need 0 ≤ start ≤ end ≤ 1")
        if self.threshold < 0 or self.subsample_factor < 1:
            raise RequestError("cache_*", f": cache threshold={self.threshold} must be ≥ 0 and "
                               f"subsample_factor={self.subsample_factor} ≥ 1")


def check_sampling(sampler: str, scheduler: str, steps: int) -> None:
    """The sampler's, schedule's and step count's rules for settings read from a file (a trace's manifest; a request
    checks its own fields)."""
    if sampler not in SAMPLERS:
        raise RequestError("sampler", f" {sampler!r}: not one of {', '.join(SAMPLERS)}")
    if scheduler not in SCHEDULERS:
        raise RequestError("scheduler", f" {scheduler!r}: not one of {', '.join(SCHEDULERS)}")
    if steps < 1:
        raise RequestError("steps", f" {steps}: at least 1")
