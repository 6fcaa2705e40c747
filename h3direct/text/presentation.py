"""H3's text presentation: what the Qwen3-VL text encoder is fed for a prompt and its references, and the token
tags. (The encoder itself: `qwen.py`; loading its files and a tokenizer: `load.py`.)

Presentation: no chat template; raw text ids (no special tokens) with vision blocks spliced in, in order:
  image → "<Picture i>: " <vision_start> vision <vision_end>
  audio → "<Audio j>: "                           (audio never enters Qwen)
  video → "<Video k>: " then per 2-frame block "<T.T seconds>" <vision_start> vision <vision_end>
          (odd frame counts repeat the last frame and timestamp; T.T = mean of the pair)
then the prompt. An empty sequence is the single pad id 151643. Tags: 1 = text, 0 = the whole vision
block including its start/end tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from h3direct.errors import H3Error
from h3direct.text.vision import merged_tokens

PAD_ID = 151643
VISION_START = 151652
VISION_END = 151653
VISION_PAD = -1  # placeholder id in `token_ids` for a vision position

Tokenize = Callable[[str], list]


@dataclass
class TextConditioning:
    states: torch.Tensor  # [1, L, D] float32
    tags: torch.Tensor  # [L] int64, 1 text / 0 vision


@dataclass
class VisionEntry:
    frames: torch.Tensor  # [1, H, W, 3] image or [2, H, W, 3] video block, in [0, 1]
    start: int  # index of its first position in token_ids
    count: int  # merged positions


@dataclass
class Presentation:
    token_ids: list  # ints; VISION_PAD (−1) at vision positions
    tags: torch.Tensor  # [L] int64
    vision: list = field(default_factory=list)  # VisionEntry, in sequence order


def vision_pad_count(height: int, width: int) -> int:
    """Merged Qwen vision tokens of one frame (or 2-frame block) of size height×width."""
    return merged_tokens(height, width)


def build_presentation(prompt: str, items: Sequence, tokenize: Tokenize) -> Presentation:
    """Token ids and tags for `items` (conditioning.PresentationItem list) then the prompt."""
    ids: list = []
    tags: list = []
    vision: list = []

    def text(s: str) -> None:
        t = list(tokenize(s))
        ids.extend(t)
        tags.extend([1] * len(t))

    def add_vision(frames: torch.Tensor) -> None:
        n = vision_pad_count(frames.shape[1], frames.shape[2])
        vision.append(VisionEntry(frames, len(ids) + 1, n))
        ids.extend([VISION_START] + [VISION_PAD] * n + [VISION_END])
        tags.extend([0] * (n + 2))

    count = {"image": 0, "audio": 0, "video": 0}
    for it in items:
        if it.kind not in count:
            raise H3Error(f"presentation item kind {it.kind!r}: use image, audio or video")
        count[it.kind] += 1
        if it.kind == "image":
            text(f"<Picture {count['image']}>: ")
            add_vision(it.frames[:1])
        elif it.kind == "audio":
            text(f"<Audio {count['audio']}>: ")
        else:
            frames, stamps = it.frames, list(it.timestamps or [i / 2.0 for i in range(it.frames.shape[0])])
            if frames.shape[0] % 2:
                frames = torch.cat([frames, frames[-1:]])
                stamps.append(stamps[-1])
            text(f"<Video {count['video']}>: ")
            for i in range(0, frames.shape[0], 2):
                text("<%.1f seconds>" % ((stamps[i] + stamps[i + 1]) / 2.0))
                add_vision(frames[i : i + 2])
    text(prompt)
    if not ids:
        ids, tags = [PAD_ID], [1]
    return Presentation(ids, torch.tensor(tags, dtype=torch.long), vision)
