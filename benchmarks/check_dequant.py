"""NVFP4 -> dense dequantization at the DiT block linears' shapes: our Triton kernel vs comfy-kitchen's CUDA kernel vs
the torch path, bitwise and timed.

    python3 benchmarks/check_dequant.py [--device cuda] [--iters 20] [--out R.json] [--small]

Per shape (qkv 21504x5376, out 5376x7168, fc1 28672x5376, fc2 5376x14336; --small: tiny odd shapes):
- bitwise, bf16 / fp16 / fp32 outputs: Triton == torch path (same device) == comfy-kitchen (when it loads), on a
  quantized weight and on raw random storage (every code, every non-NaN E4M3 scale, a global scale that rounds);
  out: also == the torch path on the CPU (what the shared CPU traces were recorded with);
- bf16 ms per call and GB/s (bytes moved: packed codes + block scales read, dense weight written) for comfy-kitchen,
  the torch path, the Triton kernel in every `nvfp4_triton.CONFIGS` entry, and a device copy of the same bytes
  (the bandwidth ceiling);
- the config with the least total time, and per step (x 50 blocks) for each backend.
Exit 1 if any comparison differs. On the CPU (TRITON_INTERPRET=1 --small --device cpu) it is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

SHAPES = [("qkv", 21504, 5376), ("out", 5376, 7168), ("fc1", 28672, 5376), ("fc2", 5376, 14336)]
SMALL_SHAPES = [("qkv", 300, 160), ("out", 130, 270), ("fc1", 200, 96), ("fc2", 37, 520)]
BLOCKS = 50


def main(argv=None) -> int:
    import torch

    from h3direct.checkpoint.quant import nvfp4, nvfp4_triton
    from h3direct.checkpoint.quant.kitchen import kitchen_op

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--small", action="store_true", help="tiny odd shapes (a CPU smoke run under TRITON_INTERPRET=1)")
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    if nvfp4_triton.triton is None:
        print("check_dequant: Triton is not importable here", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    bf16 = torch.bfloat16
    kitchen = cuda and kitchen_op("dequantize_nvfp4") is not None
    res: dict = {"device": torch.cuda.get_device_name() if cuda else str(dev), "kitchen": kitchen,
                 "triton": nvfp4_triton.triton.__version__, "default_config": nvfp4_triton.launch_config(dev),
                 "shapes": {}, "mismatches": []}
    configs = nvfp4_triton.CONFIGS if cuda else ((256, 4),)
    default = nvfp4_triton.launch_config(dev) if cuda else configs[0]
    g = torch.Generator(device="cpu").manual_seed(0)

    def ms_per_call(fn) -> float:  # the GPU: median of --iters after one warm-up call; the CPU: one call
        r = C.time_calls(fn, dev, warmup=1, iters=args.iters) if cuda else C.time_calls(fn, dev, warmup=0, iters=1)
        return 1e3 * r["median_s"]

    def check(what: str, ours: torch.Tensor, ref: torch.Tensor) -> bool:
        ok = C.same_bits(ours, ref)
        if not ok:
            n = int((C.bits(ours) != C.bits(ref)).sum())
            res["mismatches"].append(f"{what}: {n} values differ")
            print(f"  MISMATCH {what}: {n} of {ours.numel()} values differ")
        return ok

    for name, n, k in SMALL_SHAPES if args.small else SHAPES:
        entry: dict = {"n": n, "k": k}
        rows, cols = nvfp4.padded_shape((n, k))
        # a weight as the checkpoint holds it, and raw random storage
        w = torch.randn(n, k, generator=g).mul_(0.02).to(device=dev, dtype=torch.bfloat16)
        quant = nvfp4.quantize_nvfp4(w)
        del w
        codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
        scale_bytes = torch.randint(0, 255, (rows, cols // 16), generator=g, dtype=torch.uint8)
        scale_bytes[scale_bytes == 0x7F] = 0x7E  # no NaN scales: their bit patterns are not part of the contract
        raw = nvfp4.NVFP4Tensor(codes.to(dev), nvfp4.swizzle_block_scales(scale_bytes.view(torch.float8_e4m3fn)).to(dev),
                                torch.tensor(1.2345678e-3, device=dev))
        ok = True
        for label, q in (("quantized", quant), ("random", raw)):
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                tag = f"{name} {label} {str(dt)[6:]}"
                tri = nvfp4_triton.dequantize_nvfp4_triton(*q, dt, config=default)
                ref = nvfp4.dequantize_nvfp4(*q, dt, backend="torch")
                ok &= check(f"{tag} triton vs torch path", tri, ref)
                if kitchen:  # both against the torch path, so a difference says whose it is
                    ok &= check(f"{tag} comfy-kitchen vs torch path", nvfp4.dequantize_nvfp4(*q, dt, backend="kitchen"),
                                ref)
                del ref
                if name == "out" and cuda:  # the CPU torch path (what the CPU traces were recorded with)
                    cpu = nvfp4.dequantize_nvfp4(*(t.cpu() for t in q), dt, backend="torch")
                    ok &= check(f"{tag} triton vs CPU torch path", tri.cpu(), cpu)
                del tri

        # bf16 timings on the quantized weight
        nbytes = quant.packed.numel() + quant.block_scale.numel() + 2 * rows * cols
        ms = {}
        if kitchen:
            ms["kitchen"] = ms_per_call(lambda q=quant: nvfp4.dequantize_nvfp4(*q, bf16, backend="kitchen"))
        ms["torch"] = ms_per_call(lambda q=quant: nvfp4.dequantize_nvfp4(*q, bf16, backend="torch"))
        first = nvfp4_triton.dequantize_nvfp4_triton(*quant, bf16, config=default)
        for cfg in configs:  # every config: the same bits as the default (checked above)
            ok &= check(f"{name} triton {cfg} vs default config", nvfp4_triton.dequantize_nvfp4_triton(
                *quant, bf16, config=cfg), first)
            ms[f"triton {cfg[0]}x{cfg[1]}"] = ms_per_call(
                lambda q=quant, cfg=cfg: nvfp4_triton.dequantize_nvfp4_triton(*q, bf16, config=cfg))
        src = torch.empty(nbytes // 2, dtype=bf16, device=dev)
        dst = torch.empty_like(src)
        ms["copy"] = ms_per_call(lambda s=src, d=dst: d.copy_(s))  # reads and writes nbytes/2 each: nbytes moved
        del src, dst, quant, raw, first
        entry["bitwise"] = ok
        entry["ms"] = ms
        entry["gbps"] = {key: nbytes / (v * 1e-3) / 1e9 for key, v in ms.items()}
        entry["bytes"] = nbytes
        res["shapes"][name] = entry
        print(f"{name} {n}x{k}: bitwise {'ok' if ok else 'MISMATCH'}; "
              + ", ".join(f"{key} {v:.3f} ms" for key, v in ms.items()), flush=True)

    names = list(res["shapes"])
    total = {key: sum(res["shapes"][s]["ms"][key] for s in names) for key in res["shapes"][names[0]]["ms"]}
    tri = {key: v for key, v in total.items() if key.startswith("triton")}
    best = min(tri, key=tri.get)
    res["best_config"] = best
    res["per_step_ms"] = {key: BLOCKS * v for key, v in total.items()}
    res["per_step_bytes_gb"] = BLOCKS * sum(res["shapes"][s]["bytes"] for s in names) / 1e9

    print(f"\n== NVFP4 -> bf16 dequantization, {res['device']}, triton {res['triton']}, median of {args.iters} calls")
    head = f"  {'backend':16s}" + "".join(f"{s:>16s}" for s in names) + f"{'per step (x50)':>18s}"
    print(head + "\n  " + " " * 16 + "".join(f"{'ms   GB/s':>16s}" for _ in names) + f"{'ms':>18s}")
    for key in total:
        cells = "".join(f"{res['shapes'][s]['ms'][key]:8.3f} {res['shapes'][s]['gbps'][key]:6.0f} " for s in names)
        mark = "  <- best" if key == best else ("  <- default" if key == f"triton {default[0]}x{default[1]}" else "")
        print(f"  {key:16s}{cells}{res['per_step_ms'][key]:12.1f}{mark}")
    print(f"  bytes per step: {res['per_step_bytes_gb']:.1f} GB; best config {best}; default "
          f"{default[0]}x{default[1]}")
    if "kitchen" in total:
        print(f"  speed-up of the best Triton config over comfy-kitchen: {total['kitchen'] / tri[best]:.2f}x")
    n_ck = sum("comfy-kitchen" in m for m in res["mismatches"])
    n_tri = len(res["mismatches"]) - n_ck
    verdict = "all equal" if not res["mismatches"] else (f"{n_tri} Triton MISMATCHES, {n_ck} comfy-kitchen vs torch "
                                                         "path MISMATCHES (listed above)")
    print(f"  bitwise (triton == torch path == comfy-kitchen, bf16/fp16/fp32, quantized + random storage): {verdict}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    # Triton must equal the torch path (the CPU traces' arithmetic); comfy-kitchen 0.2.40's CUDA kernel is known to
    # round ~6 % of the values one ulp away (H200, 2026-12-01): reported, not a failure of ours
    return 1 if n_tri else 0


if __name__ == "__main__":
    sys.exit(main())
