"""FP8 W8A8 at the full model's four block-linear shapes (M = 20,050 rows): time and error of each path.

    python3 benchmarks/fp8_gemm_check.py --out fp8_gemm.json [--rows 20050] [--iters 5]

Per shape [K -> N] (qkv 5376->21504, out 7168->5376, fc1 5376->28672, fc2 14336->5376), bf16 activations with a few
outlier rows, weights randn·0.02:
  bf16       F.linear(x, W) in bf16
  fp8        `w8a8.linear_w8a8` with a resident e4m3 weight (activation quantization included), and its parts:
             the Triton activation quantization alone and `torch._scaled_mm` alone
  w4a16      today's NVFP4 path: dequantize to bf16 + F.linear
  fp8 stream NVFP4 weight -> e4m3 (Triton) + `linear_w8a8`
each with rel-L2 against an fp32 product (TF32 off) of the same operands (for the NVFP4 paths: of the NVFP4 weight's
fp32 decode), and the Triton kernels' bitwise agreement with the torch reference math on the GPU (codes that differ).
"""

from __future__ import annotations

import argparse
import json
import sys

SHAPES = {"qkv_proj": (5376, 21504), "out_proj": (7168, 5376), "fc1": (5376, 28672), "fc2": (14336, 5376)}


def timed(fn, iters: int) -> float:
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rel(a, ref) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def check_shape(k: int, n: int, rows: int, iters: int, g, device: str = "cuda") -> dict:
    import torch
    import torch.nn.functional as F

    from h3direct.checkpoint.quant import nvfp4, w8a8, w8a8_triton

    dev = torch.device(device)
    r = {"K": k, "N": n}
    x = torch.randn(rows, k, device=dev, generator=g, dtype=torch.bfloat16)
    x[::997] *= 30  # outlier tokens: per-token scales must keep the others
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    tflop = 2 * rows * k * n / 1e12
    ref = x.float() @ w.float().T
    r["bf16_ms"] = timed(lambda: F.linear(x, w), iters)
    r["bf16_rel_l2"] = rel(F.linear(x, w), ref)
    w8, sw = w8a8.quantize_rows(w)
    w8a8.reset_fp8_linear_stats()
    y = w8a8.linear_w8a8(x, w8, sw)
    r["fp8_path"] = w8a8.fp8_linear_stats()
    r["fp8_rel_l2"] = rel(y, ref)
    r["fp8_ms"] = timed(lambda: w8a8.linear_w8a8(x, w8, sw), iters)
    r["act_quant_ms"] = timed(lambda: w8a8_triton.quantize_rows(x), iters)
    x8, sx = w8a8_triton.quantize_rows(x)
    q2, s2 = w8a8.quantize_rows(x)
    r["act_quant_codes_differing"] = int((x8.view(torch.uint8) != q2.view(torch.uint8)).sum())
    r["act_quant_scales_equal"] = bool(torch.equal(sx, s2))
    sb = sw[None, :].contiguous()
    r["scaled_mm_ms"] = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx[:, None], scale_b=sb,
                                                       out_dtype=torch.bfloat16), iters)
    r["scaled_mm_fast_accum_ms"] = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx[:, None], scale_b=sb,
                                                                  out_dtype=torch.bfloat16, use_fast_accum=True), iters)
    r["bf16_tflops"] = tflop / r["bf16_ms"] * 1e3
    r["fp8_tflops"] = tflop / r["fp8_ms"] * 1e3
    r["scaled_mm_tflops"] = tflop / r["scaled_mm_ms"] * 1e3
    del ref, y, q2
    # NVFP4 weights: today's W4A16 dequant + bf16 GEMM vs the fp8 stream conversion
    t = nvfp4.quantize_nvfp4(w)
    dense = w8a8.decode_nvfp4_fp32(*t)[:n, :k]
    ref4 = x.float() @ dense.T
    del dense
    r["w4a16_ms"] = timed(lambda: nvfp4.linear_w4a16(x, *t, None, torch.bfloat16, out_features=n), iters)
    r["w4a16_rel_l2"] = rel(nvfp4.linear_w4a16(x, *t, None, torch.bfloat16, out_features=n), ref4)
    s4 = w8a8.nvfp4_channel_scales(*t)
    r["nvfp4_to_e4m3_ms"] = timed(lambda: w8a8_triton.nvfp4_to_e4m3(*t, s4), iters)
    a = w8a8_triton.nvfp4_to_e4m3(*t, s4)
    b = w8a8.nvfp4_to_e4m3_reference(*t, s4)
    r["nvfp4_to_e4m3_codes_differing"] = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())

    def stream():
        q = w8a8.nvfp4_to_e4m3(*t, s4)
        return w8a8.linear_w8a8(x, q[:n, :k], s4[:n])

    r["fp8_stream_ms"] = timed(stream, iters)
    r["fp8_stream_rel_l2"] = rel(stream(), ref4)
    r["status"] = "ok"
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, default=20050)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fp8_gemm_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results = {"rows": args.rows, "device": torch.cuda.get_device_name(), "shapes": {}}
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        try:
            r = check_shape(k, n, args.rows, args.iters, g)
        except Exception as exc:  # noqa: BLE001 - one shape failing must not hide the others
            r = {"K": k, "N": n, "status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        results["shapes"][name] = r
        torch.cuda.empty_cache()
        print(json.dumps({name: r}), flush=True)
    print(f"{'shape':9s} {'bf16 ms':>8s} {'fp8 ms':>7s} {'quant':>6s} {'mm':>6s} {'TF/s bf16/fp8':>14s} "
          f"{'relL2 bf16':>10s} {'relL2 fp8':>9s} | {'w4a16 ms':>8s} {'stream ms':>9s} {'cvt ms':>6s} {'relL2 w4a16':>11s} "
          f"{'relL2 strm':>10s} | codes differing act/cvt")
    for name, r in results["shapes"].items():
        if r.get("status") != "ok":
            print(f"{name:9s} {r.get('status')}")
            continue
        print(f"{name:9s} {r['bf16_ms']:8.2f} {r['fp8_ms']:7.2f} {r['act_quant_ms']:6.2f} {r['scaled_mm_ms']:6.2f} "
              f"{r['bf16_tflops']:6.0f}/{r['fp8_tflops']:<7.0f} {r['bf16_rel_l2']:10.2e} {r['fp8_rel_l2']:9.2e} | "
              f"{r['w4a16_ms']:8.2f} {r['fp8_stream_ms']:9.2f} {r['nvfp4_to_e4m3_ms']:6.2f} "
              f"{r['w4a16_rel_l2']:11.2e} {r['fp8_stream_rel_l2']:10.2e} | "
              f"{r['act_quant_codes_differing']}/{r['nvfp4_to_e4m3_codes_differing']} path {r['fp8_path']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
