"""Attention backends at the benchmark shape: time per call, error vs fp32, the kernels that ran.

    python3 benchmarks/attention_kernels.py --device cuda --out attn.json            # S = 20,050, 56 heads x 128
    python3 benchmarks/attention_kernels.py --device cpu --seq 256 --heads 2         # smoke (sdpa only runs)

Two input sets, both [1, H, S, 128] bf16:
- `random`: i.i.d. normal q, k, v (no locality: pessimistic for quantized and meaningless for sparse methods);
- `structured`: what a video DiT's attention looks like: per-head shared directions plus a smooth random field over
  the packed sequence's real (t, h, w) positions (the workload's layout: text, reference image, audio, video), then
  per-head RMSNorm and H3's 3-axis rope (96 of 128 dims), so scores fall off with distance in time and space.
Error: rel-L2 vs fp32 SDPA on the same inputs. Kernel names: the CUDA kernels one call launched (torch profiler).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKENDS = ("sdpa", "cudnn_sdpa", "fa3", "fa3_fp8", "ck_int8", "sage2", "sol_attn", "kj_head_sliced")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the 960x544x124 Ref2VA layout)")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sol-taus", default="1.0,1.3,2.0", help="extra sol_attn runs at these H3_SOL_TAU values")
    ap.add_argument("--out", default=None, help="write the JSON here")
    return ap.parse_args(argv)


def positions(seq: int | None):
    """([S, 3] float64 positions, prefix rows before the target video) of the benchmark layout (or a cut of it)."""
    from benchmarks._common import workload
    from h3direct.dit.sequence import build_layout

    wl = workload(960, 544, 124, 256)
    _, _, t, h, w = wl["video_latent"]
    ref = {"kind": "image", "latent_t": 1, "latent_h": h + h % 2, "latent_w": w + w % 2}
    lay = build_layout(wl["text_len"], t, h + h % 2, w + w % 2, wl["audio_latent"][-1], refs=[ref])
    pos = lay.position_ids
    prefix = lay.segment("video").start
    if seq is not None and seq < pos.shape[0]:
        pos = pos[:seq]
        prefix = min(prefix, seq)
    return pos, prefix


def structured_qkv(pos, heads: int, dim: int, device, seed: int = 0):
    import torch

    from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table

    g = torch.Generator(device="cpu").manual_seed(seed)
    s = pos.shape[0]
    p = pos.to(torch.float32)

    def field(scale):  # smooth random field over positions: 16 random plane waves per (head, channel group)
        freqs = torch.randn(16, 3, generator=g) * torch.tensor([0.15, 0.3, 0.3])
        phase = torch.rand(16, generator=g) * 2 * math.pi
        waves = torch.cos(p @ freqs.T + phase)  # [S, 16]
        mix = torch.randn(16, heads * dim, generator=g) / 4.0
        return (waves @ mix).reshape(s, heads, dim) * scale

    def one(shared_scale, field_scale, noise_scale):
        base = torch.randn(1, heads, dim, generator=g) * shared_scale
        return base + field(field_scale) + torch.randn(s, heads, dim, generator=g) * noise_scale

    q, k, v = one(1.0, 1.0, 0.3), one(1.0, 1.0, 0.3), one(0.5, 1.0, 0.5)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(16, dtype=torch.float32) / 16))
    table = rotation_table(rope_angles(pos, inv_freq), torch.float32)
    ones = torch.ones(dim)
    q = rms_norm_rope(q[None], ones, table, 1e-6)[0]
    k = rms_norm_rope(k[None], ones, table, 1e-6)[0]
    return [x.transpose(0, 1)[None].to(device=device, dtype=torch.bfloat16) for x in (q, k, v)]


def random_qkv(seq: int, heads: int, dim: int, device, seed: int = 1):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(1, heads, seq, dim, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(3)]


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

    from benchmarks._common import env_options
    from h3direct.dit.attention import (
        _PREFIX_ROWS,
        _REGISTRY,
        attention_stats,
        reset_attention_stats,
        unavailable_reason,
    )

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
        runs += [("sol_attn", {"H3_SOL_TAU": t}) for t in args.sol_taus.split(",") if t and t != "1.3"]
    if any(b == "fa3_fp8" for b, _ in runs):  # and without V smoothing
        runs.append(("fa3_fp8", {"H3_FP8_ATTN_SMOOTH_V": "0"}))
    rows = []
    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    for backend, env in runs:
        row = {"backend": backend, "env": env, "seq": seq, "heads": args.heads, "prefix_rows": prefix}
        reason = unavailable_reason(backend, like)
        if reason is not None:
            row["status"] = f"unavailable: {reason}"
            rows.append(row)
            print(f"{backend:15s} {env} unavailable: {reason}", flush=True)
            continue
        token = _PREFIX_ROWS.set(prefix)
        try:
            with env_options(env):
                reset_attention_stats()
                fn = _REGISTRY[backend].fn
                for name, (q, k, v) in sets.items():
                    out = fn(q, k, v)
                    row[f"rel_l2_{name}"] = rel_l2(out, refs[name])
                    row[f"finite_{name}"] = bool(torch.isfinite(out).all())
                q, k, v = sets["structured"]
                call = lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)  # noqa: E731
                ms = time_ms(call, args.iters, device)
                row.update(ms=ms, tflops=flop / ms / 1e9, kernels=kernel_names(call, device),
                           calls=attention_stats().get(backend), status="ok")
        except Exception as exc:  # noqa: BLE001 - a broken backend is a row, not the end of the run
            row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            _PREFIX_ROWS.reset(token)
        rows.append(row)
        print(f"{backend:15s} {env} " + (f"{row['ms']:.2f} ms  {row['tflops']:.0f} TFLOP/s  rel-L2 structured "
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
