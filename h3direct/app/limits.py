"""Request limits shared by `h3direct generate` and `h3direct serve`: checked before anything is loaded or run.

The defaults admit every size the released model is used at (up to 1344×768 × 241 frames, 100 steps) and refuse
the requests that would hold a GPU, or the CPU, for hours or allocate far beyond any device: a billion steps, a
16384² × 3600 canvas, a megabyte prompt (text encoding is quadratic in its length). Each is a flag
(`--max-steps`, ...), so an operator can raise it knowingly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from h3direct.errors import RequestError
from h3direct.fields import check as check_fields
from h3direct.fields import field

_AT_LEAST_1 = {"rule": lambda v: v >= 1, "expect": "at least 1"}


@dataclass(frozen=True)
class Limits:
    max_steps: int = field(100, "most sampling steps a request may ask for", **_AT_LEAST_1)
    max_frames: int = field(481, "most frames a request may ask for (before snapping to 17k+5; 481: 20 s at 24 fps)",
                            **_AT_LEAST_1)
    max_pixel_frames: int = field(1344 * 768 * 241, "most width × height × frames a request may ask for",
                                  **_AT_LEAST_1)
    max_prompt_chars: int = field(4096, "longest prompt (and negative prompt), in characters", **_AT_LEAST_1)
    max_references: int = field(9, "most reference files (images + videos + audios) in one request", **_AT_LEAST_1)

    def __post_init__(self):
        check_fields(self)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check(limits: Limits, *, steps: int, frames: int, width: int, height: int, prompts: dict[str, str],
          references: int) -> None:
    """A RequestError naming the first value beyond `limits` (and the server flag that sets that limit)."""
    if steps > limits.max_steps:
        raise RequestError("steps", f" {steps} is over the limit of {limits.max_steps} (--max-steps)")
    if frames > limits.max_frames:
        raise RequestError("frames", f" {frames} is over the limit of {limits.max_frames} (--max-frames)")
    px = width * height * frames
    if px > limits.max_pixel_frames:
        raise RequestError("width × height × frames", f" = {width}×{height}×{frames} = {px} is over the limit of "
                           f"{limits.max_pixel_frames} (--max-pixel-frames)")
    for name, text in prompts.items():
        check_prompt(limits, name, text)
    if references > limits.max_references:
        raise RequestError("", f"{references} reference files is over the limit of {limits.max_references} "
                           f"(--max-references)")


def check_prompt(limits: Limits, name: str, text: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise RequestError(name, f" has {len(text)} characters, over the limit of {limits.max_prompt_chars} "
                           f"(--max-prompt-chars)")
