"""Are the block GEMMs and FA3 slower in the model than alone because the GPU is power/clock bound?

    python3 benchmarks/diag_sustained.py [--seconds 20]

For the four block GEMM shapes (bf16, M = S) and one FA3 call at the contract's shape: the time of one call on a
GPU that idled for 2 s ("cool"), and the mean over a sustained loop that cycles GEMMs and attention the way a DiT
block does ("hot"), with nvidia-smi's SM clock, power and throttle reasons sampled while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def smi(fields: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.strip()
    return [v.strip() for v in out.split(",")]


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    from h3direct.config import H3Config
    from h3direct.dit.attention import attention

    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--attention", default="fa3")
    p.add_argument("--weights", default="nvfp4", choices=("nvfp4", "random"),
                   help="nvfp4: the GEMM weights are NVFP4-rounded (what W4A16 multiplies by); random: plain bf16")
    args = p.parse_args(argv)
    cfg = H3Config.from_name("full-curve")
    S = 20050
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = C.block_gemm_shapes(cfg, S)
    xs = {n: torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g) for n, m, _, k in shapes}
    ws = {n: (0.02 * torch.randn(nn, k, device=dev, generator=g)).bfloat16() for n, _, nn, k in shapes}
    if args.weights == "nvfp4":  # the values W4A16 multiplies by: few mantissa bits set (tensor-core power may differ)
        from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
        for n, w in ws.items():
            q_ = quantize_nvfp4(w)
            ws[n] = dequantize_nvfp4(q_.packed, q_.block_scale, q_.global_scale, torch.bfloat16, tuple(w.shape))
    h, d = cfg.num_attention_heads, cfg.attention_head_dim
    q, k, v = (torch.randn(1, h, S, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))

    def call(name):
        if name == "attention":
            return attention(q, k, v, args.attention)
        return F.linear(xs[name], ws[name])

    names = [n for n, *_ in shapes] + ["attention"]
    flops = {n: 2.0 * m * nn * kk for n, m, nn, kk in shapes}
    flops["attention"] = 4.0 * S * S * h * d

    def timed(name, reps=1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            call(name)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps

    for n in names:  # warm-up: compile / heuristics
        timed(n, 2)
    res = {"cool_ms": {}, "hot_ms": {}}
    for n in names:
        time.sleep(2.0)
        res["cool_ms"][n] = timed(n, 1)
        res.setdefault("cool_smi", {})[n] = smi("clocks.sm,power.draw,temperature.gpu")
    # sustained: the block's order (qkv, attention, out, fc1, fc2), events per call
    order = ["qkv_proj", "attention", "out_proj", "fc1", "fc2"]
    ev = {n: [] for n in order}
    t_end = time.time() + args.seconds
    with C.GpuSampler(dev, period_ms=500) as gpu:  # clocks, power, throttle reasons, off the timed loop
        while time.time() < t_end:
            for n in order:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call(n)
                b.record()
                ev[n].append((a, b))
            torch.cuda.synchronize()
    res["hot_gpu"] = gpu.summary
    for n in order:
        times = [a.elapsed_time(b) for a, b in ev[n]]
        half = times[len(times) // 2:]  # the second half: steady state
        res["hot_ms"][n] = sum(half) / len(half)
    print(f"attention {args.attention}, weights {args.weights}")
    print(f"{'call':10s} {'cool ms':>9s} {'TFLOP/s':>8s} {'hot ms':>9s} {'TFLOP/s':>8s} {'hot/cool':>8s}")
    for n in names:
        c_, h_ = res["cool_ms"][n], res["hot_ms"][n]
        print(f"{n:10s} {c_:9.3f} {flops[n] / c_ / 1e9:8.0f} {h_:9.3f} {flops[n] / h_ / 1e9:8.0f} {h_ / c_:8.3f}")
    blk_cool = sum(res["cool_ms"].values())
    blk_hot = sum(res["hot_ms"].values())
    print(f"block (4 GEMMs + attention): cool {blk_cool:.2f} ms, hot {blk_hot:.2f} ms -> x50 {blk_cool * 50:.0f} / "
          f"{blk_hot * 50:.0f} ms per step")
    print("cool smi (clock MHz, W, C):", res["cool_smi"])
    print("hot (medians of the loaded nvidia-smi samples):", res["hot_gpu"])
    out = os.environ.get("OUT")
    if out:
        Path(out, f"diag_sustained_{args.attention}_{args.weights}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
