"""Where one full-size DiT step spends its GPU time: torch.profiler over one step, kernels grouped by kind.

    python3 benchmarks/profile_dit.py [--weights nvfp4|bf16] [--attention sdpa] [--fp8-linear] [--option sol_tau=1.3]

Prints the top kernels by CUDA time and a breakdown (GEMM, attention, NVFP4 dequant, norm/rope/elementwise, copies)
against the kernel floor; writes the profiler table to $OUT/profile_<weights>.txt.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

CATEGORIES = (  # first match wins, on the lower-cased kernel name
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "sm90_xmma_fprop", "sage", "int8_attn", "sol_",
                   "prep_q", "prep_k", "prep_reduce_kv", "prep_pooled", "vquant_transpose")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "ampere_", "cublas")),
    ("fp8 quant", ("quant_rows", "nvfp4_e4m3")),  # FP8 W8A8: activation quantization, NVFP4 -> e4m3 (stream)
    ("dequant", ("dequant", "nvfp4")),
    ("norm/rope", ("rms", "norm", "rope")),
    ("copy/cat", ("copy", "cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "silu", "mul", "add", "triton", "swiglu")),
)


def category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def main(argv=None) -> int:
    import torch
    from bench_dit import make_inputs
    from synthetic_gpu import build_dit
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from h3direct.config import H3Config
    from h3direct.dit.denoiser import Denoiser, audio_scale_of
    from h3direct.dit.options import Options

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="full-curve")
    p.add_argument("--weights", default="nvfp4")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--mlp-chunks", type=int, default=1)
    p.add_argument("--fp8-linear", nargs="?", const="stream", default="off", choices=("off", "stream", "resident"),
                   help="FP8 W8A8 block linears (bare flag = stream)")
    p.add_argument("--width", type=int, default=960)
    p.add_argument("--height", type=int, default=544)
    p.add_argument("--frames", type=int, default=124)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option by its flat name (repeatable), e.g. --option sol_tau=1.3")
    args = p.parse_args(argv)
    from h3direct.dit.options import parse_assignments
    from h3direct.errors import H3Error

    try:
        given = parse_assignments(args.option)
    except H3Error as exc:
        p.error(str(exc))
    config = H3Config.from_name(args.preset)
    wl = C.workload(args.width, args.height, args.frames, 256)
    model, info = build_dit(config, args.weights, args.device, fp8_linear=args.fp8_linear)
    video, audio, text, cond = make_inputs(config, wl, args.device, 0)
    with torch.inference_mode():
        context = model.preprocess_text(text)
        options = Options.from_flat({"attention": args.attention, "mlp_chunks": args.mlp_chunks, **given})
        den = Denoiser(model, context, cond, audio_scale=audio_scale_of(model), options=options)
        sigma = torch.tensor([0.8], device=args.device)
        den(video, audio, sigma)
        C.sync(args.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if C.is_cuda(args.device) else [])
        with profile(activities=activities) as prof:
            den(video, audio, sigma)
            C.sync(args.device)
    # kernels only: an operator's row repeats the device time of the kernels it launched
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / 1e3
    by_cat: dict[str, float] = {}
    for e in events:
        by_cat[category(e.key)] = by_cat.get(category(e.key), 0.0) + e.self_device_time_total / 1e3
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]
    print(f"\n== top {args.top} kernels ({args.weights}, {args.attention}); GPU total {total:.1f} ms")
    for e in rows:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms  {e.count:6d}x  {category(e.key):12s} {e.key[:110]}")
    print("\n== by category (ms per step)")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:12s} {ms:9.1f}  {100 * ms / total:5.1f} %")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"profile_{args.weights}_{args.attention}.txt").write_text(
            prof.key_averages().table(sort_by="self_cuda_time_total" if C.is_cuda(args.device) else "self_cpu_time_total",
                                      row_limit=80, max_name_column_width=120))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
