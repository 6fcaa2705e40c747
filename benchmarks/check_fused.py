"""Bitwise check + timing of the fused elementwise kernels (`h3direct/dit/fused.py`) against the eager ops.

    python3 benchmarks/check_fused.py [--device cuda] [--rows 20050]

CUDA only for the verdict: Triton's CPU interpreter (TRITON_INTERPRET=1, small --rows) runs the kernel for a
smoke test but has no libdevice and rounds bf16 differently, so it reports mismatches. Exit 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    from h3direct.dit import fused

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=20050)
    p.add_argument("--ffn", type=int, default=14336)
    args = p.parse_args(argv)
    dev, s = args.device, args.rows
    g = torch.Generator(device="cpu").manual_seed(0)
    ok = True
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        a = (torch.randn(s, 2 * args.ffn, generator=g) * 4).to(dev, dtype)
        gate, up = a.chunk(2, dim=-1)
        want = F.silu(gate).mul_(up)
        got = fused.swiglu(a)
        same = torch.equal(got, want)
        ok &= same
        rows.append((f"swiglu {dtype}", same, int((got != want).sum())))
    for name, same, bad in rows:
        print(f"  {name:45s} {'bitwise' if same else 'DIFFERS'}  ({bad} elements differ)")
    if dev.startswith("cuda"):
        a = torch.randn(s, 2 * args.ffn, device=dev, dtype=torch.bfloat16)

        def bench(fn, n=20):
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / n * 1e3

        def eager_swiglu():
            gg, uu = a.chunk(2, dim=-1)
            return F.silu(gg).mul_(uu)

        print(f"  swiglu:   eager {bench(eager_swiglu):.3f} ms, fused {bench(lambda: fused.swiglu(a)):.3f} ms")
    print("fused kernels:", "bitwise equal to eager" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
