"""The H3 DiT: packed audio-video single-stream transformer (one file per part).

- `sequence.py`   packed sequence `[text | cond/ref rows | target audio | target video]` and its float64 rope positions
- `timesteps.py`  per-segment timesteps, audio sigma map, adaLN row selection (modality tags)
- `embed.py`      patchify / audio packing, condition rows (with noise augmentation), time embedder
- `linear.py`     Linear layers for bf16/fp32 and NVFP4 weights (W4A16 / W4A4)
- `rope.py`       rope angles, rotation table, fused per-head RMSNorm + split-half partial rope
- `attention.py`  the attention seam: one free function, a backend registry
- `blocks.py`     Attention, MLP, AdalnProj, RefinerBlock, TokenRefiner, DiTBlock, FinalLayer
- `model.py`      H3DiT (module paths = ComfyUI checkpoint keys) and its inner forward
- `loader.py`     strict checkpoint loading and ComfyUI's dtype policy
- `denoiser.py`   the sampler-facing wrapper: audio carry, x0 prediction, one-step evaluation
- `tracing.py`    per-module tensor recording under the oracle's names
"""
