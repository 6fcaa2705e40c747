"""The sharded teacher-forced gate, one process per rank (run it under torchrun):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m parity_tests.sp_worker \\
        --out result.json TRACE.safetensors [TRACE ...]

TRACE: ComfyUI DiT traces (found beside their checkpoint and inputs, as the gate finds them). Every rank runs
every site (they are collective); rank 0 writes {case id: {"passed", "report", "layers": [...]}} to --out
and prints the reports. Exit status 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity_tests.sp_worker")
    ap.add_argument("--out", required=True)
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)

    from h3direct.dit import parallel
    from parity_tests.discovery import find_dit_cases
    from parity_tests.gate import run_sharded_teacher

    wanted = {Path(t).resolve() for t in args.traces}
    cases, _ = find_dit_cases(sorted({Path(t).resolve().parent for t in args.traces}))
    cases = [c for c in cases if c.trace.resolve() in wanted]
    if len(cases) != len(wanted):
        print(f"sp_worker: found {len(cases)} of {len(wanted)} traces with their checkpoint and inputs",
              file=sys.stderr)
        return 2
    sp = parallel.init_from_env()
    if sp is None:
        print("sp_worker: run under torchrun with --nproc-per-node >= 2", file=sys.stderr)
        return 2
    try:
        results = [run_sharded_teacher(c, sp, attention=args.attention) for c in cases]
    finally:
        parallel.shutdown()
    if sp.rank != 0:
        return 0
    out = {r.case.id: {"passed": r.passed, "report": r.report(),
                       "layers": [{"name": x.name, "kind": x.kind, "rel_l2": x.rel_l2, "passed": x.passed,
                                   "rule": x.rule} for x in r.layers]} for r in results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for r in results:
        print(r.report())
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
