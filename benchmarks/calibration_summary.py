"""Summarise per-backend calibration passes of the parity gate (benchmarks/gpu_calibrate.sh's cal_<label>/ folders).

    python3 benchmarks/calibration_summary.py DIR [DIR ...]     # each DIR: a --parity-report folder of one backend

Per folder and compute key (bf16 = a bf16 trace; bf16@fp32 = h3direct bf16 against an fp32 trace): the worst
teacher-forced rel-L2 per layer kind, the worst free-running rel-L2 at the outputs and elsewhere, and where ComfyUI's
twin exists the ratio rule's numbers: err(h3direct, ComfyUI fp32) and err(ComfyUI bf16, ComfyUI fp32) at the outputs.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

OUTPUTS = ("dit_inner.out.", "dit_forward.out.", "sampler.", "sample_out.")


def case_computes(report_md: Path) -> dict[tuple[str, str], str]:
    out = {}
    for line in report_md.read_text().splitlines():
        m = re.match(r"\| (\S+) \| (teacher|free) \| (\S+) \| (\S+) \| (\S+) \| (\d+) \|", line)
        if m:
            out[(m.group(1), m.group(2))] = m.group(3)
    return out


def summarise(folder: Path) -> dict:
    computes = case_computes(folder / "report.md")
    acc: dict = defaultdict(lambda: defaultdict(float))
    for line in (folder / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        rel = r["rel_l2"] if isinstance(r["rel_l2"], float) else math.inf
        key = computes.get((r["case"], r["mode"]), "?")
        if key == "fp32":
            continue  # fp32 compute: its own budgets (1e-5), not a backend property
        a = acc[key]
        if r["mode"] == "teacher" and r["kind"] != "model":
            a[f"teacher {r['kind']}"] = max(a[f"teacher {r['kind']}"], rel)
            a["teacher worst"] = max(a["teacher worst"], rel)
        else:
            out = r["layer"].startswith(OUTPUTS) or r["kind"] == "model"
            name = "free output" if out else "free other"
            a[name] = max(a[name], rel)
            vs = r.get("vs_fp32")
            if out and vs and vs[1] > 0:
                a["output err vs fp32"] = max(a["output err vs fp32"], vs[0])
                a["output comfy err vs fp32"] = max(a["output comfy err vs fp32"], vs[1])
                a["output ratio"] = max(a["output ratio"], vs[0] / vs[1])
            if not out and vs and vs[1] > 1e-6:
                a["other ratio"] = max(a["other ratio"], vs[0] / vs[1])
    return {k: dict(v) for k, v in acc.items()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    result = {Path(d).name: summarise(Path(d)) for d in argv}
    for label, per in result.items():
        for key, a in per.items():
            print(f"{label:18s} {key:9s} " + "  ".join(f"{k}={v:.3e}" for k, v in sorted(a.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
