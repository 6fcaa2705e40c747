"""Sol-Attn's own approximation error on a trace's recorded attention inputs (CPU, no kernel needed).

    python benchmarks/sol_reference_error.py --trace fixtures/gpu/trace_gpu_small_bf16_ref2va_bf16.safetensors
    python benchmarks/sol_reference_error.py --trace T.safetensors --taus 1.0,1.3,2.0 --out sol_ref.json

For every DiT block of the trace: q and k after rope (`blocks.N.attn.rope_q/k`), v from the recorded qkv projection,
then comfy-kitchen's eager Sol-Attn reference (exact arithmetic over the kernel's block routing, bf16 inputs) against
exact fp32 attention on the same q, k, v, with the sink blocks h3direct passes (the rows before the target video)
and without them. This separates the method's error on these inputs from an integration error: when the reference
already misses by X, the compiled kernel cannot do better, and a gate budget for sol_attn tighter than X fails on
such inputs. A sanity row checks that exact attention reproduces ComfyUI's recorded attention output (it must,
to bf16 rounding, or the q/k/v extraction is wrong and the run stops). Needs comfy-kitchen >= 0.2.40.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SANITY = 1e-2  # exact fp32 attention vs ComfyUI's recorded output: bf16 rounding is ~2e-3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="a DiT trace recorded with --detail full")
    ap.add_argument("--taus", default="1.0,1.3,2.0", help="tau values of the threshold routing (default 1.0,1.3,2.0)")
    ap.add_argument("--topk", default="0.1", help="topk_ratio values to try as well ('' for none)")
    ap.add_argument("--out", help="write the rows as JSON")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import torch

    from h3direct.traces.format import load_trace
    from h3direct.traces.metrics import rel_l2

    args = parse_args(argv)
    try:
        ref_impl = importlib.import_module("comfy_kitchen.backends.eager.sol_attn").sol_attn
    except ImportError as exc:
        print(f"sol_reference_error: comfy-kitchen >= 0.2.40 with its eager sol_attn is needed ({exc})",
              file=sys.stderr)
        return 2
    try:
        taus = [float(t) for t in args.taus.split(",") if t]
        topks = [float(t) for t in args.topk.split(",") if t]
    except ValueError:
        print("sol_reference_error: --taus / --topk take comma-separated numbers", file=sys.stderr)
        return 2
    if not Path(args.trace).is_file():
        print(f"sol_reference_error: {args.trace}: no such trace", file=sys.stderr)
        return 2
    trace = load_trace(args.trace)
    m = trace.manifest
    cfg = m.get("unet_config_detected", {})
    heads, head_dim = int(cfg.get("num_attention_heads", 0)), int(cfg.get("attention_head_dim", 0))
    if head_dim != 128 or "blocks.0.attn.rope_q" not in trace.tensors:
        print(f"sol_reference_error: {args.trace}: needs a full-detail trace of a head_dim-128 DiT "
              f"(got head_dim {head_dim})", file=sys.stderr)
        return 2
    segments = m.get("layout", {}).get("segments", [])
    prefix = next((a for a, _, kind in segments if kind == "video"), 0)
    sinks = [0, math.ceil(prefix / 64)] if prefix else None
    hidden = heads * head_dim
    rows = []
    for blk in range(int(cfg.get("num_layers", 0))):
        name = f"blocks.{blk}.attn"
        q = trace.get(f"{name}.rope_q").float()[None]
        k = trace.get(f"{name}.rope_k").float()[None]
        s = q.shape[1]
        v = trace.get(f"{name}.qkv_proj.out").float()[:, 2 * hidden:3 * hidden].reshape(1, s, heads, head_dim)
        recorded = trace.get(f"{name}.out_proj.in.0").float().reshape(1, s, heads, head_dim)
        exact = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        sanity = rel_l2(exact, recorded)
        if not sanity <= SANITY:
            print(f"sol_reference_error: block {blk}: exact attention is {sanity:.2e} from ComfyUI's recorded output "
                  f"(> {SANITY:g}): q/k/v extraction does not match this trace", file=sys.stderr)
            return 1
        probs = (q[0].transpose(0, 1) @ k[0].permute(1, 2, 0) / math.sqrt(head_dim)).softmax(-1)
        entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean() / math.log(s))
        options = [{"tau": t, "sink_blocks": sinks} for t in taus] + [{"tau": taus[0] if taus else 1.3}]
        options += [{"topk_ratio": r, "sink_blocks": sinks} for r in topks]
        for kw in options:
            kw = {a: b for a, b in kw.items() if b is not None}
            out = ref_impl(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw).float()
            row = {"block": blk, "seq_len": s, "options": kw, "rel_l2_vs_exact": rel_l2(out, exact),
                   "exact_vs_comfy": sanity, "attention_entropy": entropy, "max_prob": float(probs.max())}
            rows.append(row)
            print(f"block {blk} S={s} entropy/log(S) {entropy:.3f} max p {row['max_prob']:.4f} | {kw}: "
                  f"rel-L2 vs exact {row['rel_l2_vs_exact']:.3e} (exact vs ComfyUI {sanity:.1e})")
    if args.out:
        Path(args.out).write_text(json.dumps({"trace": str(args.trace), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
