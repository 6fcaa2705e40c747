"""Ulysses sequence parallelism of the DiT blocks over `torch.distributed` (NCCL on GPUs, gloo on CPUs).

Every rank runs the whole sampling loop on identical inputs; only the DiT blocks are split. The packed
sequence of S rows (text | conditions | references | audio | video) is padded to W·c rows (W ranks,
c = ceil(S / W)) and rank r keeps rows [r·c, r·c + c): its *slice*. The padding rows sit at the very end
of the global sequence (on the last rank(s)), are zero, and are never attended to.

Around each attention, two `all_to_all_single` swap the split axis:

    q|k|v  [c rows, H heads]   --a2a-->  [W·c rows, H/W heads]   (drop the padding rows: S real rows)
    out    [S → W·c rows, H/W]  --a2a-->  [c rows, H heads]

so each rank attends the *whole* sequence for H/W heads: the same arithmetic as one process, per head.
Everything row-wise (linears, norms, rope, adaLN modulation, gated residuals, MLP) runs on the slice; the
rope table and the adaLN runs (row ranges → modulation row, i.e. the per-row segment ids) are cut to the
slice. H3's attention has no mask; the sampler's denoise mask acts on the full latents, outside the DiT.
After the last block the slices are all-gathered so the final layer, the sampler and the writer see the
full sequence on every rank (the embeddings before the first block are computed on every rank: cheap).

Entry points: `init_from_env()` (joins the process group `torchrun` describes in its environment),
`active()`, `is_writer()` (rank 0 writes files), `shutdown()`.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import torch
from einops import rearrange

from h3direct.dit.attention import attention
from h3direct.dit.options import DEFAULT_BACKEND, AttentionOptions
from h3direct.dit.timesteps import ModRun
from h3direct.errors import H3Error

MODE = "ulysses"


@dataclass
class CommStats:
    """Collective traffic of this rank: all-to-all calls, bytes sent to other ranks (as many arrive), seconds."""

    a2a_calls: int = 0
    a2a_bytes: int = 0
    a2a_seconds: float = 0.0
    gather_bytes: int = 0
    timed: bool = False  # synchronize around collectives so the seconds are exact (costs a sync: for measuring)

    def reset(self) -> None:
        self.a2a_calls, self.a2a_bytes, self.a2a_seconds, self.gather_bytes = 0, 0, 0.0, 0


@dataclass
class Shard:
    """This rank's slice of one packed sequence: rows [lo, hi) of S, padded to `rows` = c."""

    seq_len: int  # S, real rows of the whole sequence
    rows: int  # c, rows per rank (padded)
    lo: int
    hi: int

    @property
    def real(self) -> int:
        return self.hi - self.lo


@dataclass
class SequenceParallel:
    """A Ulysses group: `world` ranks of the default process group, this one is `rank`."""

    world: int
    rank: int
    device: torch.device
    group: object = None  # torch.distributed ProcessGroup (None = the default group)
    stats: CommStats = field(default_factory=CommStats)
    shard: Shard | None = None  # set by `split` for the forward in flight

    # ---- checks --------------------------------------------------------------------------------
    def check_heads(self, heads: int) -> None:
        """A head count the world size does not divide cannot be split: one line naming what would work."""
        if heads % self.world:
            ok = [d for d in range(1, heads + 1) if heads % d == 0]
            raise H3Error(f"sequence parallelism over {self.world} ranks: the model's {heads} attention heads are "
                          f"not divisible by {self.world}; use --nproc-per-node one of {', '.join(map(str, ok))}")

    def attach(self, model) -> None:
        """Make `model` (an H3DiT) run its blocks sharded over this group."""
        self.check_heads(model.config.num_attention_heads)
        model.parallel = self

    # ---- sharding ------------------------------------------------------------------------------
    def plan(self, seq_len: int) -> Shard:
        c = -(-seq_len // self.world)
        lo = min(self.rank * c, seq_len)
        return Shard(seq_len, c, lo, min(lo + c, seq_len))

    def split(self, h: torch.Tensor, rope_table: torch.Tensor, runs: list[ModRun]):
        """Full-sequence h [S, hidden], rope table [1, S, 1, R, 2, 2], runs -> this rank's slices of the three
        (and the shard of S rows becomes the current one)."""
        sh = self.shard = self.plan(h.shape[0])
        return self.take(h), self.take(rope_table, 1), local_runs(runs, sh.lo, sh.hi)

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor (S along `dim`), zero-padded to c rows."""
        sh = self.shard
        if x.shape[dim] != sh.seq_len:
            raise ValueError(f"take: dim {dim} has {x.shape[dim]} rows, the sequence has {sh.seq_len}")
        shape = list(x.shape)
        shape[dim] = sh.rows
        local = x.new_zeros(shape)
        local.narrow(dim, 0, sh.real).copy_(x.narrow(dim, sh.lo, sh.real))
        return local

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Slices along `dim` (c rows each) -> the full sequence (S rows) on every rank."""
        sh = self.shard
        if x.shape[dim] != sh.rows:
            raise ValueError(f"gather: dim {dim} has {x.shape[dim]} rows, this rank's slice has {sh.rows}")
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty(self.world * sh.rows, *x.shape[1:])
        if x.is_cuda:
            torch.distributed.all_gather_into_tensor(out, x, group=self.group)
        else:  # gloo: list form
            torch.distributed.all_gather(list(out.chunk(self.world)), x, group=self.group)
        self.stats.gather_bytes += out.numel() * out.element_size()
        return out[:sh.seq_len].movedim(0, dim)

    # ---- the two all-to-alls around attention ---------------------------------------------------
    def _a2a(self, x: torch.Tensor) -> torch.Tensor:
        """all_to_all_single on dim 0 (W equal chunks: chunk j goes to rank j, chunk i comes from rank i)."""
        out = torch.empty_like(x)
        st = self.stats
        if st.timed and x.is_cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        torch.distributed.all_to_all_single(out, x, group=self.group)
        if st.timed and x.is_cuda:
            torch.cuda.synchronize(x.device)
        st.a2a_seconds += time.perf_counter() - t0
        st.a2a_calls += 1
        st.a2a_bytes += x.numel() * x.element_size() * (self.world - 1) // self.world  # leaves this rank
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  backend: str | AttentionOptions = DEFAULT_BACKEND) -> torch.Tensor:
        """`attention()` on the slice: q, k, v [1, H, c, D] (this rank's rows, all heads) -> [1, c, H·D]."""
        sh, w = self.shard, self.world
        qkv = torch.stack((q[0], k[0], v[0]))  # [3, H, c, D]
        send = rearrange(qkv, "n (w hl) c d -> w n hl c d", w=w).contiguous()
        recv = self._a2a(send)  # [w = source rank (its rows), 3, H/W, c, D]
        full = rearrange(recv, "w n hl c d -> n hl (w c) d")[:, :, :sh.seq_len]  # the padding rows are dropped
        q, k, v = (t.unsqueeze(0) for t in full.unbind(0))
        out = attention(q, k, v, backend)[0]  # [S, (H/W)·D]
        padded = out.new_zeros(w * sh.rows, out.shape[1])
        padded[:sh.seq_len] = out
        back = self._a2a(padded.view(w, sh.rows, out.shape[1]))  # [w = source rank (its heads), c, (H/W)·D]
        return rearrange(back, "w c hd -> c (w hd)").unsqueeze(0)

    # ---- tracing -------------------------------------------------------------------------------
    def record_hook(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Tracer hook inside the sharded blocks: per-row tensors are gathered to the full sequence, so a
        sharded trace has the names and shapes of a single-process one. Not per-row: the adaLN inputs and
        outputs (time embeddings) and a block's t_emb argument (`blocks.N.in.1`)."""
        base = re.sub(r"#\d+", "", name)
        if ".adaln_proj" in base or (base.count(".") == 3 and base.endswith(".in.1")):
            return tensor
        return self.gather(tensor, 1 if tensor.ndim == 6 else 0)  # 6-D: the rope table [1, S, 1, R, 2, 2]


def local_runs(runs: list[ModRun], lo: int, hi: int) -> list[ModRun]:
    """Modulation runs cut to rows [lo, hi), renumbered from 0 (runs outside vanish)."""
    return [ModRun(max(r.start, lo) - lo, min(r.stop, hi) - lo, r.row) for r in runs if r.start < hi and r.stop > lo]


# ---- the process group -------------------------------------------------------------------------

_ACTIVE: SequenceParallel | None = None


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise H3Error(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def init_from_env(requested: int | None = None, device: str | torch.device | None = None) -> SequenceParallel | None:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT).

    requested: `--sequence-parallel N` (None: the whole torchrun world; 1: off). Returns the group, or None
    for a single process. On CUDA each rank takes `cuda:LOCAL_RANK` and NCCL; on the CPU gloo.
    """
    global _ACTIVE
    world = env_world_size()
    if requested is not None and requested < 1:
        raise H3Error(f"--sequence-parallel {requested}: must be at least 1")
    if requested not in (None, 1) and requested != world:
        where = f"this torchrun world has {world} processes" if world > 1 else "this is a single process"
        raise H3Error(f"--sequence-parallel {requested}: {where}; run under torchrun --nproc-per-node {requested}")
    if world == 1 or requested == 1:
        if world > 1:
            raise H3Error(f"--sequence-parallel 1 under a torchrun world of {world}: nothing else would use the "
                          f"other ranks; use --nproc-per-node 1")
        return None
    if _ACTIVE is not None:
        return _ACTIVE
    import torch.distributed as dist

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise H3Error(f"--device {device}: no CUDA device is available")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    _ACTIVE = SequenceParallel(dist.get_world_size(), dist.get_rank(), dev)
    return _ACTIVE


def active() -> SequenceParallel | None:
    return _ACTIVE


def is_writer() -> bool:
    """True on the rank that writes outputs (rank 0; the only rank without sequence parallelism)."""
    return _ACTIVE is None or _ACTIVE.rank == 0


def manifest_fields() -> dict:
    return {"world_size": 1 if _ACTIVE is None else _ACTIVE.world,
            "sequence_parallel": None if _ACTIVE is None else MODE}


def shutdown() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _ACTIVE = None
