"""h3direct: a direct PyTorch runtime for the MiniMax H3 audio-video diffusion model."""

__version__ = "0.1.0"
