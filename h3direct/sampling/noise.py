"""Initial noise exactly as ComfyUI draws it for H3's (video, audio) latent pair.

ComfyUI seeds one CPU generator with the seed and draws float32 N(0, 1) for each stream of
the nested latent in order (video first, then audio), each with the stream's full shape.
The noise is *not* carried ×audio_scale: only the clean latent is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AVNoise:
    video: torch.Tensor  # [B, 24, T, H, W] float32
    audio: torch.Tensor  # [B, 32, 2, Ta] float32


def initial_noise(seed: int, video_shape, audio_shape, dtype: torch.dtype = torch.float32) -> AVNoise:
    """Same seed → bitwise the same noise as `comfy.sample.prepare_noise` on the nested latent.

    Uses a private generator (ComfyUI seeds the global one; the draws are identical).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    video = torch.randn(tuple(video_shape), dtype=torch.float32, generator=gen, device="cpu").to(dtype)
    audio = torch.randn(tuple(audio_shape), dtype=torch.float32, generator=gen, device="cpu").to(dtype)
    return AVNoise(video, audio)
