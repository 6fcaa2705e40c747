"""The `fa3_fp8` attention backend on an sm_90 GPU against its torch emulation, and what it costs.

    python3 benchmarks/check_fa3fp8.py --out check.json          # on the H200 (benchmarks/gpu_fa3fp8.sh)
    python3 benchmarks/check_fa3fp8.py --seq 2048 --heads 8      # a cut of the sequence (quicker)
    python3 benchmarks/check_fa3fp8.py --device cpu --seq 256 --heads 2 --iters 1   # smoke test of this script:
        # the emulation stands in for FA3 and SDPA for fa3 bf16 (the numbers then say nothing about the kernel)

Parts (each its own try: one failure is a row, not the end):
- quantizer: the Triton pass vs `quantize_torch`, bitwise, on the DiT's layout (q, k strided views of the qkv
  projection output, v dense) at the benchmark shape, and the time of each piece;
- heads: FA3's FP8 kernel vs `fp8_attention_reference` at head_dim 32 / 64 / 128, batch 2 (different scales per
  batch), inputs with per-head gains and a key channel offset: rel-L2 kernel vs emulation, each vs fp32;
- full: [1, 56, S, 128] structured and random inputs (benchmarks/attention_kernels.py): rel-L2 vs fp32 of the
  variants (one scale per tensor, per-head, + K smoothing, + V smoothing), kernel vs emulation on every 16th query,
  ms per call of fa3 (bf16), each variant, the FP8 kernel alone and the quantization alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # name -> fa3_fp8_attention / fp8_attention_reference keyword arguments
    "per_tensor": dict(per_head=False, smooth_k=False, smooth_v=False),
    "per_head": dict(smooth_k=False, smooth_v=False),
    "per_head+k": dict(smooth_v=False),
    "per_head+k+v": dict(smooth_v=True),  # the default (H3_FP8_ATTN_SMOOTH_V=1)
}


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def dit_layout(q, k, v):
    """q, k, v [1, H, S, D] -> the same values laid out as the DiT passes them: q, k strided views of one
    [S, 3·H·D] projection output, v a dense [S, H, D] copy (all seen as [1, H, S, D])."""
    import torch

    _, h, s, d = q.shape
    buf = torch.empty(s, 3, h, d, dtype=q.dtype, device=q.device)
    for i, x in enumerate((q, k, v)):
        buf[:, i] = x[0].transpose(0, 1)
    qv, kv = buf[:, 0].transpose(0, 1)[None], buf[:, 1].transpose(0, 1)[None]
    vv = buf[:, 2].contiguous().transpose(0, 1)[None]
    return qv, kv, vv


def part_quantizer(sets, args, out):
    import torch

    from benchmarks.attention_kernels import time_ms
    from h3direct.dit import fp8_attention as F8

    q, k, v = dit_layout(*sets["structured"])
    dev = q.device
    res = {"strides_q": list(q.stride()), "strides_v": list(v.stride())}
    for name, x, center in (("q", q, False), ("k", k, True), ("v", v, True)):
        mean, amax = F8.channel_stats(x, center)
        _, inv = F8.scales(amax)
        a = F8.quantize_torch(x, mean, inv).view(torch.uint8)
        b = F8.quantize_triton(x, mean, inv).view(torch.uint8)
        res[f"mismatch_{name}"] = int((a != b).sum())
        res[f"ms_stats_{name}"] = time_ms(lambda x=x, c=center: F8.channel_stats(x, c), args.iters, dev)
        res[f"ms_triton_{name}"] = time_ms(lambda x=x, m=mean, i=inv: F8.quantize_triton(x, m, i), args.iters, dev)
    res["ms_quantize_qkv"] = time_ms(lambda: F8.quantize_qkv(q, k, v), args.iters, dev)
    out["quantizer"] = res
    print(f"quantizer: Triton vs torch mismatches q/k/v {res['mismatch_q']}/{res['mismatch_k']}/{res['mismatch_v']}; "
          f"quantize_qkv {res['ms_quantize_qkv']:.3f} ms (stats q {res['ms_stats_q']:.3f}, triton q "
          f"{res['ms_triton_q']:.3f} ms)", flush=True)


def part_heads(args, out):
    import torch
    import torch.nn.functional as F

    from h3direct.dit import fp8_attention as F8

    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(5)
    rows = []
    for d in (32, 64, 128):
        h, s = 4, 1536
        q, k, v = (torch.randn(2, h, s, d, generator=g) for _ in range(3))
        gain = torch.tensor([0.5, 1.0, 1.5, 2.0]).view(1, h, 1, 1)
        q = q * gain
        k = k * gain + 3.0 * torch.randn(1, h, 1, d, generator=g)  # a common key offset per head
        v = v + 1.0
        q[1], k[1], v[1] = q[1] * 0.05, k[1] * 20, v[1] * 40  # batch 1: other scales (descale indexing)
        q, k, v = (x.to(dev, torch.bfloat16) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for name, kw in VARIANTS.items():
            row = {"head_dim": d, "variant": name}
            try:
                ker = F8.fa3_fp8_attention(q, k, v, **kw)
                emu = F8.fp8_attention_reference(q, k, v, **kw)
                emu0 = F8.fp8_attention_reference(q, k, v, p_offset_log2=0.0, **kw)  # probabilities in [0, 1]
                row.update(kernel_vs_emulation=rel(ker, emu), kernel_vs_emulation_p_offset_0=rel(ker, emu0),
                           kernel_vs_fp32=rel(ker, ref),
                           emulation_vs_fp32=rel(emu, ref), batch1_kernel_vs_fp32=rel(ker[1], ref[1]),
                           finite=bool(torch.isfinite(ker).all()))
            except Exception as exc:  # noqa: BLE001 - e.g. a head_dim the kernel refuses: a row
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            print("heads " + (f"D={d:3d} {name:13s} kernel vs emulation {row['kernel_vs_emulation']:.2e} (P offset 0: "
                              f"{row['kernel_vs_emulation_p_offset_0']:.2e})  kernel vs "
                              f"fp32 {row['kernel_vs_fp32']:.2e}  emulation vs fp32 {row['emulation_vs_fp32']:.2e}"
                              if "error" not in row else f"D={d} {name}: {row['error']}"), flush=True)
    out["heads"] = rows


def part_full(sets, refs, args, out):
    import torch

    from benchmarks.attention_kernels import time_ms
    from h3direct.dit import attention as A
    from h3direct.dit import fp8_attention as F8

    res = {}
    dev = torch.device(args.device)
    for set_name, (q, k, v) in sets.items():
        for name, kw in VARIANTS.items():
            o = F8.fa3_fp8_attention(q, k, v, **kw)
            res[f"rel_l2_{set_name}_{name}"] = rel(o, refs[set_name])
        res[f"rel_l2_{set_name}_fa3_bf16"] = rel(A._fa3(q, k, v), refs[set_name])
    q, k, v = sets["structured"]
    sub = slice(0, None, 16)
    for name in ("per_tensor", "per_head+k+v"):
        kw = VARIANTS[name]
        ker = F8.fa3_fp8_attention(q, k, v, **kw)[:, :, sub]
        emu = F8.fp8_attention_reference(q, k, v, rows=sub, q_chunk=512, **kw)
        res[f"structured_{name}_kernel_vs_emulation"] = rel(ker, emu)
        res[f"structured_{name}_emulation_vs_fp32"] = rel(emu, refs["structured"][:, :, sub])
        del ker, emu
        torch.cuda.empty_cache()
    qd, kd, vd = dit_layout(q, k, v)
    res["ms_fa3_bf16"] = time_ms(lambda: A._fa3(qd, kd, vd), args.iters, dev)
    for name, kw in VARIANTS.items():
        res[f"ms_{name}"] = time_ms(lambda kw=kw: F8.fa3_fp8_attention(qd, kd, vd, **kw), args.iters, dev)
    qq, kq, vq = F8.quantize_qkv(qd, kd, vd, smooth_v=False)
    res["ms_fp8_kernel_only"] = time_ms(lambda: F8.fa3_fp8_call(qq, kq, vq, q.shape[-1]), args.iters, dev)
    res["ms_quantize_only"] = time_ms(lambda: F8.quantize_qkv(qd, kd, vd), args.iters, dev)
    out["full"] = res
    for set_name in sets:
        print(f"full {set_name}: rel-L2 vs fp32 " + ", ".join(
            f"{n} {res[f'rel_l2_{set_name}_{n}']:.2e}" for n in [*VARIANTS, "fa3_bf16"]), flush=True)
    print("full structured kernel vs emulation (every 16th query): " + ", ".join(
        f"{n} {res[f'structured_{n}_kernel_vs_emulation']:.2e} (emulation vs fp32 "
        f"{res[f'structured_{n}_emulation_vs_fp32']:.2e})" for n in ("per_tensor", "per_head+k+v")), flush=True)
    print("full ms/call: fa3 bf16 {:.2f}; ".format(res["ms_fa3_bf16"]) + ", ".join(
        f"{n} {res[f'ms_{n}']:.2f}" for n in VARIANTS) + f"; FP8 kernel alone {res['ms_fp8_kernel_only']:.2f}, "
        f"quantize alone {res['ms_quantize_only']:.2f}", flush=True)


def _cpu_stand_ins():
    """Smoke test of this script on the CPU: the emulation for FA3's FP8 kernel, SDPA for fa3, torch for Triton."""
    from h3direct.dit import attention as A
    from h3direct.dit import fp8_attention as F8

    def fake_call(qq, kq, vq, head_dim):
        q, k, v = (F8.Quantized(x.data, x.descale, None).dequantize() for x in (qq, kq, vq))
        out = A._sdpa(q, k, v).bfloat16()
        return out if vq.mean is None else out + vq.mean[:, :, None, :].bfloat16()

    F8.fa3_fp8_call = fake_call
    F8.quantize_triton = F8.quantize_torch
    A._fa3 = A._sdpa


def main(argv=None) -> int:
    import torch

    from benchmarks.attention_kernels import positions, random_qkv, reference, structured_qkv

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the 960x544x124 layout)")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--parts", default="quantizer,heads,full")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type != "cuda":
        _cpu_stand_ins()
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (stand-ins, smoke test only)",
           "torch": torch.__version__, "errors": {}}
    parts = args.parts.split(",")
    sets = refs = None
    if "quantizer" in parts or "full" in parts:
        pos, _ = positions(args.seq)
        sets = {"structured": structured_qkv(pos, args.heads, 128, dev),
                "random": random_qkv(pos.shape[0], args.heads, 128, dev)}
        refs = {n: reference(*x) for n, x in sets.items()}
        out["shape"] = [1, args.heads, pos.shape[0], 128]
    for part in parts:
        try:
            if part == "quantizer":
                part_quantizer(sets, args, out)
            elif part == "heads":
                part_heads(args, out)
            elif part == "full":
                part_full(sets, refs, args, out)
        except Exception as exc:  # noqa: BLE001 - report and go on
            out["errors"][part] = f"{type(exc).__name__}: {exc}"
            print(f"{part}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
            traceback.print_exc()
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
