"""Sweep the launch configs of h3direct's Triton kernels on this GPU and print the fastest per kernel.

    python tools/tune_kernels.py [--iters 30] [--out tune.json]          # the DiT's full shape (S = 20,050)
    TRITON_INTERPRET=1 python tools/tune_kernels.py --device cpu --small  # a smoke run in Triton's interpreter

Kernels: the fused elementwise kernels of `h3direct/dit/fused.py` (every candidate of its sweep list, the variants
writing e4m3 rows for the FP8 linears included) and the two uses of the NVFP4 kernel of
`h3direct/checkpoint/quant/nvfp4_triton.py`: dequantization to bf16 (`nvfp4_dequant`) and conversion to e4m3 under
per-row scales (`nvfp4_e4m3`, the FP8 linears' stream mode), every config, at the four block-linear weight shapes.
Each candidate runs on the same inputs; CUDA-event median ms, GB/s (bytes moved / time), and whether its output has
the same bits as the current config's (every config must: exit 1 otherwise). The result is printed as the
entries to put in the runtime's tables for this GPU's compute capability.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import time_calls  # noqa: E402
from h3direct.checkpoint.quant import nvfp4, nvfp4_triton, w8a8  # noqa: E402
from h3direct.dit import fused  # noqa: E402
from h3direct.dit.rope import rope_angles, rotation_table  # noqa: E402
from h3direct.dit.timesteps import ModRun  # noqa: E402
from h3direct.traces.metrics import bit_mismatch  # noqa: E402

# ---- what this tool reads from the runtime's launch tables (its only coupling to them) ------------------------


def fused_kernels() -> list[str]:
    return list(fused.SWEEP)


def fused_candidates(kernel: str, device) -> list[dict]:
    """The kernel's current launch config on this GPU first, then its sweep list (each filled in by the table)."""
    out = []
    for cfg in [None, *fused.SWEEP[kernel]]:
        full = fused.launch_config(kernel, cfg, device=device)
        if full not in out:
            out.append(full)
    return out


NVFP4_KERNELS = ("nvfp4_dequant", "nvfp4_e4m3")


def nvfp4_candidates(kernel: str, device) -> list[tuple[int, int]]:
    """This GPU's current (blocks per program, warps) of `kernel` first, then the other configs."""
    current = nvfp4_triton.launch_config(kernel, device)
    return [current, *(c for c in nvfp4_triton.CONFIGS if c != current)]


# ---- inputs ---------------------------------------------------------------------------------------------------

FULL = {"rows": 20050, "hidden": 5376, "ffn": 14336, "heads": 56, "head_dim": 128,
        "weights": [("qkv", 21504, 5376), ("out", 5376, 7168), ("fc1", 28672, 5376), ("fc2", 5376, 14336)]}
SMALL = {"rows": 9, "hidden": 64, "ffn": 64, "heads": 2, "head_dim": 32,
         "weights": [("qkv", 300, 160), ("out", 130, 270)]}


def fused_cases(shape: dict, dev) -> dict:
    """kernel -> (make fresh inputs, run(inputs, config) -> outputs, bytes moved per call)."""
    s, d, f, heads, hd = shape["rows"], shape["hidden"], shape["ffn"], shape["heads"], shape["head_dim"]
    g = torch.Generator(device="cpu").manual_seed(0)
    gd = torch.Generator(device=dev).manual_seed(1)
    bf = torch.bfloat16

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=gd, device=dev) * scale).to(bf)

    c1, c2 = min(256, s // 4), min(1180, s // 2)  # the workload's adaLN runs: text, conditioning, target video
    runs = [ModRun(0, c1, 0), ModRun(c1, c2, 1), ModRun(c2, s, 2)]
    table = torch.randn(3, 6, d, generator=g).to(dev)
    shift, scale, gate = table[:, 0], 0.2 * table[:, 1], table[:, 2]
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, bf)
    x0, upd, a0, qkv0 = rnd(s, d, scale=3), rnd(s, d, scale=2), rnd(s, 2 * f, scale=4), rnd(s, 3 * heads * hd)
    pos = torch.stack([torch.arange(s) // 600, torch.arange(s) // 30 % 20, torch.arange(s) % 30], -1).double()
    n_freq = hd // 8  # 3 axes x n_freq pairs: 96 of 128 dims rotate, as in H3
    rope = rotation_table(rope_angles(pos, 1.0 / 10000 ** (torch.arange(n_freq) / n_freq)).to(dev), bf)
    wq, wk = ((1 + 0.3 * torch.randn(hd, generator=g)).to(dev, bf) for _ in range(2))

    def qk(t, cfg):
        q, k, _ = (part.view(1, s, heads, hd) for part in t.chunk(3, dim=-1))
        fused.qk_norm_rope_(q, k, wq, wk, rope, 1e-6, config=cfg)
        return (t,)

    def residual_norm(t, cfg):
        return t, fused.residual_norm_modulate_(t, gate, upd, w, 1e-6, shift, scale, runs, config=cfg)

    def norm_e4m3(t, cfg):
        q = fused.norm_modulate(t, w, 1e-6, shift, scale, runs, e4m3=True, config=cfg)
        return q.data.view(torch.uint8), q.scale

    def residual_norm_e4m3(t, cfg):
        q = fused.residual_norm_modulate_(t, gate, upd, w, 1e-6, shift, scale, runs, e4m3=True, config=cfg)
        return t, q.data.view(torch.uint8), q.scale

    def swiglu_e4m3(t, cfg):
        q = fused.swiglu_e4m3(t, config=cfg)
        return q.data.view(torch.uint8), q.scale

    # bytes: bf16 reads and writes, e4m3 codes (1 byte) and fp32 row scales (4 bytes a row)
    return {
        "norm_modulate": (lambda: x0, lambda t, cfg: (fused.norm_modulate(t, w, 1e-6, shift, scale, runs,
                                                                         config=cfg),), 4 * s * d),
        "residual_norm_modulate": (x0.clone, residual_norm, 8 * s * d),
        "gated_residual": (x0.clone, lambda t, cfg: (fused.gated_residual_(t, gate, upd, runs, config=cfg),),
                           6 * s * d),
        "swiglu": (a0.clone, lambda t, cfg: (fused.swiglu_(t, config=cfg),), 6 * s * f),
        "qk_norm_rope": (qkv0.clone, qk, 8 * s * heads * hd),
        "norm_modulate_e4m3": (lambda: x0, norm_e4m3, 3 * s * d + 4 * s),
        "residual_norm_modulate_e4m3": (x0.clone, residual_norm_e4m3, 7 * s * d + 4 * s),
        "swiglu_e4m3": (lambda: a0, swiglu_e4m3, 5 * s * f + 4 * s),
    }


# ---- timing and the sweep ---------------------------------------------------------------------------------------

def median_ms(fn, dev, iters: int) -> float:
    """Median ms of `iters` calls after one warm-up (CUDA events on the GPU; one interpreted call on the CPU)."""
    return 1e3 * time_calls(fn, dev, warmup=1, iters=iters if dev.type == "cuda" else 1)["median_s"]


def sweep(name: str, candidates: list, run, make, nbytes: int, dev, iters: int) -> dict:
    """Every candidate on fresh inputs: bits against the first (the current config), then its time."""
    rows, ref = [], None
    for cfg in candidates:
        try:
            outs = [o.clone() for o in run(make(), cfg)]
            diff = None if ref is None else next((m for m in map(bit_mismatch, outs, ref) if m), None)
            ref = ref if ref is not None else outs
            t = make()
            ms = median_ms(lambda t=t, cfg=cfg: run(t, cfg), dev, iters)
            rows.append({"config": cfg, "ms": ms, "gbps": nbytes / ms / 1e6, "bits": diff or "same"})
        except Exception as exc:  # a config that does not compile or launch is a row, not the end of the sweep
            rows.append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else rows[0]
    print(f"\n== {name}: {len(rows)} configs, {nbytes / 1e9:.3f} GB per call")
    for r in rows:
        mark = " <- best" if r is best else (" <- current" if r is rows[0] else "")
        what = r.get("error") or f"{r['ms']:8.4f} ms {r['gbps']:7.0f} GB/s  bits {r['bits']}"
        print(f"  {json.dumps(r['config']):60s} {what}{mark}")
    ok = all("error" not in r and r["bits"] == "same" for r in rows)
    return {"configs": rows, "best": best["config"], "ok": ok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run under TRITON_INTERPRET=1)")
    ap.add_argument("--kernels", default=None, help="comma list (default: every fused kernel and nvfp4_dequant)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the sweep as JSON here")
    args = ap.parse_args(argv)
    known = [*fused_kernels(), *NVFP4_KERNELS]
    kernels = args.kernels.split(",") if args.kernels else known
    bad = [k for k in kernels if k not in known]
    if bad:
        print(f"tune_kernels: error: --kernels: unknown {bad} (known: {','.join(known)})", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if fused.triton is None:
        print("tune_kernels: error: Triton is not importable here", file=sys.stderr)
        return 2
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("tune_kernels: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("tune_kernels: error: --device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    shape = SMALL if args.small else FULL
    gpu = (f"{torch.cuda.get_device_name(dev)} (compute capability "
           f"{'.'.join(map(str, torch.cuda.get_device_capability(dev)))})" if dev.type == "cuda" else "cpu")
    res = {"device": gpu, "shape": shape, "kernels": {}}
    cases = fused_cases(shape, dev) if set(kernels) & set(fused_kernels()) else {}
    for name in kernels:
        if name in cases:
            make, run, nbytes = cases[name]
            res["kernels"][name] = sweep(name, fused_candidates(name, dev), run, make, nbytes, dev, args.iters)
    if set(kernels) & set(NVFP4_KERNELS):
        g = torch.Generator(device="cpu").manual_seed(2)
        weights = [nvfp4.quantize_nvfp4((torch.randn(n, k, generator=g) * 0.02).to(dev, torch.bfloat16))
                   for _, n, k in shape["weights"]]
        row_scales = [w8a8.nvfp4_channel_scales(*q) for q in weights]
        codes = sum(q.packed.numel() + q.block_scale.numel() for q in weights)  # what both read
        values = sum(2 * q.packed.numel() for q in weights)

        def dequant_all(qs, cfg):
            return [nvfp4_triton.dequantize_nvfp4_triton(*q, torch.bfloat16, config=cfg) for q in qs]

        def e4m3_all(qs, cfg):
            return [nvfp4_triton.nvfp4_to_e4m3_triton(*q, rs, config=cfg).view(torch.uint8)
                    for q, rs in zip(qs, row_scales, strict=True)]

        cases = {"nvfp4_dequant": ("bf16", dequant_all, codes + 2 * values),
                 "nvfp4_e4m3": ("e4m3 under per-row scales", e4m3_all,
                                codes + values + sum(4 * len(rs) for rs in row_scales))}
        for name in NVFP4_KERNELS:
            if name in kernels:
                what, run, nbytes = cases[name]
                res["kernels"][name] = sweep(f"{name} (the block-linear weights, {what})", nvfp4_candidates(name, dev),
                                             run, lambda: weights, nbytes, dev, args.iters)
    print(f"\nfastest on {gpu}:")
    for name, r in res["kernels"].items():
        print(f"  {name!r}: {r['best']!r},")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    failed = [n for n, r in res["kernels"].items() if not r["ok"]]
    if failed:
        print(f"tune_kernels: configs that fail or give other bits: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
