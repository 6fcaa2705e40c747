"""Request limits shared by `h3direct generate` and `h3direct serve`: checked before anything is loaded or run.

The defaults admit every size the released model is used at (up to 1344×768 × 241 frames, 100 steps) and refuse
the requests that would hold a GPU, or the CPU, for hours or allocate far beyond any device: a billion steps, a
16384² × 3600 canvas, a megabyte prompt (text encoding is quadratic in its length). Each is a flag
(`--max-steps`, ...), so an operator can raise it knowingly.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from h3direct.errors import H3Error


@dataclass(frozen=True)
class Limits:
    max_steps: int = 100
    max_frames: int = 481  # 20 s at 24 fps
    max_pixel_frames: int = 1344 * 768 * 241  # width × height × frames
    max_prompt_chars: int = 4096
    max_references: int = 9  # reference images + videos + audios, together

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise H3Error(f"--{f.name.replace('_', '-')} {getattr(self, f.name)} must be >= 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


HELP = {
    "max_steps": "most sampling steps a request may ask for",
    "max_frames": "most frames a request may ask for (before snapping to 17k+5)",
    "max_pixel_frames": "most width × height × frames a request may ask for",
    "max_prompt_chars": "longest prompt (and negative prompt), in characters",
    "max_references": "most reference files (images + videos + audios) in one request",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits (requests beyond them are refused before any compute)")
    for f in fields(Limits):
        g.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, metavar="N",
                       help=HELP[f.name])


def check(limits: Limits, *, steps: int, frames: int, width: int, height: int, prompts: dict[str, str],
          references: int, name=lambda field: "--" + field.replace("_", "-")) -> None:
    """Raise H3Error naming the first value beyond `limits`; `name` spells a field (a flag or a JSON field)."""
    if steps > limits.max_steps:
        raise H3Error(f"{name('steps')} {steps} is over the limit of {limits.max_steps} (--max-steps)")
    if frames > limits.max_frames:
        raise H3Error(f"{name('frames')} {frames} is over the limit of {limits.max_frames} (--max-frames)")
    px = width * height * frames
    if px > limits.max_pixel_frames:
        raise H3Error(f"{name('width')} × {name('height')} × {name('frames')} = {width}×{height}×{frames} = {px} "
                      f"is over the limit of {limits.max_pixel_frames} (--max-pixel-frames)")
    for field, text in prompts.items():
        if len(text) > limits.max_prompt_chars:
            raise H3Error(f"{name(field)} has {len(text)} characters, over the limit of {limits.max_prompt_chars} "
                          f"(--max-prompt-chars)")
    if references > limits.max_references:
        raise H3Error(f"{references} reference files is over the limit of {limits.max_references} "
                      f"(--max-references)")
