"""Launch-config sweep of the fused elementwise kernels (`h3direct/dit/fused.py`) at the DiT's full shape.

    python3 benchmarks/elem_sweep.py [--device cuda] [--rows 20050] [--hidden 5376] [--ffn 14336] [--heads 56]
                                     [--kernels norm_modulate,swiglu,...] [--iters 30] [--out R.json]

For each kernel, every candidate of `fused.SWEEP[kernel]` (and the table's own `LAUNCH` entry) is run on a fresh copy
of the same inputs and timed (CUDA events, median of --iters calls). Printed per kernel: ms and GB/s of each config,
the best, its fraction of the roofline (bytes moved / the copy bandwidth measured here, and / the H200's 4.8 TB/s),
and whether every config gave the same bits (exit 1 if not). Then "old vs new": the kernels as the block called them
before (one q and one k launch for the rope, gated residual and norm2 + modulation as two kernels, the old launch
configs) against the best configs, and the per-step total of these kernels (50 blocks: x50 / x100 calls).
Also bitwise: the fused residual + norm kernel vs gated_residual_ then norm_modulate, at the full shape.
On the CPU (TRITON_INTERPRET=1, small --rows / --hidden / --ffn) it is a smoke run of the same code (no timings).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

SPEC_TBPS = 4.8  # H200 HBM3e, the data sheet's number
# the launch configs this branch started from (what the block ran before: fp32 sums), for "old vs new"
OLD = {"norm_modulate": {"ROWS": 1, "EXACT": False, "num_warps": 8},
       "gated_residual": {"ROWS": 1, "BLOCK": 2048, "num_warps": 4},
       "swiglu": {"ROWS": 1, "BLOCK": 1024, "num_warps": 4}, "qk_norm_rope": {"HB": 8, "EXACT": False, "num_warps": 4}}


# ms per call at this shape before this branch (benchmarks/results/h200-2026-12-01-session2.md, check_fused.py): fp32
# sums, one launch each for q and k; the per-step profile then: rope 27, SwiGLU 26, norm+mod 17.5, residuals ~16 ms
PREVIOUS = {"norm_modulate": 0.153, "gated_residual": 0.157, "swiglu": 0.547, "qk_norm_rope": 0.465}


def main(argv=None) -> int:
    import torch

    from h3direct.dit import fused
    from h3direct.dit.rope import rope_angles, rotation_table
    from h3direct.dit.timesteps import ModRun

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=20050)
    p.add_argument("--hidden", type=int, default=5376)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernels", default=",".join(fused.SWEEP), help="comma-separated subset of " + ",".join(fused.SWEEP))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    if fused.triton is None:
        print("elem_sweep: Triton is not importable here", file=sys.stderr)
        return 2
    kernels = [k for k in args.kernels.split(",") if k]
    bad = [k for k in kernels if k not in fused.SWEEP]
    if bad:
        print(f"elem_sweep: unknown kernel(s) {bad}; known: {list(fused.SWEEP)}", file=sys.stderr)
        return 2
    dev, s, d, f, heads, hd = args.device, args.rows, args.hidden, args.ffn, args.heads, args.head_dim
    cuda = dev.startswith("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    gd = torch.Generator(device=dev).manual_seed(1)  # the big activations are drawn on the device (seconds on a CPU)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gd, device=dev) * scale).to(bf)

    def timed(fn) -> float:
        if not cuda:
            fn()
            return float("nan")
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    res: dict = {"rows": s, "hidden": d, "ffn": f, "heads": heads, "head_dim": hd,
                 "device": torch.cuda.get_device_name() if cuda else dev, "kernels": {}}
    copy_gbps = float("nan")
    if cuda:  # the practical roofline: a device-to-device copy of 1 GiB (read + write)
        src = torch.empty(2**29, dtype=bf, device=dev)
        dst = torch.empty_like(src)
        ms = timed(lambda: dst.copy_(src))
        copy_gbps = 2 * src.numel() * 2 / ms / 1e6
        del src, dst
    res["copy_gbps"] = copy_gbps
    print(f"device {res['device']}: copy bandwidth {copy_gbps:.0f} GB/s (roofline here), spec {SPEC_TBPS} TB/s")

    # the workload's adaLN runs (text, conditioning, target video), all rows covered as in the DiT
    c1, c2 = min(256, s // 4), min(1180, s // 2)
    runs = [ModRun(0, c1, 0), ModRun(c1, c2, 1), ModRun(c2, s, 2)]
    table = torch.randn(3, 6, d, generator=g).to(dev)  # fp32 adaLN rows (curve), row stride 6·d
    shift, scale, gate = table[:, 0], 0.2 * table[:, 1], table[:, 2]
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, bf)
    x0 = rnd(s, d, scale=3)
    upd = rnd(s, d, scale=2)
    esz = 2
    pos = torch.stack([torch.arange(s) // 600, torch.arange(s) // 30 % 20, torch.arange(s) % 30], -1).double()
    n_freq = hd // 8  # 3 axes x 16 pairs = 96 of 128 dims rotate, as in H3
    rope_table = rotation_table(rope_angles(pos, 1.0 / 10000 ** (torch.arange(n_freq) / n_freq)).to(dev), bf)
    wq, wk = ((1 + 0.3 * torch.randn(hd, generator=g)).to(dev, bf) for _ in range(2))

    # per kernel: (make fresh inputs, run with a config on them -> output tensors, bytes moved per call)
    def nm_inputs():
        return {"x": x0}

    def nm_run(t, cfg):
        return (fused.norm_modulate(t["x"], w, 1e-6, shift, scale, runs, config=cfg),)

    def rn_inputs():
        return {"x": x0.clone()}

    def rn_run(t, cfg):
        h = fused.residual_norm_modulate_(t["x"], gate, upd, w, 1e-6, shift, scale, runs, config=cfg)
        return t["x"], h

    def gr_inputs():
        return {"x": x0.clone()}

    def gr_run(t, cfg):
        return (fused.gated_residual_(t["x"], gate, upd, runs, config=cfg),)

    a0 = rnd(s, 2 * f, scale=4) if "swiglu" in kernels else None

    def sw_inputs():
        return {"a": a0.clone()}

    def sw_run(t, cfg):
        return (fused.swiglu_(t["a"], config=cfg),)

    qkv0 = rnd(s, 3 * heads * hd, scale=2) if "qk_norm_rope" in kernels else None

    def qk_inputs():
        return {"qkv": qkv0.clone()}

    def qk_run(t, cfg):
        q, k, _ = (part.view(1, s, heads, hd) for part in t["qkv"].chunk(3, dim=-1))
        fused.qk_norm_rope_(q, k, wq, wk, rope_table, 1e-6, config=cfg)
        return (t["qkv"],)

    spec = {"norm_modulate": (nm_inputs, nm_run, 2 * s * d * esz),
            "residual_norm_modulate": (rn_inputs, rn_run, 4 * s * d * esz),
            "gated_residual": (gr_inputs, gr_run, 3 * s * d * esz),
            "swiglu": (sw_inputs, sw_run, 3 * s * f * esz),
            "qk_norm_rope": (qk_inputs, qk_run, 2 * 2 * s * heads * hd * esz)}

    ok = True
    best: dict = {}
    launch = fused.launch_table(torch.device(dev))  # the table this device runs with
    for name in kernels:
        make, run, nbytes = spec[name]
        cands, seen = [], set()
        for cfg in [launch[name], *fused.SWEEP[name]]:
            cfg = fused.launch_config(name, cfg, torch.device(dev))  # the table's entries filled in (EXACT)
            key = tuple(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                cands.append(cfg)
        rows, ref = [], None
        t0 = time.perf_counter()
        for cfg in cands:
            try:
                t = make()
                outs = [o.clone() for o in run(t, cfg)]
                same = True if ref is None else all(C.same_bits(a, b) for a, b in zip(outs, ref, strict=True))
                if ref is None:
                    ref = outs
                t = make()
                ms = timed(lambda t=t, cfg=cfg, run=run: run(t, cfg))
                err = None
            except Exception as exc:  # one config that fails to compile / launch is reported, not fatal
                ms, same, err = float("nan"), None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            gbps = nbytes / ms / 1e6 if ms == ms else float("nan")
            rows.append({"config": cfg, "ms": ms, "gbps": gbps, "same_bits": same, "error": err})
            del t
        good = [r for r in rows if r["error"] is None]  # (on the CPU every ms is nan: the table's entry then)
        b = min(good, key=lambda r: (r["ms"] != r["ms"], r["ms"])) if good else None
        bitwise = all(r["same_bits"] for r in rows if r["error"] is None)
        ok &= bitwise and not any(r["error"] for r in rows)
        entry = {"bytes": nbytes, "configs": rows, "bitwise_across_configs": bitwise, "sweep_s": time.perf_counter() - t0,
                 "table": launch[name]}
        if b is not None:
            entry |= {"best": b["config"], "best_ms": b["ms"], "best_gbps": b["gbps"],
                      "roofline_ms": nbytes / copy_gbps / 1e6, "frac_of_copy": b["gbps"] / copy_gbps,
                      "frac_of_spec": b["gbps"] / (SPEC_TBPS * 1e3),
                      "table_ms": next(r["ms"] for r in rows if r["config"] == launch[name])}
            best[name] = b["config"]
        res["kernels"][name] = entry
        print(f"\n== {name}: {len(rows)} configs, {nbytes / 1e9:.3f} GB per call, same bits across configs: {bitwise}")
        for r in sorted(rows, key=lambda r: (r["ms"] != r["ms"], r["ms"])):
            tag = " <- best" if r is b else (" <- table" if r["config"] == launch[name] else "")
            print(f"  {json.dumps(r['config']):55s} {r['ms']:7.4f} ms {r['gbps']:7.0f} GB/s"
                  f"{'' if r['same_bits'] in (True, None) else '  DIFFERENT BITS'}"
                  f"{'  ' + r['error'] if r['error'] else ''}{tag}")
        if b is not None and "EXACT" in launch[name]:  # what the exact (config-free) sum costs
            try:
                t = make()
                entry["best_fp32_sum_ms"] = timed(lambda t=t, run=run, cfg=b["config"] | {"EXACT": False}: run(t, cfg))
                del t
            except Exception as exc:
                entry["best_fp32_sum_ms"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(f"  the best config with an fp32 sum instead of the exact one (config-dependent bits): "
                  f"{entry['best_fp32_sum_ms']} ms")
        if name in PREVIOUS:
            print(f"  before this branch (session 2, check_fused.py, same shape): {PREVIOUS[name]} ms")
        if b is not None:
            print(f"  best {json.dumps(b['config'])}: {b['ms']:.4f} ms, {b['gbps']:.0f} GB/s = "
                  f"{entry['frac_of_copy']:.2f} of copy bandwidth, {entry['frac_of_spec']:.2f} of {SPEC_TBPS} TB/s "
                  f"(roofline {entry['roofline_ms']:.4f} ms)")

    # ---- the fused residual + norm vs the two kernels, bitwise, at the full shape
    xa, xb = x0.clone(), x0.clone()
    h_two = fused.norm_modulate(fused.gated_residual_(xa, gate, upd, runs), w, 1e-6, shift, scale, runs)
    h_one = fused.residual_norm_modulate_(xb, gate, upd, w, 1e-6, shift, scale, runs)
    res["residual_norm_bitwise"] = bool(C.same_bits(xa, xb) and C.same_bits(h_two, h_one))
    ok &= res["residual_norm_bitwise"]
    print(f"\nresidual+norm2+modulation one kernel == gated_residual_ then norm_modulate (x and h): "
          f"{res['residual_norm_bitwise']}")
    del xa, xb, h_two, h_one

    # ---- old vs new, and the per-step total (50 blocks)
    if all(k in best for k in fused.SWEEP):  # (on the CPU: the same code once per kernel, no timings)
        old, new = {}, {}
        t = nm_inputs()
        old["norm_modulate"] = timed(lambda: fused.norm_modulate(t["x"], w, 1e-6, shift, scale, runs,
                                                                 config=OLD["norm_modulate"]))
        new["norm_modulate"] = res["kernels"]["norm_modulate"]["best_ms"]
        t = gr_inputs()
        old["gated_residual"] = timed(lambda: fused.gated_residual_(t["x"], gate, upd, runs,
                                                                    config=OLD["gated_residual"]))
        new["gated_residual"] = res["kernels"]["gated_residual"]["best_ms"]
        new["residual_norm_modulate"] = res["kernels"]["residual_norm_modulate"]["best_ms"]
        t = sw_inputs()
        old["swiglu"] = timed(lambda: fused.swiglu_(t["a"], config=OLD["swiglu"]))
        new["swiglu"] = res["kernels"]["swiglu"]["best_ms"]
        del t
        qa = qkv0.clone()  # before: q and k one launch each (k in its own buffer here, so no joint launch)
        q = qa[:, :heads * hd].view(1, s, heads, hd)
        k = qkv0[:, heads * hd:2 * heads * hd].clone().view(1, s, heads, hd)
        old["qk_norm_rope"] = timed(lambda: fused.qk_norm_rope_(q, k, wq, wk, rope_table, 1e-6,
                                                                config=OLD["qk_norm_rope"]))
        new["qk_norm_rope"] = res["kernels"]["qk_norm_rope"]["best_ms"]
        del qa, q, k
        step_old = 50 * (old["qk_norm_rope"] + old["swiglu"]) + 100 * (old["norm_modulate"] + old["gated_residual"])
        step_new = 50 * (new["qk_norm_rope"] + new["swiglu"] + new["norm_modulate"] + new["gated_residual"]
                         + new["residual_norm_modulate"])
        res["old_ms"], res["new_ms"] = old, new
        res["step_ms_old"], res["step_ms_new"] = step_old, step_new
        print("\n== old (the configs before: fp32 sums, q and k two launches, residual and norm2 two kernels) vs new")
        for k_ in ("qk_norm_rope", "swiglu", "norm_modulate", "gated_residual", "residual_norm_modulate"):
            print(f"  {k_:24s} old {old.get(k_, float('nan')):7.4f} ms   new {new[k_]:7.4f} ms")
        print(f"  per step (50 blocks): old {step_old:.1f} ms (rope x50, swiglu x50, norm x100, residual x100)  "
              f"new {step_new:.1f} ms (rope, swiglu, norm1, MLP residual, residual+norm2: x50 each)  "
              f"saves {step_old - step_new:.1f} ms")
    res["best"] = best
    res["ok"] = bool(ok)
    print("\nbest configs (an entry of fused.LAUNCH for this compute capability):")
    for k_, cfg in best.items():
        print(f"    {k_!r}: {cfg!r},")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print("elem_sweep:", "all bitwise checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
