"""How local a DiT trace's attention is, and what a sparse method loses on it (CPU, no kernel needed).

    python -m parity_tests.attention_structure --trace T.safetensors [--window 1,3,3] [--sol] [--out stats.json]

For every DiT block and head of a trace recorded with `blocks.N.attn.rope_q/rope_k` (h3direct `trace`, or
`oracle record` at full detail), over the target video's query rows: the exact softmax(q·kᵀ/√D) and

- `local`: its mass on the video keys within ±w_t latent frames, ±w_h rows and ±w_w columns of the query
  (`uniform_local`: that window's share of all keys, what uniform attention would give);
- `entropy`: mean row entropy / log S (1 = uniform), `self`: mass on the query's own key, `prefix`: mass on the
  rows before the target video (text, references, audio: sol_attn's sink blocks), `max_prob`;
- with `--sol`: comfy-kitchen >= 0.2.40's eager Sol-Attn reference (bf16 q/k/v, prefix sink blocks as h3direct
  passes them) vs exact fp32 attention, rel-L2, per tau in `--taus`.

The video rows are the trace's last T·H·W rows in (t, h, w) order; the grid comes from the trace's manifest
(`layout` segments, else the inputs file it names).
Used by tests/test_attention_structure.py and the validation set (parity_tests/validation.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SOL_BLOCK = 64


def attention_stats(q, k, grid: tuple[int, int, int], window=(1, 3, 3)) -> dict:
    """q, k [S, H, D] (after norm and rope); the last T·H·W rows are the video grid `grid` = (T, H, W)."""
    import torch

    s, heads, d = q.shape
    nt, nh, nw = grid
    n_video = nt * nh * nw
    prefix = s - n_video
    idx = torch.arange(n_video)
    ti, hi, wi = idx // (nh * nw), (idx // nw) % nh, idx % nw
    local = (((ti[:, None] - ti[None]).abs() <= window[0]) & ((hi[:, None] - hi[None]).abs() <= window[1])
             & ((wi[:, None] - wi[None]).abs() <= window[2]))
    rows = []
    for h in range(heads):
        qh, kh = q[prefix:, h].float(), k[:, h].float()
        p = (qh @ kh.T / math.sqrt(d)).softmax(-1)  # [video queries, S]
        pv = p[:, prefix:]
        rows.append({
            "local": float((pv * local).sum(-1).mean()),
            "entropy": float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean() / math.log(s)),
            "self": float(torch.diagonal(pv).mean()),
            "prefix": float(p[:, :prefix].sum(-1).mean()),
            "max_prob": float(p.max()),
        })
        del p, pv
    out = {key: sum(r[key] for r in rows) / heads for key in rows[0] if key != "max_prob"}
    out["max_prob"] = max(r["max_prob"] for r in rows)
    out["uniform_local"] = float(local.sum(-1).float().mean() / s)
    out["per_head"] = rows
    return out


def sol_reference_error(q, k, v, prefix_rows: int, taus=(1.3,)) -> dict[float, float]:
    """rel-L2 of comfy-kitchen's eager Sol-Attn (bf16 inputs, prefix sinks) vs exact fp32 attention; q/k/v [S, H, D]."""
    import importlib

    import torch

    from h3direct.traces.metrics import rel_l2

    sol = importlib.import_module("comfy_kitchen.backends.eager.sol_attn").sol_attn
    q, k, v = (t.float()[None] for t in (q, k, v))
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    sinks = [0, math.ceil(prefix_rows / SOL_BLOCK)] if prefix_rows else None
    out = {}
    for tau in taus:
        kw = {"tau": tau} if sinks is None else {"tau": tau, "sink_blocks": sinks}
        approx = sol(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw).float()
        out[tau] = rel_l2(approx, exact)
    return out


def video_grid(trace, trace_path) -> tuple[int, int, int]:
    """(T, H, W) token grid of the target video of a DiT trace (patch 1×2×2), from the inputs file its manifest
    names (as given, or beside the trace: ComfyUI's manifests name it relative to the trace's folder)."""
    from h3direct.traces.inputs import load_inputs

    name = trace.manifest.get("inputs") or ""
    path = next((p for p in (Path(name), Path(trace_path).parent / Path(name).name) if name and p.is_file()), None)
    if path is None:
        raise SystemExit(f"attention_structure: the trace's inputs file {name!r} is not here (its grid is needed)")
    lat = load_inputs(path)["video_latent"]
    return lat.shape[2], (lat.shape[3] + 1) // 2, (lat.shape[4] + 1) // 2


def trace_stats(path, window=(1, 3, 3), sol=False, taus=(1.3,)) -> list[dict]:
    from h3direct.traces.format import load_trace

    trace = load_trace(path)
    grid = video_grid(trace, path)
    rows = []
    blk = 0
    while f"blocks.{blk}.attn.rope_q" in trace.tensors:
        q, k = trace.get(f"blocks.{blk}.attn.rope_q"), trace.get(f"blocks.{blk}.attn.rope_k")
        row = {"block": blk, "seq_len": q.shape[0], "grid": list(grid), "window": list(window),
               **attention_stats(q, k, grid, window)}
        if sol:
            s, heads, d = q.shape
            v = trace.get(f"blocks.{blk}.attn.qkv_proj.out")[:, 2 * heads * d:].reshape(s, heads, d)
            row["sol_rel_l2"] = sol_reference_error(q, k, v, s - math.prod(grid), taus)
        rows.append(row)
        blk += 1
    if not rows:
        raise SystemExit(f"attention_structure: {path} has no blocks.N.attn.rope_q (record at full detail)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--window", default="1,3,3", help="±frames,±rows,±columns of the local window (default 1,3,3)")
    ap.add_argument("--sol", action="store_true", help="also comfy-kitchen's eager Sol-Attn reference error")
    ap.add_argument("--taus", default="1.0,1.3,2.0")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        window = tuple(int(x) for x in args.window.split(","))
        taus = tuple(float(x) for x in args.taus.split(",") if x)
    except ValueError:
        print("attention_structure: --window takes 3 integers, --taus numbers", file=sys.stderr)
        return 2
    if len(window) != 3 or not Path(args.trace).is_file():
        print(f"attention_structure: need --window t,h,w and an existing --trace ({args.trace})", file=sys.stderr)
        return 2
    rows = trace_stats(args.trace, window, args.sol, taus)
    for r in rows:
        sol = " ".join(f"sol(tau {t}) {e:.3e}" for t, e in r.get("sol_rel_l2", {}).items())
        print(f"block {r['block']} S={r['seq_len']} local {r['local']:.3f} (uniform {r['uniform_local']:.3f}) "
              f"entropy/logS {r['entropy']:.3f} self {r['self']:.3f} prefix {r['prefix']:.3f} "
              f"max p {r['max_prob']:.3f} {sol}")
    if args.out:
        Path(args.out).write_text(json.dumps({"trace": str(args.trace), "rows": rows}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
