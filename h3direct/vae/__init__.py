"""H3 video and audio VAEs (ComfyUI key layout) and their public decode/encode entry points."""

from h3direct.vae.api import decode_audio, decode_video, decode_video_frames, encode_audio, encode_video
from h3direct.vae.audio import AudioVAE
from h3direct.vae.config import AUDIO_PRESETS, VIDEO_PRESETS, AudioVAEConfig, VideoVAEConfig
from h3direct.vae.loader import load_audio_vae, load_vae, load_video_vae
from h3direct.vae.video import VideoVAE

__all__ = [
    "AUDIO_PRESETS", "VIDEO_PRESETS", "AudioVAE", "AudioVAEConfig", "VideoVAE", "VideoVAEConfig",
    "decode_audio", "decode_video", "decode_video_frames", "encode_audio", "encode_video", "load_audio_vae", "load_vae",
    "load_video_vae",
]
