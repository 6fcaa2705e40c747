"""Check + timing of the fused kernels (`h3direct/dit/fused.py`) at the DiT's full shape, against the eager ops and
an fp64 reference of the same math.

    python3 benchmarks/check_fused.py [--device cuda] [--rows 20050] [--hidden 5376] [--ffn 14336] [--out R.json]

Verdicts (exit 1 if one fails):
- swiglu_ (in place on fc1's gate half): bitwise equal to eager `silu(gate)·up` (bf16 and fp32);
- norm_modulate / gated_residual_: within one bf16 rounding of the fp64 reference (≤ 1.05× the error of rounding
  the reference itself) and closer to it than the eager ops (which round three / two times);
- fc2 reading the strided SwiGLU view: bitwise equal to reading a dense copy, and no hidden copy of the input
  (peak memory of the call ≈ its output + cuBLAS workspace);
- fa3 with v a strided view of the qkv output (the block no longer copies v): bitwise equal to a dense v;
- residual_norm_modulate_ (gated residual + norm + modulation in one pass): bitwise gated_residual_ then
  norm_modulate (x and h), within one bf16 rounding of fp64;
- qk_norm_rope_ (q/k RMSNorm + rope in place): within one bf16 rounding of fp64 and closer than eager (comfy-kitchen's
  kernel timed and measured beside it when installed).
CUDA only for the timings and the memory check; on the CPU (TRITON_INTERPRET=1, small --rows) it is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rel(a, ref) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    from h3direct.dit import blocks, fused
    from h3direct.dit.timesteps import ModRun

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=20050)
    p.add_argument("--hidden", type=int, default=5376)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    if fused.triton is None:
        print("check_fused: Triton is not importable here", file=sys.stderr)
        return 2
    dev, s, d = args.device, args.rows, args.hidden
    cuda = dev.startswith("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    res: dict = {"rows": s, "hidden": d, "ffn": args.ffn, "device": torch.cuda.get_device_name() if cuda else dev}
    ok = True

    def bench(fn, n=20):
        if not cuda:
            return float("nan")
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    # the workload's runs: 256 text rows (adaLN row 0), conditioning (1), target video (2); the last 50 rows
    # outside every run to cover that case too
    c1, c2 = min(256, s // 4), min(1180, s // 2)
    n_out = min(50, s // 8)
    runs = [ModRun(0, c1, 0), ModRun(c1, c2, 1), ModRun(c2, s - n_out, 2)]
    x = (torch.randn(s, d, generator=g) * 3).to(dev, torch.bfloat16)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dev, torch.bfloat16)
    table = torch.randn(3, 6, d, generator=g).to(dev)  # fp32 (curve adaLN), rows of the adaLN table
    shift, scale, gate = table[:, 0], 0.2 * table[:, 1], table[:, 2]

    # ---- norm + modulation
    ref = F.rms_norm(x.double(), (d,), w.double(), 1e-6)
    for r in runs:
        ref[r.start:r.stop] = ref[r.start:r.stop] * (1 + scale[r.row].double()) + shift[r.row].double()
    ours = fused.norm_modulate(x, w, 1e-6, shift, scale, runs)
    eager = blocks.modulate_(F.rms_norm(x, (d,), w, 1e-6), shift, scale, runs)
    nm = {"fused_vs_fp64": _rel(ours, ref), "eager_vs_fp64": _rel(eager, ref), "one_rounding": _rel(ref.bfloat16(), ref),
          "fused_ms": bench(lambda: fused.norm_modulate(x, w, 1e-6, shift, scale, runs)),
          "eager_ms": bench(lambda: blocks.modulate_(F.rms_norm(x, (d,), w, 1e-6), shift, scale, runs))}
    nm["ok"] = nm["fused_vs_fp64"] <= 1.05 * nm["one_rounding"] and nm["fused_vs_fp64"] < nm["eager_vs_fp64"]
    res["norm_modulate"] = nm
    del ref, ours, eager

    # ---- gated residual
    upd = torch.randn(s, d, generator=g).to(dev, torch.bfloat16)
    want = x.double()
    for r in runs:
        want[r.start:r.stop] += upd[r.start:r.stop].double() * gate[r.row].double()
    ours = fused.gated_residual_(x.clone(), gate, upd, runs)
    eager = blocks.gated_residual_(x.clone(), gate, upd, runs)
    xx = x.clone()
    gr = {"fused_vs_fp64": _rel(ours, want), "eager_vs_fp64": _rel(eager, want),
          "one_rounding": _rel(want.bfloat16(), want), "outside_rows_untouched": bool(torch.equal(ours[-n_out:], x[-n_out:])),
          "fused_ms": bench(lambda: fused.gated_residual_(xx, gate, upd, runs)),
          "eager_ms": bench(lambda: blocks.gated_residual_(xx, gate, upd, runs))}
    gr["ok"] = (gr["fused_vs_fp64"] <= 1.05 * gr["one_rounding"] and gr["fused_vs_fp64"] <= gr["eager_vs_fp64"]
                and gr["outside_rows_untouched"])
    res["gated_residual"] = gr

    # ---- the attention's gated residual + norm2 + modulation in one kernel: bitwise the two kernels in turn
    xa, xb = x.clone(), x.clone()
    two_h = fused.norm_modulate(fused.gated_residual_(xa, gate, upd, runs), w, 1e-6, shift, scale, runs)
    one_h = fused.residual_norm_modulate_(xb, gate, upd, w, 1e-6, shift, scale, runs)
    ref = F.rms_norm(xa.double(), (d,), w.double(), 1e-6)
    for r in runs:
        ref[r.start:r.stop] = ref[r.start:r.stop] * (1 + scale[r.row].double()) + shift[r.row].double()
    rn = {"bitwise_vs_two_kernels": bool(torch.equal(xa, xb) and torch.equal(two_h, one_h)),
          "fused_vs_fp64": _rel(one_h, ref), "one_rounding": _rel(ref.bfloat16(), ref),
          "fused_ms": bench(lambda: fused.residual_norm_modulate_(xb, gate, upd, w, 1e-6, shift, scale, runs)),
          "two_kernels_ms": bench(lambda: fused.norm_modulate(fused.gated_residual_(xa, gate, upd, runs), w, 1e-6,
                                                              shift, scale, runs))}
    rn["ok"] = rn["bitwise_vs_two_kernels"] and rn["fused_vs_fp64"] <= 1.05 * rn["one_rounding"]
    res["residual_norm_modulate"] = rn
    del two_h, one_h, ref

    # ---- SwiGLU in place
    sw = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = (torch.randn(s, 2 * args.ffn, generator=g) * 4).to(dev, dtype)
        gg, uu = a.chunk(2, dim=-1)
        want = F.silu(gg).mul(uu)
        got = fused.swiglu_(a)
        sw[str(dtype).removeprefix("torch.")] = {"bitwise": bool(torch.equal(got, want)),
                                                 "differ": int((got != want).sum())}
        del a, gg, uu, want, got
    a = torch.randn(s, 2 * args.ffn, device=dev, dtype=torch.bfloat16)

    def eager_swiglu():
        gg, uu = a.chunk(2, dim=-1)
        return F.silu(gg).mul_(uu)

    sw["eager_ms"] = bench(eager_swiglu)
    sw["fused_ms"] = bench(lambda: fused.swiglu_(a))
    sw["ok"] = all(v["bitwise"] for k, v in sw.items() if isinstance(v, dict)) or not cuda
    res["swiglu"] = sw

    # ---- fc2 on the strided SwiGLU view: same numbers as on a dense copy, no hidden copy
    view = a[:, :args.ffn]
    w2 = (torch.randn(d, args.ffn, generator=g) * 0.02).to(dev, torch.bfloat16)
    dense = F.linear(view.contiguous(), w2)
    lin = {"bitwise_vs_dense_input": None, "extra_mib": None}
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        strided = F.linear(view, w2)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before - strided.numel() * strided.element_size()
        lin["extra_mib"] = round(extra / 2**20, 1)
        lin["input_mib"] = round(view.numel() * 2 / 2**20, 1)
        lin["strided_ms"] = bench(lambda: F.linear(view, w2), n=5)
        lin["dense_ms"] = bench(lambda: F.linear(view.contiguous(), w2), n=5)
    else:
        strided = F.linear(view, w2)
    lin["bitwise_vs_dense_input"] = bool(torch.equal(strided, dense))
    lin["ok"] = lin["bitwise_vs_dense_input"] and (lin["extra_mib"] is None or lin["extra_mib"] < lin["input_mib"] / 2)
    res["fc2_strided_input"] = lin

    # ---- fa3 with the strided v of the qkv output
    from h3direct.dit.attention import attention, unavailable_reason

    heads, hd = args.heads, 128
    qkv = torch.randn(s, 3 * heads * hd, generator=g).to(dev, torch.bfloat16)
    reason = unavailable_reason("fa3", qkv)
    if reason is None:
        q, k, v = (t.view(s, heads, hd).permute(1, 0, 2)[None] for t in qkv.chunk(3, dim=-1))
        o_strided = attention(q, k, v, "fa3")
        o_dense = attention(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), "fa3")
        res["fa3_strided_v"] = {"bitwise": bool(torch.equal(o_strided, o_dense)),
                                "strided_ms": bench(lambda: attention(q, k, v, "fa3"), n=5),
                                "with_copy_ms": bench(lambda: attention(q, k, v.transpose(1, 2).contiguous()
                                                                        .transpose(1, 2), "fa3"), n=5)}
        res["fa3_strided_v"]["ok"] = res["fa3_strided_v"]["bitwise"]
    else:
        res["fa3_strided_v"] = {"skipped": reason, "ok": True}

    # ---- q/k RMSNorm + 3-axis rope in place on the qkv output (the real table: 48 pairs, 96 of 128 dims rotate)
    from h3direct.checkpoint.quant.kitchen import kitchen_op
    from h3direct.dit.rope import rms_norm_rope, rope_angles, rotation_table

    pos = torch.stack([torch.arange(s) // 600, torch.arange(s) // 30 % 20, torch.arange(s) % 30], -1).double()
    table = rotation_table(rope_angles(pos, 1.0 / 10000 ** (torch.arange(16) / 16)).to(dev), torch.bfloat16)
    wq, wk = ((1 + 0.3 * torch.randn(hd, generator=g)).to(dev, torch.bfloat16) for _ in range(2))
    q, k, _ = (t.view(1, s, heads, hd) for t in qkv.chunk(3, dim=-1))
    ref = rms_norm_rope(q.double(), wq.double(), table.double(), 1e-6)
    eager = rms_norm_rope(q, wq, table, 1e-6)
    buf = qkv.clone()
    bq, bk, _ = (t.view(1, s, heads, hd) for t in buf.chunk(3, dim=-1))
    fused.qk_norm_rope_(bq, bk, wq, wk, table, 1e-6)
    qr = {"fused_vs_fp64": _rel(bq, ref), "eager_vs_fp64": _rel(eager, ref), "one_rounding": _rel(ref.bfloat16(), ref),
          "fused_ms": bench(lambda: fused.qk_norm_rope_(bq, bk, wq, wk, table, 1e-6), n=5)}
    ck = kitchen_op("rms_rope_split_half_") if cuda else None
    if ck is not None:
        buf2 = qkv.clone()
        cq, ckk, _ = (t.view(1, s, heads, hd) for t in buf2.chunk(3, dim=-1))
        ck(cq, ckk, table, wq, wk, epsilon=1e-6, rot_dim=2 * table.shape[-3])
        qr["kitchen_vs_fp64"] = _rel(cq, ref)
        qr["kitchen_ms"] = bench(lambda: ck(cq, ckk, table, wq, wk, epsilon=1e-6, rot_dim=2 * table.shape[-3]), n=5)
    qr["ok"] = qr["fused_vs_fp64"] <= 1.05 * qr["one_rounding"] and qr["fused_vs_fp64"] < qr["eager_vs_fp64"]
    res["qk_norm_rope"] = qr

    for name in ("norm_modulate", "gated_residual", "residual_norm_modulate", "swiglu", "fc2_strided_input",
                 "fa3_strided_v", "qk_norm_rope"):
        r = res[name]
        ok &= bool(r["ok"])
        print(f"  {name:18s} {'ok  ' if r['ok'] else 'FAIL'} " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "ok"))
    res["ok"] = bool(ok)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print("fused kernels:", "all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
