"""The closing table of benchmarks/gpu_final.sh: one row per gate run (a parity report folder + its pytest log).

    python benchmarks/final_summary.py LABEL=REPORT_DIR,LOG,ATTENTION[,WEIGHTS] ...

Per row: the pytest verdict (last line of LOG: passed / failed / skipped counts), the verdict of the REAL budgets table
on every recorded comparison (benchmarks/regate.py; for a calibration-table run this is what the real gate would say),
teacher-forced worst rel-L2, free-running output rel-L2 vs ComfyUI's trace and vs its fp32 twin, and the ratio of the
latter to ComfyUI's own bf16 error (benchmarks/calibration_summary.py), the worst over the run's compute keys.
A missing folder or log is a row saying so (the step did not run or timed out). Exit 0; 2 on bad arguments.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_summary import summarise  # noqa: E402
from regate import regate  # noqa: E402


def _pytest_line(log: Path) -> str:
    if not log.is_file():
        return "no log"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    return lines[-1].strip("= ").replace(" in ", " (") + ")" if lines else "no pytest result line"


def row(label: str, spec: str) -> str:
    parts = spec.split(",")
    if len(parts) not in (3, 4):
        raise ValueError(spec)
    folder, log, attention = Path(parts[0]), Path(parts[1]), parts[2]
    weights = parts[3] if len(parts) == 4 else "bf16"
    head = f"{label:24s} {_pytest_line(log)[:44]:44s}"
    if not (folder / "results.jsonl").is_file():
        return head + "  (no parity report)"
    fails, _ = regate(folder, attention, weights)
    per = summarise(folder)
    real = "PASS" if not fails else f"FAIL {len(fails)}"
    return (head + f"  real {real:9s} teacher {_worst(per, 'teacher worst')}  free-out {_worst(per, 'free output')}  "
            f"vs fp32 {_worst(per, 'output err vs fp32')}  x{_worst(per, 'output ratio', '.2f')} ComfyUI bf16")


def _worst(per: dict, key: str, fmt: str = ".2e") -> str:
    """The worst value of one summary number over the run's compute keys, or "–" where no key recorded it (a run
    without ComfyUI's fp32 twin has no vs-fp32 error or ratio; 0 would read as a perfect match)."""
    vals = [a[key] for a in per.values() if key in a]
    return format(max(vals), fmt) if vals else "–"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any("=" not in a for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    print(f"{'run':24s} {'pytest':44s}  real budgets.toml on every comparison, worst rel-L2, ratio")
    for a in argv:
        label, spec = a.split("=", 1)
        try:
            print(row(label, spec))
        except Exception as exc:  # one bad row never hides the others
            print(f"{label:24s} error: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
