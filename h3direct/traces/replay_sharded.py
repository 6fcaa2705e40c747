"""Teacher-forced sites of the sequence-parallel DiT (`h3direct.dit.parallel`), for a run under torchrun.

Each site feeds recorded full-sequence tensors of a trace to this rank's slice (`SequenceParallel.take`),
runs the sharded layer (all-to-all around attention), gathers the slices back, and returns the
full-sequence result, comparable with the trace like any `replay.Site`. Every rank must build and run the
same sites in the same order (they are collective).

Sites, per DiT block: `attn.out_proj.in` (the attention core between the two all-to-alls, from the
recorded qkv and rope'd q/k), `attn.out` (the whole sharded attention module), `out` (the whole sharded
block: adaLN runs and rope table cut to the slice); then `dit_inner.out.*` (the sharded inner forward).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from h3direct.dit.model import Conditioning, H3DiT
from h3direct.dit.options import Options, options_of
from h3direct.dit.parallel import SequenceParallel, local_runs
from h3direct.traces.replay import INNER, Site, TraceView, layout_and_plan_of


def sharded_sites(model: H3DiT, trace, cond: Conditioning, sp: SequenceParallel, *,
                  backend: str | Options = "sdpa", device="cpu") -> Iterator[Site]:
    c, T = model.config, TraceView(trace, device)
    H, D = c.num_attention_heads, c.attention_head_dim
    table = "blocks.0.in.3"

    def runs():
        return layout_and_plan_of(model, T, cond)[1].runs

    def rows(name: str, dim: int = 0) -> torch.Tensor:
        """This rank's slice of a recorded full-sequence tensor (sets the shard from its length)."""
        x = T(name)
        sp.shard = sp.plan(x.shape[dim])
        return sp.take(x, dim)

    for i, blk in enumerate(model.blocks):
        p = f"blocks.{i}"
        qkv, rq, rk = f"{p}.attn.qkv_proj.out", f"{p}.attn.rope_q", f"{p}.attn.rope_k"

        def core(qkv=qkv, rq=rq, rk=rk):
            q, k = rows(rq), rows(rk)  # [c, H, D]
            v = rows(qkv)[:, 2 * H * D:].reshape(-1, H, D)
            out = sp.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                               options_of(backend).attention)
            return sp.gather(out[0])

        yield Site(f"{p}.attn.out_proj.in", "attention", (qkv, rq, rk), core)

        def attn(p=p, blk=blk):
            x = rows(f"{p}.attn.in.0")
            return sp.gather(blk.attn(x, sp.take(T(table), 1), options=options_of(backend), sp=sp))

        yield Site(f"{p}.attn.out", "attention", (f"{p}.attn.in.0", table), attn)

        x_in = f"{p}.in.0" if f"{p}.in.0" in T or i == 0 else f"blocks.{i - 1}.out"

        def whole(blk=blk, x_in=x_in):
            x = rows(x_in)
            sh = sp.shard
            out = blk(x, T("blocks.0.in.1"), local_runs(runs(), sh.lo, sh.hi), sp.take(T(table), 1),
                      options=options_of(backend), sp=sp)
            return sp.gather(out)

        yield Site(f"{p}.out", "block", (x_in, "blocks.0.in.1", table, *INNER), whole)

    def inner(k):
        if model.parallel is not sp:
            raise ValueError("the model must be attached to the group (SequenceParallel.attach)")
        out = model.forward_inner(T("dit_inner.in.video"), T("dit_inner.in.audio"), T("dit_inner.in.timestep"),
                                  T("dit_inner.in.context"), cond, options=options_of(backend))
        return out[k]

    yield Site("dit_inner.out.video", "model", INNER, lambda: inner(0))
    yield Site("dit_inner.out.audio", "model", INNER, lambda: inner(1))


def available_sharded_sites(model, trace, cond, sp, **kw) -> list[Site]:
    """Sites whose reference and every input the trace holds."""
    return [s for s in sharded_sites(model, trace, cond, sp, **kw)
            if s.name in trace and all(n in trace for n in s.needs)]
