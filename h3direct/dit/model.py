"""H3DiT: the MiniMax H3 audio-video DiT. Module paths are ComfyUI's checkpoint keys.

`forward_inner` is ComfyUI's `MiniMaxH3Model._forward`: stream-level latents in (audio at its own σ_a),
raw model outputs out ([−v_video, −v_audio]). The sampler-facing wrapper (audio carry, x0) is
`h3direct.dit.denoiser`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from h3direct.config import H3Config
from h3direct.dit.attention import sequence_hints
from h3direct.dit.blocks import DiTBlock, FinalLayer, TokenRefiner
from h3direct.dit.embed import (
    TimeEmbedder,
    condition_rows,
    curve_embedding,
    pack_audio,
    patchify_video,
    unpack_audio,
    unpatchify_video,
)
from h3direct.dit.host import upload
from h3direct.dit.linear import Linear
from h3direct.dit.options import DEFAULT_OPTIONS, Options
from h3direct.dit.rope import rope_angles, rotation_table
from h3direct.dit.sequence import AUDIO_KINDS, VIDEO_KINDS, PackedLayout, build_layout
from h3direct.dit.timesteps import AUDIO_COND_TIMESTEP, VISUAL_COND_TIMESTEP, host_tags, plan_timesteps
from h3direct.errors import H3Error


@dataclass
class Conditioning:
    """What ComfyUI's `minimax_payload` carries into the DiT (tensors on any device).

    keyframes: [{resolved_frame_index, latent [1,C,t,h,w] | None, audio_latent [1,C,2,t] | None}]
    refs:      [{kind: image|video|video_audio|audio, latent_t, latent_h, latent_w, ref_audio_t,
                 latent [1,C,t,h,w] (not for audio), audio_latent [1,C,2,t] | None}]
    """

    text_token_tags: torch.Tensor | None = None
    keyframes: list[dict] = field(default_factory=list)
    refs: list[dict] = field(default_factory=list)
    seed: int = 0
    visual_cond_noise_aug: float = VISUAL_COND_TIMESTEP
    audio_cond_noise_aug: float = AUDIO_COND_TIMESTEP

    def cond_video_latents(self) -> list[torch.Tensor]:
        return ([kf["latent"] for kf in self.keyframes if kf.get("latent") is not None]
                + [r["latent"] for r in self.refs if r.get("latent") is not None])

    def cond_audio_latents(self) -> list[torch.Tensor]:
        return ([kf["audio_latent"] for kf in self.keyframes if kf.get("audio_latent") is not None]
                + [r["audio_latent"] for r in self.refs if r.get("audio_latent") is not None])


class StepInvariants:
    """What every forward with one context and one conditioning shares, made on the first call and kept by the caller
    (a `Denoiser`) for the next ones: the packed layout, its rope table, the condition rows and the host copy of the
    text tags. None of it depends on σ. Each piece is reused only while what it was made from is unchanged: the layout
    for the same conditioning object (its keyframes and references place rows) while its signature matches the
    inputs, the rope table for the same layout object, model, device and dtype, the condition rows for the same model,
    latent tensor objects, seed, noise levels and device, the tags for the same tag tensor. The conditioning is not
    expected to change in place between calls (a Denoiser's conditioning is fixed).
    """

    def __init__(self):
        self.layout: PackedLayout | None = None
        self._layout_cond = None  # the Conditioning `layout` was made for
        self._rope = None  # (layout, model, device, dtype, table)
        self._cond = None  # (key, (video rows | None, audio rows | None))
        self._tags = None  # (tag tensor, host list)

    def packed_layout(self, model: H3DiT, context_len: int, video: torch.Tensor, audio: torch.Tensor,
                      cond: Conditioning) -> PackedLayout:
        if (self.layout is None or self._layout_cond is not cond
                or self.layout.signature != (context_len, *video.shape[2:], audio.shape[-1])):
            self.layout, self._layout_cond = model.layout_for(context_len, video, audio, cond), cond
        return self.layout

    def rope_table(self, model: H3DiT, layout: PackedLayout, device) -> torch.Tensor:
        device, r = torch.device(device), self._rope
        if r is None or r[0] is not layout or r[1] is not model or r[2] != device or r[3] != model.compute_dtype:
            self._rope = r = (layout, model, device, model.compute_dtype, model.rope_table(layout, device))
        return r[4]

    def condition_rows(self, model: H3DiT, cond: Conditioning, device):
        latents = (model, *cond.cond_video_latents(), None, *cond.cond_audio_latents())
        key = (latents, int(cond.seed), float(cond.visual_cond_noise_aug), float(cond.audio_cond_noise_aug),
               torch.device(device))
        if self._cond is None or not _same_key(self._cond[0], key):
            self._cond = (key, model.condition_rows(cond, device))
        return self._cond[1]

    def text_tags(self, tags: torch.Tensor | None) -> list[int] | None:
        if tags is None:
            return None
        if self._tags is None or self._tags[0] is not tags:
            self._tags = (tags, host_tags(tags))
        return self._tags[1]


def _same_key(a: tuple, b: tuple) -> bool:
    """Keys of `StepInvariants.condition_rows`: the model and latents compared by identity, the rest by value."""
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0], strict=True))
            and a[1:] == b[1:])


class H3DiT(nn.Module):
    def __init__(self, config: H3Config):
        super().__init__()
        c = self.config = config
        curve = c.is_curve
        self.video_patch_proj = Linear(c.video_patch_dim, c.hidden_size, island=True)
        self.audio_patch_proj = Linear(c.audio_latents_dim, c.hidden_size, island=True)
        self.condition_proj = Linear(c.text_dim, c.hidden_size)
        if curve:
            self.register_buffer("adaln_t_table", torch.empty(c.adaln_curve_grid, c.time_embed_dim))
        else:
            self.time_embedder = TimeEmbedder(c.timestep_input_dim, c.time_embed_hidden_size, c.time_embed_dim)
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.empty(c.rope_inv_freq_len))
        self.token_refiner = TokenRefiner(c.token_refiner_num_layers, c.hidden_size, c.num_attention_heads,
                                          c.attention_head_dim, c.ffn_hidden_size, c.norm_eps, c.qk_norm_eps,
                                          c.final_norm_eps)
        self.blocks = nn.ModuleList(
            DiTBlock(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.ffn_hidden_size,
                     c.time_embed_dim, c.norm_eps, c.qk_norm_eps, curve) for _ in range(c.num_layers))
        self.final_layer = FinalLayer(c.hidden_size, c.time_embed_dim, c.video_patch_dim, c.audio_latents_dim,
                                      c.final_norm_eps, curve)
        self.compute_dtype = torch.float32  # set by the loader
        self.tracer = None
        self.parallel = None  # a parallel.SequenceParallel: the blocks run on this rank's slice of the sequence

    # ---- text ------------------------------------------------------------------------------
    def preprocess_text(self, text_states: torch.Tensor, *, options: Options = DEFAULT_OPTIONS) -> torch.Tensor:
        """[1, L, text_dim] Qwen3-VL layer-50 states -> [1, L, hidden] refined (once per sampling run)."""
        text_states = text_states.to(self.compute_dtype)  # ComfyUI casts to the inference dtype first
        if text_states.shape[-1] == self.config.hidden_size:
            return text_states  # ComfyUI treats hidden-sized states as already refined
        return self.token_refiner(self.condition_proj(text_states[0]), options=options).unsqueeze(0)

    # ---- pieces of the forward -------------------------------------------------------------
    def layout_for(self, context_len: int, video: torch.Tensor, audio: torch.Tensor,
                   cond: Conditioning) -> PackedLayout:
        t, h, w = video.shape[2], video.shape[3], video.shape[4]
        _, ph, pw = self.config.patch_size
        for what, items in (("keyframe", cond.keyframes), ("reference", cond.refs)):
            for i, item in enumerate(items):
                z = item.get("latent")
                if z is not None and (z.shape[-2] % ph or z.shape[-1] % pw):
                    raise H3Error(f"{what} {i} latent is {z.shape[-2]}x{z.shape[-1]}: condition latents must be "
                                  f"multiples of the {ph}x{pw} patch (only the target latent is padded)")
        return build_layout(context_len, t, h + h % 2, w + w % 2, audio.shape[-1],
                            keyframes=cond.keyframes, refs=cond.refs)

    def time_embedding(self, values: list[float], device) -> torch.Tensor:
        t = upload(torch.tensor(values, dtype=torch.float32), device)  # no read-back wait on a GPU
        if self.config.is_curve:
            return curve_embedding(self.adaln_t_table.to(device), t)
        return self.time_embedder(t).to(self.compute_dtype)

    def condition_rows(self, cond: Conditioning, device):
        """(video, audio) condition rows (fp32 on `device`, None where absent): patchified and noise-augmented."""
        return condition_rows(cond.cond_video_latents(), cond.cond_audio_latents(), seed=int(cond.seed),
                              visual_keep=float(cond.visual_cond_noise_aug),
                              audio_keep=float(cond.audio_cond_noise_aug), device=device,
                              patch=self.config.patch_size)

    def rope_table(self, layout: PackedLayout, device) -> torch.Tensor:
        """[1, S, 1, R, 2, 2] rotation table of the layout's positions, in the compute dtype."""
        return rotation_table(rope_angles(layout.position_ids, self.rope.inv_freq.to(device)), self.compute_dtype)

    def embed_rows(self, layout: PackedLayout, video: torch.Tensor, audio: torch.Tensor, context: torch.Tensor,
                   cond: Conditioning, cond_rows=None) -> torch.Tensor:
        """The packed hidden states [S, hidden] in the compute dtype. `cond_rows`: `condition_rows(cond)` made
        earlier (they do not change between steps)."""
        device, dtype = video.device, self.compute_dtype
        video_rows = patchify_video(video.float(), self.config.patch_size)
        audio_rows = pack_audio(audio.float())
        cond_v, cond_a = self.condition_rows(cond, device) if cond_rows is None else cond_rows
        # condition rows precede the target rows of the same modality, segment order
        all_video = video_rows if cond_v is None else torch.cat([cond_v, video_rows])
        all_audio = audio_rows if cond_a is None else torch.cat([cond_a, audio_rows])
        video_embed = self.video_patch_proj(all_video).to(dtype)
        audio_embed = self.audio_patch_proj(all_audio).to(dtype)

        h = torch.empty(layout.seq_len, self.config.hidden_size, dtype=dtype, device=device)
        vo = ao = 0
        for seg in layout.segments:
            if seg.kind == "text":
                h[seg.start:seg.stop] = context[0]
            elif seg.kind in VIDEO_KINDS:
                h[seg.start:seg.stop] = video_embed[vo:vo + seg.rows]
                vo += seg.rows
            elif seg.kind in AUDIO_KINDS:
                h[seg.start:seg.stop] = audio_embed[ao:ao + seg.rows]
                ao += seg.rows
        if vo != video_embed.shape[0] or ao != audio_embed.shape[0]:
            raise ValueError(f"conditioning latents give {video_embed.shape[0]} video / {audio_embed.shape[0]} "
                             f"audio rows, layout expects {vo} / {ao}: refs/keyframes and latents disagree")
        return h

    # ---- forward ---------------------------------------------------------------------------
    def forward_inner(self, video: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor,
                      context: torch.Tensor, cond: Conditioning | None = None, *,
                      options: Options = DEFAULT_OPTIONS, layout: PackedLayout | None = None,
                      invariants: StepInvariants | None = None,
                      times: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ComfyUI's `_forward`. video [1,C,T,H,W], audio [1,Ca,2,Ta] (own σ_a), timestep [1] = 1000·σ_v,
        context [1, L, hidden] refined text -> (−v_video, −v_audio) in the inputs' dtypes. `options`: the
        generation's attention and kernel options (`dit/options.py`).

        `invariants`: the caller's `StepInvariants` (layout, rope table, condition rows, tags: made once, reused);
        `times`: (t_video, t_audio) of `timestep` from `timesteps.host_stream_times`. With both, a call after the first
        reads nothing back from the device and leaves the GPU no host work to wait for."""
        cond = cond or Conditioning()
        c = self.config
        orig_t, orig_h, orig_w = video.shape[2:]
        if video.shape[0] != 1:
            raise ValueError("H3 supports batch size 1")
        ph, pw = c.patch_size[1], c.patch_size[2]
        pad = (0, (pw - orig_w % pw) % pw, 0, (ph - orig_h % ph) % ph, 0, 0)
        video_p = F.pad(video, pad, mode="circular") if any(pad) else video
        if context.shape[-1] != c.hidden_size:
            context = self.preprocess_text(context, options=options)
        inv = invariants
        if layout is None and inv is not None:
            layout = inv.packed_layout(self, context.shape[1], video_p, audio, cond)
        elif layout is None or layout.signature != (context.shape[1], *video_p.shape[2:], audio.shape[-1]):
            layout = self.layout_for(context.shape[1], video_p, audio, cond)
        self._record("layout.position_ids", layout.position_ids)

        tags = cond.text_token_tags if inv is None else inv.text_tags(cond.text_token_tags)
        plan = plan_timesteps(layout, timestep, shift_video=c.sigma_shift_video, shift_audio=c.sigma_shift_audio,
                              text_tags=tags, visual_cond_aug=cond.visual_cond_noise_aug,
                              audio_cond_aug=cond.audio_cond_noise_aug, times=times)
        device = video.device
        h = self.embed_rows(layout, video_p, audio, context, cond,
                            cond_rows=None if inv is None else inv.condition_rows(self, cond, device))
        t_emb = self.time_embedding(plan.values, device)
        rope_table = self.rope_table(layout, device) if inv is None else inv.rope_table(self, layout, device)
        runs, sp = plan.runs, self.parallel
        with sequence_hints(layout.segment("video").start):  # rows before the target video: conditioning
            if sp is None:
                for block in self.blocks:
                    h = block(h, t_emb, runs, rope_table, options=options)
            else:  # Ulysses: this rank's rows; attention sees every row (a head slice), so the hint stays global
                h, rope_table, runs = sp.split(h, rope_table, runs)
                with _tracer_hook(self.tracer, sp.record_hook):
                    for block in self.blocks:
                        h = block(h, t_emb, runs, rope_table, options=options, sp=sp)
                h = sp.gather(h)

        vs, aseg = layout.segment("video"), layout.segment("audio")
        v, a = self.final_layer(h, t_emb, (vs.start, vs.stop, plan.video_row), (aseg.start, aseg.stop, plan.audio_row))
        t, hp, wp = video_p.shape[2], video_p.shape[3] // ph, video_p.shape[4] // pw
        video_out = unpatchify_video(v, t, hp, wp, c.latents_dim, c.patch_size)[:, :, :orig_t, :orig_h, :orig_w]
        audio_out = unpack_audio(a)
        return -video_out.to(video.dtype), -audio_out.to(audio.dtype)

    def _record(self, name, tensor):
        if self.tracer is not None:
            self.tracer.record(name, tensor)


@contextmanager
def _tracer_hook(tracer, hook):
    """Route a tracer's records through `hook` (sharded blocks gather their per-row tensors)."""
    if tracer is None:
        yield
        return
    tracer.gather = hook
    try:
        yield
    finally:
        tracer.gather = None
