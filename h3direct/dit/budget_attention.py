"""`budget_attn`: block-sparse attention whose every call leaves at most a budgeted share of each query block's
attention mass to the key blocks it drops (options: `budget_options.py`).

Per head and 64-row query block (`select`):

1. estimate: `samples` query rows spread over the block attend every key through the mean keys of 16-token key
   sub-blocks (the softmax over S/16 pooled logits, each weighed by its length): each sampled row's mass on every
   64-token key block, for samples/1024 of the dense scores' arithmetic (exact where a sub-block's keys are equal);
2. choose: the key blocks in descending estimated mass (the forced ones first: the diagonal and its neighbours, the
   sink blocks of the rows before the target video), as few as make every sampled row's kept mass at least
   1 − `mass`: a top-p per query block, the budget held for the worst sampled row, whatever the input (a wide
   window keeps more blocks, a sharp one fewer);
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


def block_masses(q: torch.Tensor, k: torch.Tensor, samples: int) -> torch.Tensor:
    """q, k [H, S, D] -> fp32 [H, NQ, samples, NK]: each sampled row's estimated mass on every 64-token key block
    (its softmax over the length-weighted mean keys of 16-token sub-blocks)."""
    h, s, d = k.shape
    n = -(-s // BUDGET_BLOCK)
    sub = BUDGET_BLOCK // BUDGET_SUB
    pad = n * BUDGET_BLOCK - s
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(h, n * sub, BUDGET_SUB, d).sum(2)
    lengths = torch.nn.functional.pad(torch.ones(s, device=k.device), (0, pad)).view(n * sub, BUDGET_SUB).sum(1)
    kf = kf / lengths.clamp_min(1.0).view(1, -1, 1)
    qs = q[:, sample_rows(s, samples, q.device).reshape(-1)].float()  # [H, NQ·samples, D]
    logits = (qs @ kf.transpose(1, 2)) * d ** -0.5 + lengths.log().view(1, 1, -1)  # empty sub-blocks: -inf
    # a block's mass is the softmax over blocks of its sub-blocks' log-sum-exp (one pass less than a softmax over
    # the sub-blocks summed per block)
    per_block = torch.logsumexp(logits.view(h, n * samples, n, sub), dim=-1)  # [H, NQ·samples, NK]
    return torch.softmax(per_block, dim=-1).view(h, n, samples, n)


def select(q: torch.Tensor, k: torch.Tensor, prefix_rows: int | None, opts: BudgetOptions) -> Selection:
    """q, k [B, H, S, D] -> the key blocks each query block keeps under the budget (module docstring)."""
    b, h, s, d = q.shape
    n = -(-s // BUDGET_BLOCK)
    dev = q.device
    idx = torch.arange(n, device=dev)
    forced = (idx.view(-1, 1) - idx.view(1, -1)).abs() <= 1  # [NQ, NK] the diagonal and its neighbours
    pb = min(opts.prefix_blocks(prefix_rows), n)
    if opts.sinks == "prefix":
        forced[:, :pb] = True
    keep = torch.zeros(b, h, n, n, dtype=torch.bool, device=dev)
    dropped = torch.zeros(b, h, n, device=dev)
    chunk = max(1, MAX_LOGITS // max(1, n * opts.samples * n * (BUDGET_BLOCK // BUDGET_SUB)))
    ranks = torch.arange(n, device=dev).view(1, 1, n)
    for bi in range(b):
        for h0 in range(0, h, chunk):
            m = block_masses(q[bi, h0:h0 + chunk], k[bi, h0:h0 + chunk], opts.samples)  # [hc, NQ, R, NK]
            hc = m.shape[0]
            order = (m.mean(2) + 2.0 * forced).argsort(dim=-1, descending=True)  # forced first, then by mass
            cum = m.gather(3, order.unsqueeze(2).expand(-1, -1, opts.samples, -1)).cumsum(-1)
            enough = cum >= 1.0 - opts.mass
            first = torch.where(enough.any(-1), enough.to(torch.int64).argmax(-1), n - 1)  # [hc, NQ, R]
            need = torch.maximum(first.amax(-1) + 1, forced.sum(-1).view(1, n))  # [hc, NQ]
            kept = torch.zeros(hc, n, n, dtype=torch.bool, device=dev)
            kept.scatter_(2, order, ranks < need.unsqueeze(-1))
            keep[bi, h0:h0 + hc] = kept
            held = cum.gather(3, (need - 1).view(hc, n, 1, 1).expand(-1, -1, opts.samples, 1)).squeeze(-1)
            dropped[bi, h0:h0 + hc] = (1.0 - held).clamp_min(0.0).amax(-1)
    if opts.exact_rows and pb:
        keep[:, :, :pb] = True
        dropped[:, :, :pb] = 0.0
    return Selection(keep, dropped)


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
