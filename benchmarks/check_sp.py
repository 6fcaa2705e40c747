"""Gate a trace that `h3direct trace` wrote under torchrun against ComfyUI's trace of the same case and against
a single-process h3direct trace (any device; the GPU check of `run_sp_h200x2.sh`).

    python3 benchmarks/check_sp.py --comfy fixtures/trace_fx_bf16_ref2va_fp32.safetensors \\
        --ours $OUT/trace_x2.safetensors --single $OUT/trace_x1.safetensors [--out check.json]

The ComfyUI trace is found beside its checkpoint and inputs like the parity gate finds it; budgets come from
parity_tests/budgets.toml. Exit status 0 when both comparisons pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402,F401  (puts the repo root on sys.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy", required=True, help="ComfyUI DiT trace (.safetensors beside its checkpoint/inputs)")
    ap.add_argument("--ours", required=True, help="the torchrun trace")
    ap.add_argument("--single", required=True, help="the single-process trace of the same command")
    ap.add_argument("--out", default=None, help="JSON summary")
    args = ap.parse_args(argv)

    from h3direct.traces.discovery import find_dit_cases
    from h3direct.traces.format import load_trace
    from parity_tests.gate import gate_tensors

    comfy = Path(args.comfy).resolve()
    case = next((c for c in find_dit_cases([comfy.parent])[0] if c.trace.resolve() == comfy), None)
    if case is None:
        print(f"check_sp: {comfy} has no checkpoint/inputs beside it", file=sys.stderr)
        return 2
    ours, single = load_trace(args.ours), load_trace(args.single)
    tensors = {n: ours.get(n) for n in ours.names_in_order()}
    results = {"vs_comfyui": gate_tensors(case, tensors, title=f"{args.ours} vs ComfyUI {case.id}"),
               "vs_single": gate_tensors(case, tensors, reference=single, title=f"{args.ours} vs {args.single}")}
    summary = {"manifest": {k: ours.manifest.get(k) for k in ("world_size", "sequence_parallel", "device")}}
    for key, r in results.items():
        print(r.report())
        outs = {x.name: x.rel_l2 for x in r.layers if x.name.startswith(("dit_inner.out", "sample_out"))}
        summary[key] = {"passed": r.passed, "compared": len(r.layers), "max_rel_l2": max(x.rel_l2 for x in r.layers),
                        "outputs_rel_l2": outs, "report": r.report()}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if all(r.passed for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
