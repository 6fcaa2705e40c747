"""parity-report/: results.jsonl (one line per compared layer), report.md (per case, first failure and worst
layers), sqnr.png (per-layer SQNR across the blocks, one line per mode)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path


class ReportCollector:
    def __init__(self):
        self.rows: list[dict] = []
        self.cases: list[dict] = []

    def add_case(self, result) -> None:
        c = result.case
        weights = "vae" if hasattr(c, "config") and hasattr(c, "kind") else getattr(c, "weights", None)
        weights = getattr(result, "weights", None) or weights  # e.g. fp8_w8a8: the key its budgets were taken under
        self.cases.append({"case": c.id, "mode": result.mode, "compute": getattr(result, "compute", None) or
                           getattr(c, "compute", None) or getattr(c, "dtype", None), "weights": weights,
                           "attention": result.attention, "layers": len(result.layers), "passed": result.passed,
                           "first_failure": result.first_failure.name if result.first_failure else None,
                           "attention_calls": getattr(result, "attention_calls", None),
                           "fp8_linear_calls": getattr(result, "fp8_linear_calls", None)})
        for r in result.layers:
            self.rows.append({"case": c.id, "mode": r.mode, "layer": r.name, "kind": r.kind,
                              "rel_l2": _num(r.rel_l2), "sqnr_db": _num(r.sqnr_db), "passed": r.passed,
                              "rule": r.rule, "worst_index": list(r.worst.index), "worst_got": _num(r.worst.got),
                              "worst_ref": _num(r.worst.ref), "replay": r.replay,
                              "vs_fp32": list(r.vs_fp32) if r.vs_fp32 else None})

    def write(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "results.jsonl", "w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
        lines = ["# Parity report", "", "| case | mode | compute | weights | attention | layers | result |",
                 "|---|---|---|---|---|---|---|"]
        for c in self.cases:
            res = "pass" if c["passed"] else f"FAIL at `{c['first_failure']}`"
            lines.append(f"| {c['case']} | {c['mode']} | {c['compute']} | {c['weights']} | {c['attention']} | "
                         f"{c['layers']} | {res} |")
        counted = [c for c in self.cases if c.get("attention_calls")]
        if counted:
            lines += ["", "## Attention calls (kernel vs documented fallback)", ""]
            lines += [f"- {c['case']} ({c['mode']}, {c['attention']}): "
                      + ", ".join(f"{b}: " + ", ".join(f"{k} {v}" for k, v in n.items())
                                  for b, n in c["attention_calls"].items()) for c in counted]
        fp8 = [c for c in self.cases if c.get("fp8_linear_calls")]
        if fp8:  # --fp8-linear: how the FP8 GEMMs ran (torch._scaled_mm, or emulated with the reason)
            lines += ["", "## FP8 linear calls (scaled_mm vs emulated)", ""]
            lines += [f"- {c['case']} ({c['mode']}): " + ", ".join(f"{k} {v}" for k, v in c["fp8_linear_calls"].items())
                      for c in fp8]
        lines += ["", "## Worst layers (lowest SQNR per case and mode)", "",
                  "| case | mode | layer | rel_l2 | sqnr dB |", "|---|---|---|---|---|"]
        by = defaultdict(list)
        for r in self.rows:
            by[(r["case"], r["mode"])].append(r)
        for (case, mode), rows in by.items():
            finite = [r for r in rows if isinstance(r["sqnr_db"], float)]
            for r in sorted(finite, key=lambda r: r["sqnr_db"])[:3]:
                lines.append(f"| {case} | {mode} | {r['layer']} | {r['rel_l2']:.3e} | {r['sqnr_db']:.1f} |")
        lines += ["", "![per-layer SQNR](sqnr.png)", ""]
        (folder / "report.md").write_text("\n".join(lines))
        self._plot(folder / "sqnr.png")
        return folder

    def _plot(self, path: Path) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        series = defaultdict(dict)  # (mode, compute, weights) -> block -> [sqnr]
        meta = {c["case"]: c for c in self.cases}
        for r in self.rows:
            m = re.match(r"blocks\.(\d+)\.out$", r["layer"])
            if not m or r["mode"] not in ("free", "teacher"):
                continue
            c = meta.get(r["case"], {})
            key = f"{r['mode']} {c.get('compute')} {c.get('weights')}"
            v = r["sqnr_db"] if isinstance(r["sqnr_db"], float) else 200.0
            series[key].setdefault(int(m.group(1)), []).append(min(v, 200.0))
        if not series:
            return
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for key, blocks in sorted(series.items()):
            xs = sorted(blocks)
            ax.plot(xs, [min(blocks[x]) for x in xs], marker="o", label=key)
        ax.set_xlabel("DiT block")
        ax.set_ylabel("SQNR of blocks.N.out vs ComfyUI (dB, min over traces; 200 = exact)")
        ax.set_title("h3direct vs ComfyUI, per block")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _num(x: float):
    return x if isinstance(x, float) and math.isfinite(x) else str(x)
