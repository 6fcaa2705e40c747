"""Attention backends at the benchmark shape: time per call, error vs fp32, the kernels that ran.

    python -m benchmarks.attention_kernels --device cuda --out attn.json            # S = 20,050, 56 heads x 128
    python -m benchmarks.attention_kernels --device cpu --seq 256 --heads 2         # smoke (sdpa only runs)

Two input sets, both [1, H, S, 128] bf16 (`h3direct.dit.attention_inputs`): `structured` (attention local in time
and space, at the workload's real (t, h, w) positions) and `random` (i.i.d.: no locality, pessimistic for quantized
and meaningless for sparse methods).
Error: rel-L2 vs fp32 SDPA on the same inputs. Kernel names: the CUDA kernels one call launched (torch profiler).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BACKENDS = ("sdpa", "cudnn_sdpa", "fa3", "fa3_fp8", "ck_int8", "sage2", "sol_attn", "kj_head_sliced", "budget_attn")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the 960x544x124 Ref2VA layout)")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sol-taus", default="1.0,1.3,2.0", help="extra sol_attn runs at these sol_tau values")
    ap.add_argument("--budget-masses", default="0.03,0.1", help="extra budget_attn runs at these budget_mass values")
    ap.add_argument("--budget-samples", default="8,64", help="each budget_attn run at these budget_samples values (64: "
                    "every row, the fused selection kernel on CUDA)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    return ap.parse_args(argv)


def reference(q, k, v):
    import torch
    import torch.nn.functional as F

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):  # fp32, one head at a time (memory)
        out[:, h:h + 1] = F.scaled_dot_product_attention(q[:, h:h + 1].float(), k[:, h:h + 1].float(),
                                                         v[:, h:h + 1].float())
    return out


def rel_l2(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def time_ms(fn, iters: int, device) -> float:
    """Median ms per call after two warm-up calls (benchmarks._common.time_calls: CUDA events on the GPU)."""
    from benchmarks._common import time_calls

    return time_calls(fn, device, warmup=2, iters=iters)["median_s"] * 1e3


def kernel_names(fn, device) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
    return [f"{e.key[:110]} ({getattr(e, 'device_time_total', 0) / 1e3:.2f} ms)" for e in rows[:4]
            if getattr(e, "device_time_total", 0) > 0]


def main(argv=None) -> int:
    import torch

    from h3direct.counts import counting
    from h3direct.dit.attention import _PREFIX_ROWS, _REGISTRY, unavailable_reason
    from h3direct.dit.attention_inputs import positions, random_qkv, structured_qkv
    from h3direct.dit.options import Options

    args = parse_args(argv)
    device = torch.device(args.device)
    pos, prefix = positions(args.seq)
    seq, dim = pos.shape[0], 128
    flop = 4.0 * seq * seq * dim * args.heads
    sets = {"structured": structured_qkv(pos, args.heads, dim, device), "random": random_qkv(seq, args.heads, dim,
                                                                                           device)}
    refs = {name: reference(*qkv) for name, qkv in sets.items()}
    runs = [(b, {}) for b in args.backends.split(",") if b]
    if "sol_attn" in args.backends:
        runs += [("sol_attn", {"sol_tau": float(t)}) for t in args.sol_taus.split(",") if t and t != "1.3"]
    if "budget_attn" in args.backends:
        runs += [("budget_attn", {"budget_mass": float(m), "budget_samples": int(r)})
                 for m in args.budget_masses.split(",") if m for r in args.budget_samples.split(",") if r]
    if any(b == "fa3_fp8" for b, _ in runs):  # and without V smoothing, and without the rotation of q and k
        runs += [("fa3_fp8", {"fp8_attn_smooth_v": False}), ("fa3_fp8", {"fp8_attn_rotate": False})]
    rows = []
    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    for backend, changed in runs:
        opts = Options.from_flat({"attention": backend, **changed}).attention
        row = {"backend": backend, "options": changed, "seq": seq, "heads": args.heads, "prefix_rows": prefix}
        reason = unavailable_reason(opts, like)
        if reason is not None:
            row["status"] = f"unavailable: {reason}"
            rows.append(row)
            print(f"{backend:15s} {changed} unavailable: {reason}", flush=True)
            continue
        token = _PREFIX_ROWS.set(prefix)
        try:
            with counting() as calls:
                b = _REGISTRY[backend]
                for name, (q, k, v) in sets.items():
                    out = b.run(q, k, v, opts)
                    row[f"rel_l2_{name}"] = rel_l2(out, refs[name])
                    row[f"finite_{name}"] = bool(torch.isfinite(out).all())
                q, k, v = sets["structured"]
                call = lambda b=b, q=q, k=k, v=v, o=opts: b.run(q, k, v, o)  # noqa: E731
                ms = time_ms(call, args.iters, device)
                row.update(ms=ms, tflops=flop / ms / 1e9, kernels=kernel_names(call, device),
                           calls=calls.as_dict().get("attention", {}).get(backend), status="ok")
                if backend == "budget_attn":  # its two costs apart: choosing the blocks, attending them
                    from h3direct.dit import budget_attention as BA

                    budget = opts.budget_attn
                    keep = BA.select(q, k, prefix, budget).keep
                    choose = lambda q=q, k=k, o=budget: BA.select(q, k, prefix, o)  # noqa: E731
                    attend = lambda q=q, k=k, v=v, m=keep, o=budget: BA.attend(q, k, v, m, o.tail)  # noqa: E731
                    row.update(density=float(keep.float().mean()), select_ms=time_ms(choose, args.iters, device),
                               attend_ms=time_ms(attend, args.iters, device))
        except Exception as exc:  # noqa: BLE001 - a broken backend is a row, not the end of the run
            row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            _PREFIX_ROWS.reset(token)
        rows.append(row)
        print(f"{backend:15s} {changed} " + (f"{row['ms']:.2f} ms  {row['tflops']:.0f} TFLOP/s  rel-L2 structured "
              f"{row['rel_l2_structured']:.2e} random {row['rel_l2_random']:.2e}  {row['kernels'][:2]}"
              if row["status"] == "ok" else row["status"]), flush=True)
    result = {"shape": [1, args.heads, seq, dim], "prefix_rows": prefix, "flop_per_call": flop,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
