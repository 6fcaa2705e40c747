"""`budget_attn`: block-sparse attention whose every call leaves at most a budgeted share of each query block's
attention mass to the key blocks it drops (options: `budget_options.py`).

Per head and 64-row query block (`select`):

1. estimate: `samples` query rows spread over the block attend every key through the mean keys of 16-token key
   sub-blocks (the softmax over S/16 pooled logits, each weighed by its length): each sampled row's mass on every
   64-token key block, for samples/1024 of the dense scores' arithmetic (exact where a sub-block's keys are equal);
2. choose (`choose`): the key blocks fall in buckets by their mean estimated mass over the sampled rows (half-octaves,
   `mass_bucket`); the lightest buckets are dropped, as many as leave every sampled row's mass on the dropped blocks
   within `mass`, and the forced blocks (the diagonal and its neighbours, the sink blocks of the rows before the target
   video) are kept whatever their mass: the budget held for the worst sampled row, whatever the input (a wide window
   keeps more blocks, a sharp one fewer). With `samples` 64 every row of the block estimates, and on CUDA one fused
   Triton kernel (`budget_select_triton`) runs the estimate and the choice without writing the masses out;
3. attend (`block_sparse_triton`): exact softmax attention over the kept key blocks, and (`tail`) each dropped block
   as one pooled term (its mean key, its mean value, its length) in the same softmax, so the dropped mass stays in
   the denominator. The query blocks of the rows before the target video keep every key block (`exact_rows`).

Where the error comes from: a row's output moves by at most the mass its dropped blocks hold times the distance of
their values from the row's output (less with the pooled tail), so a budget on the dropped mass bounds every row
the estimate covers. What it measured against sol_attn on the validation set: benchmarks/results/LOG.md.

On CUDA the kernel is h3direct's Triton block-sparse kernel, which the gate holds to its eager fp32 reference (the
same selection and arithmetic); on the CPU the backend runs that reference itself (its calls counted as such), so
it runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3direct.dit.budget_options import BUDGET_BLOCK, BUDGET_SUB, BudgetOptions

MAX_LOGITS = 1 << 26  # estimate logits per head chunk (fp32): bounds the selection's transient memory
MASS_BUCKETS = 64  # half-octaves of a key block's mean mass the choice drops whole (down to 2^-31.5)


@dataclass(frozen=True)
class Selection:
    keep: torch.Tensor  # bool [B, H, NQ, NK]: the key blocks each query block attends exactly
    dropped: torch.Tensor  # fp32 [B, H, NQ]: the largest estimated mass a sampled row of the block leaves dropped


def sample_rows(s: int, samples: int, device) -> torch.Tensor:
    """[NQ, samples] row indices spread evenly over each 64-row block (centred in equal parts), inside the sequence."""
    n = -(-s // BUDGET_BLOCK)
    step = BUDGET_BLOCK // samples
    rows = torch.arange(n, device=device).view(n, 1) * BUDGET_BLOCK + (torch.arange(samples, device=device) * step
                                                                       + step // 2).view(1, samples)
    return rows.clamp_max(s - 1)


def pooled_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [H, S, D] -> (fp32 [H, NK·4, D]: the mean key of every 16-token sub-block, fp32 [NK·4]: the log of its
    length, -inf for the empty ones past S): what the block masses are estimated with."""
    h, s, d = k.shape
    n = -(-s // BUDGET_BLOCK)
    pad = n * BUDGET_BLOCK - s
    subs = n * (BUDGET_BLOCK // BUDGET_SUB)
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(h, subs, BUDGET_SUB, d).sum(2)
    lengths = torch.nn.functional.pad(torch.ones(s, device=k.device), (0, pad)).view(subs, BUDGET_SUB).sum(1)
    return kf / lengths.clamp_min(1.0).view(1, -1, 1), lengths.log()


def block_masses(q: torch.Tensor, k: torch.Tensor, samples: int) -> torch.Tensor:
    """q, k [H, S, D] -> fp32 [H, NQ, samples, NK]: each sampled row's estimated mass on every 64-token key block
    (its softmax over the length-weighted mean keys of 16-token sub-blocks)."""
    h, s, d = k.shape
    n = -(-s // BUDGET_BLOCK)
    sub = BUDGET_BLOCK // BUDGET_SUB
    kf, log_len = pooled_keys(k)
    qs = q[:, sample_rows(s, samples, q.device).reshape(-1)].float()  # [H, NQ·samples, D]
    logits = (qs @ kf.transpose(1, 2)) * d ** -0.5 + log_len.view(1, 1, -1)  # empty sub-blocks: -inf
    # a block's mass is the softmax over blocks of its sub-blocks' log-sum-exp (one pass less than a softmax over
    # the sub-blocks summed per block)
    per_block = torch.logsumexp(logits.view(h, n * samples, n, sub), dim=-1)  # [H, NQ·samples, NK]
    return torch.softmax(per_block, dim=-1).view(h, n, samples, n)


def mass_edges(device=None) -> torch.Tensor:
    """fp32 [MASS_BUCKETS]: the upper edges of the buckets a key block's mean mass falls in, 2^(-e/2) for e = 0, 1, …
    (bucket e holds [2^(-(e+1)/2), 2^(-e/2)); the last takes everything below)."""
    return torch.exp2(-0.5 * torch.arange(MASS_BUCKETS, dtype=torch.float64)).float().to(device)


def mass_bucket(mean: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """int64 bucket of each mean mass: how many edges after the first lie above it (0: the heaviest blocks), by a
    binary search of the ascending edges."""
    ascending = edges[1:].flip(0).contiguous()
    return ascending.numel() - torch.bucketize(mean.contiguous(), ascending, right=True)


def choose(m: torch.Tensor, forced: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """m fp32 [..., NQ, R, NK] (each estimating row's block masses), forced bool [NQ, NK] -> (keep bool [..., NQ, NK],
    dropped fp32 [..., NQ]). The key blocks in buckets of their mean mass over the rows (`mass_bucket`); the lightest
    buckets are dropped, as many as leave every row's mass on the dropped blocks within `mass` (the forced blocks are
    always kept); `dropped` is the largest such mass of a row."""
    edges = mass_edges(m.device)
    bucket = mass_bucket(m.mean(-2), edges)  # [..., NQ, NK]
    counted = m.masked_fill(forced.unsqueeze(-2), 0.0)
    hist = torch.zeros(*m.shape[:-1], MASS_BUCKETS, device=m.device)
    hist.scatter_add_(-1, bucket.unsqueeze(-2).expand_as(m), counted)  # [..., NQ, R, buckets]
    worst = hist.flip(-1).cumsum(-1).flip(-1).amax(-2)  # [..., NQ, buckets]: dropping this bucket and every lighter
    cut = MASS_BUCKETS - (worst <= mass).sum(-1)  # the heaviest bucket dropped (MASS_BUCKETS: none)
    keep = forced | (bucket < cut.unsqueeze(-1))
    at_cut = worst.gather(-1, cut.clamp_max(MASS_BUCKETS - 1).unsqueeze(-1)).squeeze(-1)
    return keep, torch.where(cut < MASS_BUCKETS, at_cut, torch.zeros_like(at_cut))


def forced_blocks(n: int, pb: int, sinks: bool, device=None) -> torch.Tensor:
    """bool [NQ, NK]: the diagonal and its neighbours, and with `sinks` the first `pb` key blocks."""
    idx = torch.arange(n, device=device)
    forced = (idx.view(-1, 1) - idx.view(1, -1)).abs() <= 1
    if sinks:
        forced[:, :pb] = True
    return forced


def select(q: torch.Tensor, k: torch.Tensor, prefix_rows: int | None, opts: BudgetOptions) -> Selection:
    """q, k [B, H, S, D] -> the key blocks each query block keeps under the budget (module docstring): the fused
    kernel (`budget_select_triton`) where it runs, the same rule in torch elsewhere."""
    b, h, s, d = q.shape
    n = -(-s // BUDGET_BLOCK)
    dev = q.device
    pb = min(opts.prefix_blocks(prefix_rows), n)
    sinks = opts.sinks == "prefix"
    if fused_reason(q, opts) is None:
        from h3direct.dit import budget_select_triton as K

        pooled, log_len = pooled_keys(k.reshape(b * h, s, d))
        keep, dropped = K.select_blocks(q, pooled, log_len, mass_edges(dev), opts.mass, pb if sinks else 0)
    else:
        forced = forced_blocks(n, pb, sinks, dev)
        keep = torch.zeros(b, h, n, n, dtype=torch.bool, device=dev)
        dropped = torch.zeros(b, h, n, device=dev)
        chunk = max(1, MAX_LOGITS // max(1, n * opts.samples * n * (BUDGET_BLOCK // BUDGET_SUB)))
        for bi in range(b):
            for h0 in range(0, h, chunk):
                m = block_masses(q[bi, h0:h0 + chunk], k[bi, h0:h0 + chunk], opts.samples)  # [hc, NQ, R, NK]
                keep[bi, h0:h0 + chunk], dropped[bi, h0:h0 + chunk] = choose(m, forced, opts.mass)
    if opts.exact_rows and pb:
        keep[:, :, :pb] = True
        dropped[:, :, :pb] = 0.0
    return Selection(keep, dropped)


def fused_reason(q: torch.Tensor, opts: BudgetOptions) -> str | None:
    """Why the selection runs in torch rather than the fused kernel (None: the kernel runs): the kernel estimates from
    every row of a query block, on CUDA."""
    if opts.samples != BUDGET_BLOCK:
        return f"budget_samples={opts.samples} (the kernel takes every row: {BUDGET_BLOCK})"
    if not q.is_cuda:
        return "not CUDA"
    from h3direct.dit import budget_select_triton as K

    return K.kernel_reason(q)


def attend(q, k, v, keep: torch.Tensor, tail: bool) -> torch.Tensor:
    """The kept blocks exactly and the dropped ones pooled: h3direct's Triton kernel on CUDA, its eager fp32
    reference elsewhere; [B, H, S, D] in q's dtype."""
    from h3direct.dit import block_sparse_triton as K

    if q.is_cuda:
        return K.block_sparse_attention(q, k, v, keep, tail=tail)[0]
    return K.block_sparse_reference(q, k, v, keep, tail=tail)[0].to(q.dtype)


def call_reason(q: torch.Tensor, min_tokens: int) -> tuple[str, str] | None:
    """(count tag, documented reason) a call runs the backend's fallback (None: its selection and kernel run):
    "short", shorter than `min_tokens`; "shape", on CUDA a head size or a batch·heads count its kernel is not built
    for."""
    from h3direct.dit import block_sparse_triton as K

    b, h, s, d = q.shape
    if s < min_tokens:
        return "short", f"{s} tokens < budget_min_tokens={min_tokens}"
    if q.is_cuda and d not in K.HEAD_DIMS:
        return "shape", f"head_dim {d} is not one of the kernel's {K.HEAD_DIMS}"
    if q.is_cuda and b * h > K.MAX_PROGRAMS:
        return "shape", f"batch x heads {b * h} > {K.MAX_PROGRAMS} (the kernel's grid)"
    return None


def kernel_reason(like: torch.Tensor | None) -> str | None:
    """Why the backend's kernel cannot run on `like`'s device and dtype (None: it can; the CPU runs the reference)."""
    if like is None or like.device.type != "cuda":
        return None
    from h3direct.dit import block_sparse_triton as K

    if K.triton is None:
        return "Triton is not importable (the CUDA kernel of budget_attn is a Triton kernel)"
    if like.dtype not in (torch.bfloat16, torch.float16):
        return f"its CUDA kernel takes bf16 or fp16, got {str(like.dtype).removeprefix('torch.')}"
    return None
