"""The block linears' GEMMs at the workload's shapes: h3direct's int8 kernel against torch's bf16, int8 (cuBLASLt,
`torch._int_mm` + the Triton epilogue) and FP8 e4m3 (`torch._scaled_mm`, rowwise scales, fast accumulation), in one
run on one GPU.

    python -m benchmarks.int8_gemm [--m M] [--out R.json] [--iters 50]

Per shape (M tokens, the contract's S by default; the full DiT's block linears, `_common.block_gemm_shapes`: qkv
5,376 -> 21,504, out 7,168 -> 5,376, fc1 5,376 -> 28,672, fc2 14,336 -> 5,376) and per GEMM: the median ms (triton's
do_bench, operands made once per shape, int8 activations already quantized: the GEMM and its epilogue alone; the
formats timed in turn, three rounds) and its rate (TOPS / TFLOP/s); then the block's four GEMMs summed, as
ratios to bf16. The int8 kernel's output is checked bitwise against cuBLASLt's int32 product through the same
epilogue on every shape (exact integer accumulation: the same bits or a bug), and every tile shape autotuning may pick
is timed (`--all-configs`). Beside the GEMMs, the weight a `stream` 8-bit linear makes from its NVFP4 tensors on
every call: `int8` (`w8a8.nvfp4_to_codes`, one pass), `int8_rotated` (the option fp8_linear_rotate: dequantized to
bf16, then rotated and encoded in one pass, `w8a8.rotated_int8_codes`) and `int8_rotated_torch` (the same through its
torch reference, three passes), with the rotated kernel's codes checked against the reference; and the input's
quantization: `int8` (per row, one pass), `int8_rotated` (rotated and quantized in one kernel,
`w8a8.quantize_rotated_int8`) and `int8_rotated_torch` (`hadamard.rotate_rows`, then per row). `--smoke`: small
shapes on the CPU through Triton's interpreter (plumbing only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks import _common as C

FULL = C.PRESETS["full"]


def block_shapes() -> dict[str, tuple[int, int]]:
    """{linear: (K, N)} of the full DiT's four block linears."""
    from h3direct.config import H3Config

    return {name: (k, n) for name, _, n, k in C.block_gemm_shapes(H3Config.from_name(FULL.dit_config), 0)}


def operands(m: int, k: int, n: int, device, seed: int):
    """bf16 activations and weights with a spread of row and channel scales, and their int8 and e4m3 codes."""
    import torch

    from h3direct.checkpoint.quant import w8a8

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 0.5, k)[None, :]).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.1).to(device, torch.bfloat16)
    x8, sx = w8a8.quantize_activation(x, "int8")
    w8, sw = w8a8.format_functions("int8")[0](w)
    xe, sxe = w8a8.quantize_activation(x, "e4m3")
    we, swe = w8a8.format_functions("e4m3")[0](w)
    return {"x": x, "w": w, "bias": bias, "x8": x8, "sx": sx, "w8": w8, "sw": sw, "xe": xe, "sxe": sxe, "we": we,
            "swe": swe}


def gemms(o: dict, config=None) -> dict:
    """name -> the call timed (its output in bf16)."""
    import torch

    from h3direct.checkpoint.quant import int8_gemm, w8a8_triton

    return {
        "bf16": lambda: torch.nn.functional.linear(o["x"], o["w"], o["bias"]),
        "e4m3_scaled_mm": lambda: torch._scaled_mm(o["xe"], o["we"].t(), scale_a=o["sxe"][:, None],
                                                   scale_b=o["swe"][None, :], bias=o["bias"],
                                                   out_dtype=torch.bfloat16, use_fast_accum=True),
        "int8_int_mm": lambda: w8a8_triton.int8_epilogue(torch._int_mm(o["x8"], o["w8"].t()), o["sx"], o["sw"],
                                                         o["bias"], torch.bfloat16),
        "int8_h3direct": lambda: int8_gemm.int8_linear(o["x8"], o["w8"], o["sx"], o["sw"], o["bias"],
                                                       torch.bfloat16, config),
    }


def weight_calls(w) -> dict:
    """name -> one stream-mode weight conversion from the NVFP4 tensors of bf16 weight `w` (module docstring)."""
    import torch

    from h3direct.checkpoint.quant import hadamard, w8a8
    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    n, k = w.shape
    q = quantize_nvfp4(w)
    scales = w8a8.nvfp4_channel_scales(*q, "int8")
    rotated_scales = w8a8.int8_row_scales(hadamard.rotate_rows(dequantize_nvfp4(*q, torch.bfloat16)[:n, :k]))

    def dense():
        return dequantize_nvfp4(*q, torch.bfloat16)[:n, :k]

    return {"int8": lambda: w8a8.nvfp4_to_codes(*q, scales, "int8"),
            "int8_rotated": lambda: w8a8.rotated_int8_codes(dense(), rotated_scales),
            "int8_rotated_torch": lambda: w8a8.rotated_int8_codes_reference(dense(), rotated_scales)}


def input_calls(x) -> dict:
    """name -> one quantization of the activation x as an int8 linear makes it (module docstring)."""
    from h3direct.checkpoint.quant import hadamard, w8a8

    return {"int8": lambda: w8a8.quantize_activation(x, "int8"),
            "int8_rotated": lambda: w8a8.quantize_rotated_int8(x),
            "int8_rotated_torch": lambda: w8a8.quantize_activation(hadamard.rotate_rows(x), "int8")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.int8_gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=None, help="tokens (default: the contract's S, 20,050)")
    ap.add_argument("--iters", type=int, default=50, help="do_bench's repetitions in ms (default 50)")
    ap.add_argument("--out", default=None, help="result JSON")
    ap.add_argument("--all-configs", action="store_true", help="also time every tile shape autotuning picks from")
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU through Triton's interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from h3direct.checkpoint.quant import int8_gemm

    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        C.usage_error("no CUDA device here (--smoke runs the plumbing on the CPU)", "int8_gemm")
    smaller = lambda d: (d // 128 + 15) // 16 * 16  # noqa: E731 (the smoke run's sizes: multiples of 16)
    full = block_shapes()
    shapes = {k: (smaller(v[0]), smaller(v[1])) for k, v in full.items()} if args.smoke else full
    m = 50 if args.smoke else args.m or C.workload(FULL.width, FULL.height, FULL.frames, FULL.text_len)["seq_len"]
    result = {"device": C.env_info(dev).get("gpu") or dev, "env": {**C.env_info(dev), "packages":
              C.package_versions()}, "commit": C.git_commit(), "tree": C.source_tree(), "m": m,
              "command": ["python", "-m", "benchmarks.int8_gemm", *(argv if argv is not None else sys.argv[1:])],
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shapes": {}}
    for i, (name, (k, n)) in enumerate(shapes.items()):
        o = operands(m, k, n, dev, seed=i)
        calls = gemms(o)
        ours, ref = calls["int8_h3direct"](), (calls["int8_int_mm"]() if dev == "cuda" else None)
        if ref is None:
            from h3direct.checkpoint.quant import w8a8

            ref = w8a8.int8_epilogue(o["x8"].double() @ o["w8"].double().T, o["sx"], o["sw"], o["bias"],
                                     torch.bfloat16)
        row = {"m": m, "k": k, "n": n, "bitwise_int8": bool(torch.equal(ours, ref)), "ms": {}, "rate": {}}
        ops = 2.0 * m * k * n
        timed = {what: fn for what, fn in calls.items() if dev == "cuda" or what == "int8_h3direct"}
        for what, ms in _time_interleaved(timed, args.iters, dev).items():
            row["ms"][what], row["rate"][what] = ms, ops / ms / 1e9
        if args.all_configs and dev == "cuda":
            from triton.runtime.errors import OutOfResources

            row["configs"] = {}
            for cfg in int8_gemm.CONFIGS:
                try:
                    row["configs"][str(cfg)] = _time(gemms(o, cfg)["int8_h3direct"], args.iters, dev)
                except OutOfResources as exc:  # a config that does not fit this GPU: its reason
                    row["configs"][str(cfg)] = f"{type(exc).__name__}: {str(exc)[:120]}"
        row["tuned"] = str(int8_gemm.tuned(o["x8"], o["w8"], torch.bfloat16, o["bias"]))
        conv = weight_calls(o["w"])
        row["bitwise_rotated_weight"] = bool(torch.equal(conv["int8_rotated"](), conv["int8_rotated_torch"]()))
        row["weight_ms"] = {what: _time(fn, args.iters, dev) for what, fn in conv.items()}
        C.log(f"{name} weight from NVFP4: " + ", ".join(f"{w} {t:.3f} ms" for w, t in row["weight_ms"].items())
              + f"; rotated bitwise {row['bitwise_rotated_weight']}")
        row["input_ms"] = {what: _time(fn, args.iters, dev) for what, fn in input_calls(o["x"]).items()}
        C.log(f"{name} input: " + ", ".join(f"{w} {t:.3f} ms" for w, t in row["input_ms"].items()))
        del conv
        result["shapes"][name] = row
        C.log(f"{name} [{m}x{k}] x [{k}x{n}]: " + ", ".join(f"{w} {t:.3f} ms ({row['rate'][w]:.0f} T/s)"
                                                             for w, t in row["ms"].items())
              + f"; bitwise {row['bitwise_int8']}")
        del o, calls
    block = {w: sum(r["ms"][w] for r in result["shapes"].values() if w in r["ms"])
             for w in next(iter(result["shapes"].values()))["ms"]}
    result["block_ms"] = block
    for part in ("weight_ms", "input_ms"):
        result[f"block_{part}"] = {w: sum(r[part][w] for r in result["shapes"].values())
                                   for w in next(iter(result["shapes"].values()))[part]}
    if "bf16" in block:
        result["x_bf16"] = {w: block["bf16"] / t for w, t in block.items()}
        C.log("block: " + ", ".join(f"{w} {t:.2f} ms (x{block['bf16'] / t:.2f} bf16)" for w, t in block.items()))
    if args.out:
        C.write_result(args.out, result)
    return 0 if all(r["bitwise_int8"] and r["bitwise_rotated_weight"] for r in result["shapes"].values()) else 1


def _time_interleaved(calls: dict, iters: int, dev: str, rounds: int = 3) -> dict:
    """name -> median ms over `rounds` rounds, each timing every call once in turn: on a power-capped GPU the clocks
    drift during a run, and rounds spread that drift over every format alike instead of charging it to the last."""
    if dev == "cpu":
        return {what: _time(fn, iters, dev) for what, fn in calls.items()}
    from triton.testing import do_bench

    times = {what: [] for what in calls}
    for _ in range(rounds):
        for what, fn in calls.items():
            times[what].append(do_bench(fn, warmup=10, rep=iters))
    return {what: statistics.median(t) for what, t in times.items()}


def _time(fn, iters: int, dev: str) -> float:
    if dev == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return statistics.median([do_bench(fn, warmup=10, rep=iters) for _ in range(3)])


if __name__ == "__main__":
    raise SystemExit(main())
