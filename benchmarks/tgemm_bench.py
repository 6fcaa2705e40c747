"""Triton GEMM (h3direct/dit/gemm_triton.py) vs cuBLAS on the DiT block's four GEMM shapes, and its fused epilogues
vs cuBLAS + our separate fused elementwise kernel (h3direct/dit/fused.py).

    python3 benchmarks/tgemm_bench.py --part fc1 [--compile-only] --out R/fc1.json    # one shape per process
    python3 benchmarks/tgemm_bench.py --summary R                                      # the table from R/*.json
    python3 benchmarks/tgemm_bench.py --part fc1 --device cpu --out x.json             # CPU smoke (interpreter)

Per part (M = 20,050 rows, bf16, W [N, K]):
  qkv N 21504 K 5376 | out N 5376 K 7168 | fc1 N 28672 K 5376 | fc2 N 5376 K 14336 (A = the strided SwiGLU view)
- cuBLAS (F.linear) and each Triton config of a bounded sweep: ms (triton.testing.do_bench, median, L2 flushed),
  TFLOP/s, rel-L2 error vs an fp64 product on the first 1024 rows (and the error of rounding that reference once);
- the fused variant with the best plain config and a fixed one: fc1 -> linear_swiglu vs F.linear + fused.swiglu_;
  out / fc2 -> linear_gated_residual_ vs F.linear + fused.gated_residual_; qkv -> linear_qk_norm_rope (BN = 128)
  vs F.linear + fused.qk_norm_rope_; each also against its fp64 reference.
Every config runs in a try (a compile error or out-of-resources is recorded, the rest goes on). `--compile-only`
calls each variant once (fills Triton's cache; the GPU script runs the four parts' compiles in parallel first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 20050
SHAPES = {"qkv": (21504, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
HEADS, HEAD_DIM, ROT_PAIRS = 56, 128, 48
REF_ROWS = 1024


def _configs(Config, cpu: bool):
    """The sweep: the Hopper tutorial tile (128x256x64, 8 warps) by pipeline depth / store path, persistent
    (+ warp-specialised), pointer loads, and the transposed 256x128 tile. Small tiles on the CPU."""
    if cpu:
        return [Config(bm=32, bn=64, bk=32, group_m=2, tma=t, persistent=p) for t in (True, False) for p in (0, 1)] + [
            Config(bm=32, bn=64, bk=32, tma_store=False)]
    # shared memory (sm_90 compile, Triton 3.9 offline): 128x256x64 with the TMA-store staging buffer 208 KiB at 3
    # stages (4 would need 256 KiB > 227 KiB), 192 KiB at 4 stages with pointer stores ("pst"). Persistent and
    # one-program-per-tile are the same binary (only the grid differs); ws: Triton 3.9 leaves sm_90 loops
    # unspecialised (the attribute stays, no partitions), kept to see what 3.6 does with it.
    return [Config(128, 256, 64, 8, 3, 8),
            Config(128, 256, 64, 8, 4, 8, tma_store=False),
            Config(128, 256, 64, 8, 3, 8, persistent=True),
            Config(128, 256, 64, 8, 4, 8, persistent=True, tma_store=False),
            Config(128, 256, 64, 8, 4, 8, persistent=True, ws=True, tma_store=False),
            Config(128, 256, 64, 8, 4, 8, tma=False),
            Config(256, 128, 64, 8, 3, 8)]


def _qk_configs(Config, cpu: bool):
    """(config, paired) for the qkv + q/k norm + rope epilogue (BN = head_dim). Offline sm_90 compile (Triton 3.9):
    the gather epilogue spills ~800 B/thread at 128x128 (8 warps), the paired one ~230 B; 256x128 spills KiBs."""
    if cpu:
        return [(Config(bm=32, bn=HEAD_DIM, bk=32, group_m=2), False), (Config(bm=32, bn=HEAD_DIM, bk=32), True),
                (Config(bm=32, bn=HEAD_DIM, bk=32, tma=False, persistent=True), True)]
    return [(Config(128, 128, 64, 8, 4, 8), False), (Config(128, 128, 64, 8, 4, 8), True),
            (Config(128, 128, 64, 8, 4, 8, persistent=True), True), (Config(128, 128, 64, 8, 4, 8, tma=False), True)]


def _rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _err(y, ref) -> dict:
    """rel-L2 vs the fp64 reference; ok: within 1.05x the error of rounding the reference to bf16 once (what an
    fp32-accumulated product rounded once lands in; a wrong tile order / column mix-up is far outside)."""
    e, one = _rel(y[:ref.shape[0]], ref), _rel(ref.bfloat16(), ref)
    return {"rel_l2": e, "one_rounding": one, "ok": bool(e <= 1.05 * one)}


def run_part(part: str, device: str, compile_only: bool, rows: int) -> dict:
    import torch
    import torch.nn.functional as F

    from h3direct.dit import fused, gemm_triton, rope
    from h3direct.dit.timesteps import ModRun

    cuda = device.startswith("cuda")
    n, k = SHAPES[part]
    heads = HEADS
    if not cuda:  # tiny geometry for the interpreter: the same code paths
        (n, k), heads = {"qkv": (3 * 2 * HEAD_DIM, 64), "out": (64, 96), "fc1": (256, 64), "fc2": (64, 128)}[part], 2
    m = rows
    ref_rows = min(REF_ROWS, m)
    Config = gemm_triton.Config
    res: dict = {"part": part, "m": m, "n": n, "k": k, "device": torch.cuda.get_device_name() if cuda else device,
                 "compile_only": compile_only}
    flop = 2.0 * m * n * k

    def bench(fn):
        if compile_only:
            fn()
            if cuda:
                torch.cuda.synchronize()
            return float("nan")
        if cuda:
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)

    def attempt(name, fn, check=None):
        row = {"name": name}
        try:
            row["ms"] = bench(fn)
            row["tflops"] = flop / row["ms"] / 1e9 if row["ms"] == row["ms"] else float("nan")
            if check is not None and not compile_only:
                row.update(check())
        except Exception as exc:  # a compile error / out of resources: recorded, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            row["trace"] = traceback.format_exc()[-1500:]
            if cuda:
                try:
                    torch.cuda.synchronize()
                except Exception as exc2:  # the context is gone: nothing after this can run
                    row["fatal"] = repr(exc2)
        print(f"  {part} {name:34s} " + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
                                         if "error" not in row else f"ERROR {row['error'][:150]}")
              + (f"  rel-L2 {row['rel_l2']:.3e} (one rounding {row['one_rounding']:.3e}) {'(1 rounding)' if row['ok'] else '(>1 rounding)'}"
                 if "rel_l2" in row else ""),
              flush=True)
        return row

    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    if part == "fc2":  # A as the block hands it: SwiGLU written over fc1's gate half, row stride 2K
        x = randn(m, 2 * k)[:, :k]
    else:
        x = randn(m, k)
    w = randn(n, k, scale=k ** -0.5)
    ref = x[:ref_rows].double() @ w.double().T

    # ---- plain GEMM: cuBLAS vs the sweep
    res["cublas"] = attempt("cublas F.linear", lambda: F.linear(x, w), lambda: _err(F.linear(x, w), ref))
    res["configs"] = []
    for cfg in _configs(Config, not cuda):
        row = attempt(cfg.name, lambda cfg=cfg: gemm_triton.linear(x, w, cfg),
                      lambda cfg=cfg: _err(gemm_triton.linear(x, w, cfg), ref))
        res["configs"].append(row)
        if "fatal" in row:
            return res
    ok = [r for r in res["configs"] if "error" not in r and r["ms"] == r["ms"]]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    res["best"] = best["name"] if best else None
    cfg_by_name = {c.name: c for c in _configs(Config, not cuda)}
    # the fused epilogues with: the best plain config, and the first two of the sweep (TMA store at 3 stages,
    # pointer store at 4: the epilogues without a TMA store leave shared memory for the 4th stage)
    fixed = _configs(Config, not cuda)[:2]
    fused_cfgs = list(dict.fromkeys(([cfg_by_name[best["name"]]] if best else []) + fixed))
    if compile_only:  # the fixed ones (the timing run compiles the best plain config's, if another, itself)
        fused_cfgs = fixed

    # ---- fused epilogue vs cuBLAS + our separate elementwise kernel
    res["fused"] = []
    if part == "fc1":
        f = n // 2
        w_il = gemm_triton.interleave_gate_up(w)
        gate_ref, up_ref = ref[:, :f], ref[:, f:]
        sref = gate_ref * torch.sigmoid(gate_ref) * up_ref

        def separate():
            return fused.swiglu_(F.linear(x, w))
        res["separate"] = attempt("cublas + fused.swiglu_", separate, lambda: _err(separate(), sref))
        for cfg in fused_cfgs:
            res["fused"].append(attempt(f"swiglu {cfg.name}", lambda cfg=cfg: gemm_triton.linear_swiglu(x, w_il, cfg),
                                        lambda cfg=cfg: _err(gemm_triton.linear_swiglu(x, w_il, cfg), sref)))
    elif part in ("out", "fc2"):
        third = m // 3
        runs = [ModRun(0, third, 0), ModRun(third, 2 * third, 1), ModRun(2 * third, m - min(50, m // 8), 2)]
        stream0 = randn(m, n, scale=3.0)
        gate = randn(3, 6, n)[:, 2]  # rows of the adaLN table, as the block gets them
        idx = fused.row_index(runs, m, device)[:ref_rows].long()
        gref = stream0[:ref_rows].double() + ref * gate[idx.clamp(min=0)].double() * (idx >= 0)[:, None]

        def separate(stream):
            return fused.gated_residual_(stream, gate, F.linear(x, w), runs)

        def fused_call(stream, cfg):
            return gemm_triton.linear_gated_residual_(stream, x, w, gate, runs, cfg)

        s = stream0.clone()
        res["separate"] = attempt("cublas + fused.gated_residual_", lambda: separate(s),
                                  lambda: _err(separate(stream0.clone()), gref))
        for cfg in fused_cfgs:
            s = stream0.clone()
            res["fused"].append(attempt(f"residual {cfg.name}", lambda cfg=cfg, s=s: fused_call(s, cfg),
                                        lambda cfg=cfg: _err(fused_call(stream0.clone(), cfg), gref)))
        # rows outside every run must stay as they were
        if not compile_only and res["fused"] and "error" not in res["fused"][0]:
            tail = fused_call(stream0.clone(), fused_cfgs[0])[runs[-1].stop:]
            res["untouched_rows_equal"] = bool(torch.equal(tail, stream0[runs[-1].stop:]))
    elif part == "qkv":
        dim, eps = HEAD_DIM, 1e-6
        qw, kw = (1 + 0.2 * randn(dim).float()).to(torch.bfloat16), (1 + 0.2 * randn(dim).float()).to(torch.bfloat16)
        pos = torch.stack([torch.arange(m) // 1000, (torch.arange(m) // 40) % 25, torch.arange(m) % 40], 1).double()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(ROT_PAIRS // 3) / (ROT_PAIRS // 3)))
        table = rope.rotation_table(rope.rope_angles(pos, inv_freq.float()), torch.bfloat16).to(device)
        r = ref.view(1, ref_rows, 3 * heads, dim)
        tref = table[:, :ref_rows].double()
        qkref = torch.cat([rope.rms_norm_rope(r[:, :, :heads], qw.double(), tref, eps),
                           rope.rms_norm_rope(r[:, :, heads:2 * heads], kw.double(), tref, eps),
                           r[:, :, 2 * heads:]], dim=2).view(ref_rows, n)

        def separate():
            y = F.linear(x, w)
            q, kk, _ = y.view(1, m, 3 * heads, dim).split(heads, dim=2)
            fused.qk_norm_rope_(q, kk, qw, kw, table, eps)
            return y
        res["separate"] = attempt("cublas + fused.qk_norm_rope_", separate, lambda: _err(separate(), qkref))
        # paired: the qkv weight's q / k rows permuted once (at load, on the NVFP4 rows), not per call
        w_pair = w[gemm_triton.qk_pair_order(heads, dim, ROT_PAIRS, device)].contiguous()
        for cfg, paired in _qk_configs(Config, not cuda):
            wq = w_pair if paired else w

            def call(cfg=cfg, paired=paired, wq=wq):
                return gemm_triton.linear_qk_norm_rope(x, wq, qw, kw, table, eps, heads, cfg, paired=paired)
            res["fused"].append(attempt(f"qk-rope{'-paired' if paired else '-gather'} {cfg.name}", call,
                                        lambda call=call: _err(call(), qkref)))
    return res


def summary(rdir: Path) -> int:
    print("\n== Triton GEMM vs cuBLAS (M = 20,050, bf16; ms median; rel-L2 vs fp64 on 1024 rows)")
    totals: dict = {"plain": {}, "fused": {}}
    for part in SHAPES:
        p = rdir / f"{part}.json"
        if not p.is_file():
            print(f"  {part:4s} no result ({p.name} missing: see {part}.log)")
            continue
        r = json.loads(p.read_text())
        cb = r.get("cublas", {})
        cms = cb.get("ms", float("nan"))
        print(f"  {part:4s} N {r['n']:5d} K {r['k']:5d}  cuBLAS {cms:7.3f} ms {cb.get('tflops', float('nan')):6.1f} "
              f"TFLOP/s err {cb.get('rel_l2', float('nan')):.2e}")
        for c in r.get("configs", []):
            if "error" in c:
                print(f"       {c['name']:34s} ERROR {c['error'][:100]}")
            else:
                print(f"       {c['name']:34s} {c['ms']:7.3f} ms {c['tflops']:6.1f} TFLOP/s  x{cms / c['ms']:.3f} of "
                      f"cuBLAS speed  err {c.get('rel_l2', float('nan')):.2e}"
                      f" {'ok' if c.get('ok') else 'BAD'}")
        best = next((c for c in r.get("configs", []) if c["name"] == r.get("best")), None)
        if best:
            print(f"    best {best['name']}: {best['ms']:.3f} ms = {cms / best['ms']:.3f}x cuBLAS speed")
        sep = r.get("separate")
        if sep:
            sms = sep.get("ms", float("nan"))
            print(f"    separate  {sep['name']:34s} {sms:7.3f} ms  err {sep.get('rel_l2', float('nan')):.2e} "
                  f"(one rounding {sep.get('one_rounding', float('nan')):.2e})" if "error" not in sep
                  else f"    separate ERROR {sep['error'][:100]}")
            for f in r.get("fused", []):
                if "error" in f:
                    print(f"    fused     {f['name']:34s} ERROR {f['error'][:100]}")
                else:
                    print(f"    fused     {f['name']:34s} {f['ms']:7.3f} ms  {f['ms'] - sms:+.3f} ms/call vs separate "
                          f"(x50 blocks: {50 * (f['ms'] - sms):+.1f} ms/step)  err {f.get('rel_l2', float('nan')):.2e}"
                          f" {'ok' if f.get('ok') else 'BAD'}")
        if "untouched_rows_equal" in r:
            print(f"    rows outside every run untouched: {r['untouched_rows_equal']}")
        if best and cms == cms:
            totals["plain"][part] = best["ms"] - cms
        good = [f for f in r.get("fused", []) if "error" not in f and f.get("ok")]
        if sep and "error" not in sep and good:
            totals["fused"][part] = min(f["ms"] for f in good) - sep["ms"]
    # per DiT step: each shape runs once per block, 50 blocks
    for kind, what in (("plain", "best plain Triton GEMM - cuBLAS"),
                       ("fused", "best correct fused GEMM+epilogue - (cuBLAS + fused.py kernel)")):
        t = totals[kind]
        if t:
            per = ", ".join(f"{p} {50 * v:+.1f}" for p, v in t.items())
            print(f"  per step (x50 blocks), {what}: {50 * sum(t.values()):+.1f} ms  ({per}; negative = faster)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=list(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=None, help=f"M (default {ROWS}; 70 on the CPU)")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--summary", default=None, help="print the table from the part JSONs in this directory")
    args = p.parse_args(argv)
    if args.summary:
        return summary(Path(args.summary))
    if not args.part:
        p.error("--part or --summary is required")
    if not args.device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("tgemm_bench: no CUDA device", file=sys.stderr)
        return 2
    from h3direct.dit import fused
    if fused.triton is None:
        print("tgemm_bench: Triton is not importable", file=sys.stderr)
        return 2
    rows = args.rows or (ROWS if args.device.startswith("cuda") else 70)
    res = run_part(args.part, args.device, args.compile_only, rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
