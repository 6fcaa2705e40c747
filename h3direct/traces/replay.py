"""Teacher-forced re-runs of single h3direct layers from a recorded trace.

Each *site* is one recorded tensor (`blocks.3.attn.qkv_proj.out`, …) that h3direct can recompute from
other recorded tensors (its inputs) with one layer of its own. Sites whose inputs a trace does not hold
(e.g. `trace_detail: reduced`) are skipped. Used by the parity gate (per-layer, teacher-forced tests) and by
`python -m oracle replay --direct`.

Recorded tensors are stored widened to float32; they are narrowed back to the dtype ComfyUI produced
(exact) before being fed to a layer, so bf16 layers see bit-identical inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h3direct.dit.attention import attention, sequence_hints
from h3direct.dit.blocks import gated_residual_, modulate_
from h3direct.dit.embed import condition_rows, pack_audio, patchify_video, sinusoid_features
from h3direct.dit.model import Conditioning, H3DiT
from h3direct.dit.options import DEFAULT_BACKEND, Options, options_of
from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table
from h3direct.dit.timesteps import plan_timesteps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64}


@dataclass(frozen=True)
class Site:
    name: str  # the recorded tensor this site reproduces
    kind: str  # budget key: linear | norm | rope | attention | adaln | modulate | block | embed | time | output
    needs: tuple[str, ...]  # recorded tensors it reads
    run: Callable[[], torch.Tensor]
    # the positional inputs of the module that produced `name` (ComfyUI's call signature), derived like `run`'s;
    # None in the list = a non-tensor argument (taken from the manifest's static_inputs by the oracle)
    args: Callable[[], list] | None = None
    # attention kernel sites: (q, k, v as the attention seam takes them [B, H, S, D], rows before the target video
    # or None) -- what the gate hands an approximate backend and exact fp32 attention alike
    operands: Callable[[], tuple] | None = None


# Tensors ComfyUI keeps in float32 when it computes in bf16/fp16 (read off its bf16 traces): the sampler's latents,
# the timestep path, the patch embeddings and the output projections.
FP32_ISLANDS = ("sampler.", "dit_forward.", "dit_inner.", "video_patch_proj.", "audio_patch_proj.", "time_embedder.",
                "final_layer.video_out.", "final_layer.audio_out.", "final_layer.out.", "sample_out.")


class TraceView:
    """Recorded tensors in their produced dtype, on a device.

    A module input (`blocks.0.in.1`, …) that the trace does not hold is derived from what it does hold, the way
    the model computes it (`derive`): traces of other tools record outputs and leave inputs to be derived from
    the previous layer (../shared/oracle/README.md). Recorded tensors always win.

    For a model computing in another dtype than the trace (bf16 against an fp32 trace): `dtypes_from`, ComfyUI's
    own trace of the case in that dtype, gives each tensor's dtype; without one, `compute_dtype` replaces float32
    outside ComfyUI's float32 islands. `widen`: every recorded tensor in float32 instead (an fp32 model fed the
    recorded low-precision values: the fp32 evaluation of each layer on exactly ComfyUI's inputs)."""

    def __init__(self, trace, device="cpu", dtypes_from=None, compute_dtype=None, widen=False):
        self.trace, self.device, self.dtypes_from, self.compute_dtype = trace, device, dtypes_from, compute_dtype
        self.widen = widen  # every recorded float tensor as float32 (its recorded values): an fp32 model's inputs
        self.derivations: dict[str, tuple[Callable[[], torch.Tensor], tuple[str, ...]]] = {}
        self.cache: dict[str, torch.Tensor] = {}

    def derive(self, name: str, fn: Callable[[], torch.Tensor], needs) -> None:
        self.derivations[name] = (fn, tuple(needs))

    def __contains__(self, name):
        if name in self.trace:
            return True
        d = self.derivations.get(name)
        return d is not None and all(n in self for n in d[1])

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.trace and name in self.derivations:
            if name not in self.cache:
                self.cache[name] = self.derivations[name][0]()
            return self.cache[name]
        t = self.trace.get(name)
        if self.widen and t.is_floating_point():
            return t.to(self.device, torch.float32)
        src = self.dtypes_from if self.dtypes_from is not None and name in self.dtypes_from else self.trace
        dtype = DTYPES.get(src.produced_dtype(name) or "", t.dtype)
        if (self.dtypes_from is None and self.compute_dtype is not None and dtype == torch.float32
                and not name.startswith(FP32_ISLANDS)):
            dtype = self.compute_dtype
        return t.to(self.device).to(dtype)


def sites(model: H3DiT, trace, cond: Conditioning, text_states: torch.Tensor | None = None, *,
          backend: str | Options = DEFAULT_BACKEND, device="cpu", dtypes_from=None, compute_dtype=None,
          view: TraceView | None = None) -> Iterator[Site]:
    """Every teacher-forced site of `model` for this trace, in execution order (available or not). `backend`: an
    attention backend's name (every option at its default) or the run's `Options`.

    dtypes_from, compute_dtype: see TraceView (a bf16 model against an fp32 trace). `view`: the TraceView the sites
    read (and register their derivable inputs in); default a new one."""
    c, T = model.config, view or TraceView(trace, device, dtypes_from, compute_dtype)
    H, D = c.num_attention_heads, c.attention_head_dim

    def site(name, kind, needs, fn, args=None):
        return Site(name, kind, tuple(needs), fn, args)

    # ---- text: condition_proj and the token refiner ---------------------------------------
    if text_states is not None:
        text = lambda: text_states[0].to(device, model.compute_dtype)  # noqa: E731
        yield site("condition_proj.out", "linear", (), lambda: model.condition_proj(text()), lambda: [text()])
    prev = "condition_proj.out"
    for i, blk in enumerate(model.token_refiner.blocks):
        p = f"token_refiner.blocks.{i}"
        yield from _attention_sites(p, blk, T, H, D, backend, rope=False, dtype=model.compute_dtype)
        yield site(f"{p}.norm1.out", "norm", [prev], lambda blk=blk, prev=prev: blk.norm1(T(prev)),
                   lambda prev=prev: [T(prev)])
        residual = lambda prev=prev, p=p: T(f"{p}.attn.out_proj.out") + T(prev)  # noqa: E731
        yield site(f"{p}.norm2.out", "norm", [prev, f"{p}.attn.out_proj.out"],
                   lambda blk=blk, residual=residual: blk.norm2(residual()), lambda residual=residual: [residual()])
        yield from _mlp_sites(p, blk.mlp, T)
        yield site(f"{p}.out", "block", [prev], lambda blk=blk, prev=prev: blk(T(prev), options=options_of(backend)),
                   lambda prev=prev: [T(prev)])
        prev = f"{p}.out"
    yield site("token_refiner.final_norm.out", "norm", [prev],
               lambda prev=prev: model.token_refiner.final_norm(T(prev)), lambda prev=prev: [T(prev)])

    # ---- embeddings --------------------------------------------------------------------------
    if not c.is_curve:
        te = model.time_embedder

        def te_features():
            return sinusoid_features(T("time_embedder.in.0"), te.freq_dim)

        yield site("time_embedder.proj_in.out", "linear", ["time_embedder.in.0"], lambda: te.proj_in(te_features()),
                   lambda: [te_features()])
        yield site("time_embedder.out", "time", ["time_embedder.in.0"], lambda: te(T("time_embedder.in.0")),
                   lambda: [T("time_embedder.in.0")])
        yield site("time_embedder.proj_out.out", "linear", ["time_embedder.proj_in.out"],
                   lambda: te.proj_out(F.silu(T("time_embedder.proj_in.out"))),
                   lambda: [F.silu(T("time_embedder.proj_in.out"))])

    def layout_and_plan():
        return layout_and_plan_of(model, T, cond)

    inner = INNER

    def embed(which):
        v, a = T("dit_inner.in.video"), T("dit_inner.in.audio")
        pad = (0, v.shape[4] % 2, 0, v.shape[3] % 2, 0, 0)
        v = F.pad(v, pad, mode="circular") if any(pad) else v
        cv, ca = condition_rows(cond.cond_video_latents(), cond.cond_audio_latents(), seed=int(cond.seed),
                                visual_keep=float(cond.visual_cond_noise_aug),
                                audio_keep=float(cond.audio_cond_noise_aug), device=device, patch=c.patch_size)
        if which == "video":
            rows = patchify_video(v.float(), c.patch_size)
            return model.video_patch_proj(rows if cv is None else torch.cat([cv, rows]))
        rows = pack_audio(a.float())
        return model.audio_patch_proj(rows if ca is None else torch.cat([ca, rows]))

    def t_emb():
        return model.time_embedding(layout_and_plan()[1].values, device)

    def rope_table():
        layout = layout_and_plan()[0]
        return rotation_table(rope_angles(layout.position_ids, model.rope.inv_freq.to(device)), model.compute_dtype)

    # module inputs a trace may not hold, derived from the stream-level inputs like the model does
    T.derive("time_embedder.in.0",
             lambda: torch.tensor(layout_and_plan()[1].values, dtype=torch.float32, device=device), inner)
    T.derive("blocks.0.in.1", t_emb, inner)
    T.derive("blocks.0.in.3", rope_table, inner)
    T.derive("blocks.0.in.0", lambda: _packed_input(model, T, cond, layout_and_plan()[0]),
             inner + ("video_patch_proj.out", "audio_patch_proj.out"))
    yield site("layout.position_ids", "embed", inner, lambda: layout_and_plan()[0].position_ids)
    yield site("blocks.0.in.1", "time", inner, t_emb)
    yield site("blocks.0.in.3", "rope", inner, rope_table)
    yield site("video_patch_proj.out", "embed", inner, lambda: embed("video"))
    yield site("audio_patch_proj.out", "embed", inner, lambda: embed("audio"))
    yield site("blocks.0.in.0", "embed", inner + ("video_patch_proj.out", "audio_patch_proj.out"),
               lambda: _packed_input(model, T, cond, layout_and_plan()[0]))

    # ---- DiT blocks ---------------------------------------------------------------------------
    temb, table = "blocks.0.in.1", "blocks.0.in.3"
    prev = "blocks.0.in.0"
    for i, blk in enumerate(model.blocks):
        p = f"blocks.{i}"
        x_in = prev
        yield from (site(f"{p}.adaln_proj.out.{k}", "adaln", [temb],
                         lambda blk=blk, k=k: blk.adaln_proj(T(temb))[k], lambda: [T(temb)]) for k in range(6))
        yield site(f"{p}.norm1.out", "norm", [x_in], lambda blk=blk, x_in=x_in: blk.norm1(T(x_in)),
                   lambda x_in=x_in: [T(x_in)])
        ada = [f"{p}.adaln_proj.out.{k}" for k in range(6)]

        def mod(norm_name, k_shift, k_scale, ada=ada):
            runs = layout_and_plan()[1].runs
            return modulate_(T(norm_name).clone(), T(ada[k_shift]), T(ada[k_scale]), runs)

        yield site(f"{p}.attn.in.0", "modulate", [f"{p}.norm1.out", *ada[:2], *inner],
                   lambda p=p, mod=mod: mod(f"{p}.norm1.out", 0, 1))
        if f"{p}.attn.in.0" in T:
            attn_src = ((lambda p=p: T(f"{p}.attn.in.0")), (f"{p}.attn.in.0",))
        else:
            attn_src = ((lambda p=p, mod=mod: mod(f"{p}.norm1.out", 0, 1)), (f"{p}.norm1.out", *ada[:2], *inner))
        yield from _attention_sites(p, blk, T, H, D, backend, rope=True, table=table, src=attn_src,
                                    dtype=model.compute_dtype,
                                    prefix=lambda: layout_and_plan()[0].segment("video").start)

        def after_attn(p=p, x_in=x_in, ada=ada):
            runs = layout_and_plan()[1].runs
            return gated_residual_(T(x_in).clone(), T(ada[2]), T(f"{p}.attn.out_proj.out"), runs)

        yield site(f"{p}.norm2.out", "norm", [x_in, ada[2], f"{p}.attn.out_proj.out", *inner],
                   lambda blk=blk, after_attn=after_attn: blk.norm2(after_attn()),
                   lambda after_attn=after_attn: [after_attn()])
        yield site(f"{p}.mlp.in.0", "modulate", [f"{p}.norm2.out", *ada[3:5], *inner],
                   lambda p=p, mod=mod: mod(f"{p}.norm2.out", 3, 4))
        if f"{p}.mlp.in.0" in T:
            mlp_src = ((lambda p=p: T(f"{p}.mlp.in.0")), (f"{p}.mlp.in.0",))
        else:
            mlp_src = ((lambda p=p, mod=mod: mod(f"{p}.norm2.out", 3, 4)), (f"{p}.norm2.out", *ada[3:5], *inner))
        yield from _mlp_sites(p, blk.mlp, T, src=mlp_src)

        def whole(blk=blk, x_in=x_in):
            runs = layout_and_plan()[1].runs
            return blk(T(x_in).clone(), T(temb), runs, T(table), options=options_of(backend))

        def runs():  # ComfyUI's non-tensor block input: the modulation runs as (start, stop, adaLN row)
            return [(r.start, r.stop, r.row) for r in layout_and_plan()[1].runs]

        yield site(f"{p}.out", "block", [x_in, temb, table, *inner], whole,
                   lambda x_in=x_in: [T(x_in), T(temb), runs(), T(table)])
        prev = f"{p}.out"

    # ---- final layer ----------------------------------------------------------------------------
    fl = model.final_layer
    x_last = "final_layer.in.0" if "final_layer.in.0" in T else prev
    t_last = "final_layer.in.1" if "final_layer.in.1" in T else temb
    yield from (site(f"final_layer.adaln_proj.out.{k}", "adaln", [t_last],
                     lambda k=k: fl.adaln_proj(T(t_last))[k], lambda: [T(t_last)]) for k in range(2))

    def final_norm(which):
        layout, _ = layout_and_plan()
        s = layout.segment(which)
        return fl.norm(T(x_last)[s.start:s.stop])

    def final_rows(which):
        s = layout_and_plan()[0].segment(which)
        return T(x_last)[s.start:s.stop]

    yield site("final_layer.norm.out", "norm", [x_last, *inner], lambda: final_norm("video"),
               lambda: [final_rows("video")])
    yield site("final_layer.norm#1.out", "norm", [x_last, *inner], lambda: final_norm("audio"),
               lambda: [final_rows("audio")])

    def head_in(which):
        layout, plan = layout_and_plan()
        shift, scale = T("final_layer.adaln_proj.out.0"), T("final_layer.adaln_proj.out.1")
        row = plan.video_row if which == "video" else plan.audio_row
        n = T("final_layer.norm.out" if which == "video" else "final_layer.norm#1.out")
        return (n * (1.0 + scale[row]) + shift[row]).to(torch.float32)

    def head(which):
        return (fl.video_out if which == "video" else fl.audio_out)(head_in(which))

    heads_need = ("final_layer.adaln_proj.out.0", "final_layer.adaln_proj.out.1", *inner)
    yield site("final_layer.video_out.out", "output", ("final_layer.norm.out", *heads_need), lambda: head("video"),
               lambda: [head_in("video")])
    yield site("final_layer.audio_out.out", "output", ("final_layer.norm#1.out", *heads_need), lambda: head("audio"),
               lambda: [head_in("audio")])

    # ---- the whole inner forward from the recorded stream-level inputs --------------------------
    def inner_forward(k):
        out = model.forward_inner(T("dit_inner.in.video"), T("dit_inner.in.audio"), T("dit_inner.in.timestep"),
                                  T("dit_inner.in.context"), cond, options=options_of(backend))
        return out[k]

    yield site("dit_inner.out.video", "model", inner, lambda: inner_forward(0))
    yield site("dit_inner.out.audio", "model", inner, lambda: inner_forward(1))


# the recorded stream-level inputs of the inner forward, which the sequence layout and the timestep plan come from
INNER = ("dit_inner.in.video", "dit_inner.in.audio", "dit_inner.in.context", "dit_inner.in.timestep")


def layout_and_plan_of(model: H3DiT, T: TraceView, cond: Conditioning):
    """The sequence layout and the per-run timestep plan of the traced step, from its recorded `INNER` tensors."""
    c = model.config
    v, a, ctx = T("dit_inner.in.video"), T("dit_inner.in.audio"), T("dit_inner.in.context")
    layout = model.layout_for(ctx.shape[1], v, a, cond)
    plan = plan_timesteps(layout, T("dit_inner.in.timestep"), shift_video=c.sigma_shift_video,
                          shift_audio=c.sigma_shift_audio, text_tags=cond.text_token_tags,
                          visual_cond_aug=cond.visual_cond_noise_aug, audio_cond_aug=cond.audio_cond_noise_aug)
    return layout, plan


def _packed_input(model, T, cond, layout):
    ctx = T("dit_inner.in.context")
    vid, aud = T("video_patch_proj.out").to(model.compute_dtype), T("audio_patch_proj.out").to(model.compute_dtype)
    h = torch.empty(layout.seq_len, model.config.hidden_size, dtype=model.compute_dtype, device=vid.device)
    vo = ao = 0
    for s in layout.segments:
        if s.kind == "text":
            h[s.start:s.stop] = ctx[0]
        elif s.kind in ("cond", "ref_img", "video"):
            h[s.start:s.stop] = vid[vo:vo + s.rows]
            vo += s.rows
        else:
            h[s.start:s.stop] = aud[ao:ao + s.rows]
            ao += s.rows
    return h


def _attention_sites(p, blk, T, H, D, backend, *, rope: bool, table: str | None = None, dtype=None,
                     src: tuple[Callable[[], torch.Tensor], tuple[str, ...]] | None = None,
                     prefix: Callable[[], int] | None = None) -> Iterator[Site]:
    """src: (input provider, names it reads); default the recorded norm1 output (refiner blocks). prefix: the rows
    before the target video in the packed sequence (DiT blocks; the attention seam's sequence hint)."""
    attn = blk.attn
    src_fn, src_needs = src or ((lambda: T(f"{p}.norm1.out")), (f"{p}.norm1.out",))
    qkv = f"{p}.attn.qkv_proj.out"
    yield Site(qkv, "linear", src_needs, lambda: attn.qkv_proj(src_fn()), lambda: [src_fn()])

    def part(i):
        x = T(qkv)
        return x[:, i * H * D:(i + 1) * H * D]

    if rope:
        def roped(i, norm):
            s = T(qkv).shape[0]
            return rms_norm_rope(part(i).reshape(1, s, H, D), norm.weight, T(table), norm.eps)[0]

        yield Site(f"{p}.attn.rope_q", "rope", (qkv, table), lambda: roped(0, attn.q_norm))
        yield Site(f"{p}.attn.rope_k", "rope", (qkv, table), lambda: roped(1, attn.k_norm))
        qn, kn = f"{p}.attn.rope_q", f"{p}.attn.rope_k"
    else:
        s_of = lambda: T(qkv).shape[0]  # noqa: E731
        yield Site(f"{p}.attn.q_norm.out", "norm", (qkv,), lambda: attn.q_norm(part(0).reshape(s_of(), H, D)),
                   lambda: [part(0).reshape(s_of(), H, D)])
        yield Site(f"{p}.attn.k_norm.out", "norm", (qkv,), lambda: attn.k_norm(part(1).reshape(s_of(), H, D)),
                   lambda: [part(1).reshape(s_of(), H, D)])
        qn, kn = f"{p}.attn.q_norm.out", f"{p}.attn.k_norm.out"

    def operands():
        s = T(qkv).shape[0]
        q, k = T(qn), T(kn)
        v = part(2).reshape(s, H, D).clone()
        if dtype is not None and q.dtype != dtype:  # the model's attention always sees its compute dtype
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], prefix() if prefix else None

    def attend():
        q, k, v, rows = operands()
        with sequence_hints(rows):
            return attention(q, k, v, options_of(backend).attention)[0]

    yield Site(f"{p}.attn.out_proj.in", "attention", (qkv, qn, kn), attend, operands=operands)
    yield Site(f"{p}.attn.out_proj.out", "linear", (f"{p}.attn.out_proj.in",),
               lambda: attn.out_proj(T(f"{p}.attn.out_proj.in")), lambda: [T(f"{p}.attn.out_proj.in")])
    yield Site(f"{p}.attn.out", "attention", src_needs + ((table,) if rope else ()),
               lambda: attn(src_fn(), T(table) if rope else None, options=options_of(backend)), lambda: [src_fn()])


def _mlp_sites(p, mlp, T, src: tuple[Callable[[], torch.Tensor], tuple[str, ...]] | None = None) -> Iterator[Site]:
    src_fn, src_needs = src or ((lambda: T(f"{p}.norm2.out")), (f"{p}.norm2.out",))
    fc1 = f"{p}.mlp.fc1.out"
    yield Site(fc1, "linear", src_needs, lambda: mlp.fc1(src_fn()), lambda: [src_fn()])

    def swiglu():
        gate, up = T(fc1).chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    yield Site(f"{p}.mlp.fc2.out", "linear", (fc1,), lambda: mlp.fc2(swiglu()), lambda: [swiglu()])
    yield Site(f"{p}.mlp.out", "linear", src_needs, lambda: mlp(src_fn()), lambda: [src_fn()])


def available_sites(model, trace, cond, text_states=None, *, device="cpu", dtypes_from=None, compute_dtype=None,
                    widen=False, **kw) -> list[Site]:
    """Sites whose reference the trace holds and whose every input it holds or can derive (`TraceView`)."""
    view = TraceView(trace, device, dtypes_from, compute_dtype, widen)
    every = list(sites(model, trace, cond, text_states, device=device, view=view, **kw))
    return [s for s in every if s.name in trace and all(n in view for n in s.needs)]
