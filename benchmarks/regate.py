"""Apply the real gate's budgets (parity_tests/budgets.toml) to a calibration report, offline.

A calibration run (`pytest -m parity ... --budgets benchmarks/calibration_budgets.toml`) passes every comparison and
records every metric in <report>/results.jsonl. This re-judges those records under the real table, keyed the way
parity_tests/gate.py keys them (a teacher "model" site under free/output; compute from the report's per-case rows),
and prints the failures and, per (compute, mode, kind), the worst fraction of its limit that was used. No GPU needed.

    python benchmarks/regate.py REPORT_DIR ATTENTION [WEIGHTS]   # WEIGHTS: fp8_w8a8 for --fp8-linear runs
Exit status: 0 all pass, 1 some comparison fails, 2 bad arguments.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_summary import OUTPUTS, case_computes  # noqa: E402

from h3direct.errors import H3Error  # noqa: E402
from h3direct.traces.budgets import load_budgets, verdict  # noqa: E402


def regate(folder: Path, attention: str, weights: str = "bf16", table=None) -> tuple[list, dict]:
    table = table or load_budgets()
    if weights == "fp8_w8a8":  # as the gate keys --fp8-linear: only entries naming that weights key apply
        from parity_tests.gate import KeyedBudgets

        table = KeyedBudgets(table, weights)
    computes = case_computes(folder / "report.md")
    fails, used = [], {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        compute = computes.get((r["case"], r["mode"]), "?")
        if compute == "fp32" and attention in ("sdpa",):
            continue  # fp32 compute with sdpa: the fp32 entries, not a GPU backend property
        out = r["mode"] == "free" and (r["layer"].startswith(OUTPUTS) or r["kind"] == "model")
        mode, kind = ("free", "output") if r["kind"] == "model" or out else (r["mode"], r["kind"])
        try:
            b = table.lookup(mode=mode, kind=kind, compute=compute, weights=weights, attention=attention)
        except H3Error as e:
            fails.append((r["case"], r["mode"], r["layer"], str(e).split(": ", 1)[-1]))
            continue
        rel = r["rel_l2"] if isinstance(r["rel_l2"], float) else math.inf
        sqnr = r["sqnr_db"] if isinstance(r["sqnr_db"], float) else 999.0
        vs = r.get("vs_fp32")
        ok, rule = verdict(b, rel=rel, sqnr=sqnr, identical=rel == 0.0, ours_vs_fp32=vs[0] if vs else None,
                           comfy_vs_fp32=vs[1] if vs else None)
        if b.k is not None and vs:
            use = vs[0] / (b.k * vs[1] + (b.floor or 0.0))
        else:
            use = rel / b.rel_l2 if b.rel_l2 else 0.0
        key = (compute, mode, kind if kind in ("output", "attention", "block") else "*")
        used[key] = max(used.get(key, 0.0), use)
        if not ok:
            fails.append((r["case"], r["mode"], r["layer"], rule))
    return fails, used


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or not (Path(argv[0]) / "results.jsonl").is_file():
        print("usage: python benchmarks/regate.py REPORT_DIR ATTENTION [WEIGHTS] (REPORT_DIR/results.jsonl needed)",
              file=sys.stderr)
        return 2
    folder, attention = Path(argv[0]), argv[1]
    weights = argv[2] if len(argv) == 3 else "bf16"
    fails, used = regate(folder, attention, weights)
    print(f"{folder.name} [{attention}, weights {weights}]: {'PASS' if not fails else f'FAIL ({len(fails)})'}; "
          "worst fraction of limit: " + ", ".join(f"{'/'.join(k)}={v:.2f}" for k, v in sorted(used.items())))
    for f in fails[:10]:
        print("   FAIL", *f)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
