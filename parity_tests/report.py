"""The gate's report, one folder per run: `report.html` (self-contained: what a person reads), `results.jsonl` (one
line per comparison) and `report.md` (the case table, for a terminal or a PR comment).

report.html, per case: every comparison's error against its limit on a log scale, in execution order, with the
limit as a line, the first failing comparison marked and its replay command beside the plot; per attention site of
an approximate backend, the kernel's error against its contract; on top, a table of the cases with the margin of
each part (limit / error at the comparison closest to its limit: > 1 passes), and per case of an approximate mode its
ladder: every mode's output error against ComfyUI's fp32 twin as a multiple of ComfyUI's own low-precision error,
ComfyUI bf16 and ComfyUI+sage as reference rows, with each mode's margin to its rule and to its baseline.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

from parity_tests.results import PARTS

MARGIN_PARTS = tuple(p for p in PARTS if p != "quality")  # the parts with limits (quality is reported)
PART_TITLE = {"exact": "a: exact rule", "kernel": "b: kernel contract", "class": "c: ComfyUI's fast mode",
              "quality": "quality (reported)", "drift": "d: own baseline"}
# plot geometry (px): margins leave room for the y label and the tick labels
W, H, LEFT, RIGHT, TOP, BOTTOM = 880, 300, 88, 24, 20, 58


class ReportCollector:
    def __init__(self):
        self.rows: list[dict] = []
        self.cases: list[dict] = []

    def add_case(self, result) -> None:
        c = result.case
        weights = "vae" if hasattr(c, "config") and hasattr(c, "kind") else getattr(c, "weights", None)
        weights = getattr(result, "weights", None) or weights
        first = result.first_failure
        rows = []
        for r in result.layers:
            rows.append({"case": c.id, "mode": r.mode, "layer": r.name, "kind": r.kind, "part": r.part,
                         "rel_l2": _num(r.rel_l2), "sqnr_db": _num(r.sqnr_db), "error": _num(r.error),
                         "limit": _num(r.limit), "passed": r.passed, "rule": r.rule, "info": r.info,
                         "worst_index": list(r.worst.index), "worst_got": _num(r.worst.got),
                         "worst_ref": _num(r.worst.ref), "replay": r.replay,
                         "vs_fp32": list(r.vs_fp32) if r.vs_fp32 else None})
        span = (len(self.rows), len(self.rows) + len(rows))
        self.rows += rows
        margins = {}
        for part in MARGIN_PARTS:
            w = result.worst(part)
            if w is not None:
                margins[part] = {"layer": w.name, "margin": _num(w.limit / w.error if w.error else math.inf)}
        self.cases.append({"case": c.id, "recording": result.recording or c.id, "judges": result.judges,
                           "title": result.title or c.id, "mode": result.mode,
                           "compute": getattr(result, "compute", None) or getattr(c, "compute", None)
                           or getattr(c, "dtype", None), "weights": weights, "attention": result.attention,
                           "layers": len(result.layers), "passed": result.passed, "rows": span,
                           "first_failure": first.name if first else None,
                           "first_replay": first.replay if first else None,
                           "first_rule": first.rule if first else None, "margins": margins,
                           "pending": getattr(result, "pending", ""),
                           "notes": list(getattr(result, "notes", [])),
                           "attention_calls": getattr(result, "attention_calls", None),
                           "fp8_linear_calls": getattr(result, "fp8_linear_calls", None),
                           "ladder": getattr(result, "ladder", None) or None})

    def merge(self, rows: list[dict], cases: list[dict]) -> None:
        """Add another collector's rows and cases (an xdist worker's), its cases' row spans moved past ours."""
        offset = len(self.rows)
        self.rows += rows
        self.cases += [{**c, "rows": (c["rows"][0] + offset, c["rows"][1] + offset)} for c in cases]

    def write(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "results.jsonl", "w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
        (folder / "report.md").write_text(self.markdown())
        (folder / "report.html").write_text(self.html())
        return folder

    # ---- markdown ---------------------------------------------------------------------------------

    def grouped(self) -> list[tuple[int, dict, bool]]:
        """(index, case run, first of its case) in the order the cases were met, a case's rows together: one case is
        one recording, its low-precision trace and ComfyUI's fp32 twin of it each gated teacher-forced and free."""
        order: dict[str, list[int]] = {}
        for i, c in enumerate(self.cases):
            order.setdefault(c.get("recording") or c["case"], []).append(i)
        return [(i, self.cases[i], j == 0) for rows in order.values() for j, i in enumerate(rows)]

    def markdown(self) -> str:
        n = len({c.get("recording") or c["case"] for c in self.cases})
        lines = ["# Parity report", "", f"{n} case{'s' if n != 1 else ''}, {len(self.cases)} rows: a row is one trace "
                 "of a case, teacher-forced or free-running; a low-precision recording and ComfyUI's fp32 twin of it "
                 "are one case.", "",
                 "| case | row: what it judges | mode | compute | weights | attention | compared | result "
                 "| margin a / b / c / d |", "|---|---|---|---|---|---|---|---|---|"]
        for _, c, first in self.grouped():
            res = "pass" if c["passed"] else f"FAIL at `{c['first_failure']}`" if c["first_failure"] else _not_passed(c)
            lines.append(f"| {c.get('recording', c['case']) if first else ''} | {_row_label(c)} | {c['mode']} | "
                         f"{c['compute']} | {c['weights']} | {c['attention']} | {c['layers']} | {res} | "
                         f"{_margins(c)} |")
        laddered = [c for c in self.cases if c.get("ladder")]
        if laddered:
            lines += ["", "## Ladder: output error against ComfyUI's fp32 twin, × ComfyUI's own low-precision error",
                      ""]
            for c in laddered:
                lines += [f"**{c['case']}**", ""] + ladder_markdown(c["ladder"]) + [""]
        counted = [c for c in self.cases if c.get("attention_calls")]
        if counted:
            lines += ["", "## Attention calls (kernel vs documented fallback)", ""]
            lines += [f"- {c['case']} ({c['mode']}, {c['attention']}): "
                      + ", ".join(f"{b}: " + ", ".join(f"{k} {v}" for k, v in n.items())
                                  for b, n in c["attention_calls"].items()) for c in counted]
        fp8 = [c for c in self.cases if c.get("fp8_linear_calls")]
        if fp8:
            lines += ["", "## FP8 linear calls (scaled_mm vs emulated)", ""]
            lines += [f"- {c['case']} ({c['mode']}): " + ", ".join(f"{k} {v}" for k, v in c["fp8_linear_calls"].items())
                      for c in fp8]
        failing = [c for c in self.cases if not c["passed"] and c["first_replay"]]
        if failing:
            lines += ["", "## First failures and their replay commands", ""]
            lines += [f"- {c['case']} ({c['mode']}): `{c['first_failure']}` — {c['first_rule']}\n  "
                      f"`{c['first_replay']}`" for c in failing]
        lines += ["", "The plots are in report.html.", ""]
        return "\n".join(lines)

    # ---- html -------------------------------------------------------------------------------------

    def html(self) -> str:
        passed = sum(c["passed"] for c in self.cases)
        out = [_HEAD, f"<h1>Parity report</h1><p class=sum>{passed} of {len(self.cases)} cases pass.</p>",
               "<h2>Cases</h2>", self._case_table()]
        kernel = [r for r in self.rows if r["part"] == "kernel"]
        if kernel:
            out += ["<h2>Attention sites: the kernel against its contract</h2>", self._kernel_table(kernel)]
        for i, c in enumerate(self.cases):
            out.append(self._case_section(i, c))
        out.append("</body></html>")
        return "\n".join(out)

    def _case_table(self) -> str:
        head = ("<table><tr><th>case</th><th>row: what it judges</th><th>mode</th><th>compute</th><th>weights</th>"
                "<th>attention</th><th>compared</th><th>result</th>"
                + "".join(f"<th>margin {PART_TITLE[p]}</th>" for p in MARGIN_PARTS) + "</tr>")
        body = []
        rows_of: dict[str, int] = {}
        for c in self.cases:
            key = c.get("recording") or c["case"]
            rows_of[key] = rows_of.get(key, 0) + 1
        for i, c, first in self.grouped():
            res = ("<span class=ok>pass</span>" if c["passed"] else
                   f"<span class=bad>FAIL</span> at <code>{_e(c['first_failure'])}</code>" if c["first_failure"] else
                   f"<span class=bad>{_e(_not_passed(c))}</span>")
            cells = []
            for p in MARGIN_PARTS:
                m = c["margins"].get(p)
                cells.append("<td>–</td>" if m is None else
                             f"<td class={'ok' if _margin_ok(m['margin']) else 'bad'}>{_fmt_margin(m['margin'])}"
                             f" <small>{_e(m['layer'])}</small></td>")
            key = c.get("recording") or c["case"]
            name = f"<td rowspan={rows_of[key]}>{_e(key)}</td>" if first else ""
            body.append(f"<tr>{name}<td><a href='#case{i}'>{_e(_row_label(c))}</a></td><td>{_e(c['mode'])}</td>"
                        f"<td>{_e(c['compute'])}</td><td>{_e(c['weights'])}</td><td>{_e(c['attention'])}</td>"
                        f"<td>{c['layers']}</td><td>{res}</td>{''.join(cells)}</tr>")
        return head + "".join(body) + "</table>"

    def _kernel_table(self, rows: list[dict]) -> str:
        body = ["<table><tr><th>case</th><th>site</th><th>error</th><th>contract limit</th><th>margin</th>"
                "<th>rule</th><th>also measured</th></tr>"]
        for r in rows:
            m = r["limit"] / r["error"] if _finite(r["error"]) and r["error"] and _finite(r["limit"]) else math.inf
            body.append(f"<tr><td>{_e(r['case'])}</td><td><code>{_e(r['layer'])}</code></td>"
                        f"<td>{_fmt(r['error'])}</td><td>{_fmt(r['limit'])}</td>"
                        f"<td class={'ok' if r['passed'] else 'bad'}>{_fmt_margin(m)}</td><td>{_e(r['rule'])}</td>"
                        f"<td>{_e(r['info'])}</td></tr>")
        return "".join(body) + "</table>"

    def _case_section(self, i: int, c: dict) -> str:
        rows = [r for r in self.rows[c["rows"][0]:c["rows"][1]] if r["part"] != "kernel"]
        status = "<span class=ok>pass</span>" if c["passed"] else "<span class=bad>FAIL</span>"
        parts = [f"<section id='case{i}'><h2>{_e(c['title'])} [{_e(c['mode'])}] — {status}</h2>"]
        if not c["passed"] and c["first_failure"]:
            parts.append(f"<p class=fail>First failing comparison: <code>{_e(c['first_failure'])}</code> — "
                         f"{_e(c['first_rule'])}<br>Replay: <code class=cmd>{_e(c['first_replay'])}</code></p>")
        for n in c["notes"]:
            parts.append(f"<p class=note>{_e(n)}</p>")
        if c.get("ladder"):
            parts.append(ladder_html(c["ladder"]))
        parts.append(plot_svg(rows, c["first_failure"]))
        parts.append("</section>")
        return "\n".join(parts)


def _ladder_cells(ladder: dict, row: dict) -> list[str]:
    x = [f"×{row['x'][n]:.2f}" if n in row["x"] else "–" for n in ladder["comfy"]]
    return x + [_fmt_margin(row[k]) if row.get(k) is not None else "–" for k in ("rule", "baseline")]


def ladder_markdown(ladder: dict) -> list[str]:
    names = [n.rsplit(".", 1)[-1] for n in ladder["comfy"]]
    head = "| mode | " + " | ".join(f"{n} ×ComfyUI" for n in names) + " | margin to its rule | to its baseline |"
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for row in ladder["rows"]:
        mode = f"**{row['mode']}**" if row.get("this") else row["mode"]
        lines.append(f"| {mode} | " + " | ".join(_ladder_cells(ladder, row)) + " |")
    return lines


def ladder_html(ladder: dict) -> str:
    names = [n.rsplit(".", 1)[-1] for n in ladder["comfy"]]
    head = ("<table class=ladder><tr><th>mode (output error vs ComfyUI's fp32 twin)</th>"
            + "".join(f"<th>{_e(n)} × ComfyUI</th>" for n in names)
            + "<th>margin to its rule</th><th>to its baseline</th></tr>")
    body = [f"<tr{' class=this' if row.get('this') else ''}><td>{_e(row['mode'])}</td>"
            + "".join(f"<td>{_e(c)}</td>" for c in _ladder_cells(ladder, row)) + "</tr>" for row in ladder["rows"]]
    return head + "".join(body) + "</table>"


def _row_label(c: dict) -> str:
    """A row's trace and what it judges (the trace alone where the run named nothing more)."""
    return c.get("judges") or c["case"]


def _not_passed(c: dict) -> str:
    """Why a case with no failing comparison did not pass: what is pending, or that nothing was compared."""
    return c.get("pending") or "FAIL: nothing compared"


def _margins(c: dict) -> str:
    return " / ".join(_fmt_margin(c["margins"][p]["margin"]) if p in c["margins"] else "–" for p in MARGIN_PARTS)


def _margin_ok(m) -> bool:
    return isinstance(m, float) and m >= 1.0 or m == "inf"


def _fmt_margin(m) -> str:
    if m in ("inf", math.inf):
        return "exact"
    if not isinstance(m, float) or not math.isfinite(m):
        return str(m)
    return f"×{m:.2f}"


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _fmt(x) -> str:
    return f"{x:.3e}" if _finite(x) else str(x)


def _e(x) -> str:
    return html.escape(str(x if x is not None else ""))


def _num(x: float):
    return x if isinstance(x, float) and math.isfinite(x) else str(x)


def plot_svg(rows: list[dict], first_failure: str | None) -> str:
    """Error (dots) and limit (line) per comparison, log scale, in execution order; failing dots red, the first
    failure marked with a vertical line and its name; x ticks at DiT block boundaries."""
    if not rows:
        return "<p class=note>nothing compared</p>"
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    vals = [v for r in rows for v in (r["error"], r["limit"]) if _finite(v) and v > 0]
    lo = math.floor(math.log10(min(vals))) if vals else -8
    hi = math.ceil(math.log10(max(vals))) if vals else 0
    hi = max(hi, lo + 1)
    n = len(rows)

    def x(i):
        return LEFT + (pw * (i + 0.5) / n)

    def y(v):
        v = min(max(v, 10.0 ** lo), 10.0 ** hi)
        return TOP + ph * (hi - math.log10(v)) / (hi - lo)

    s = [f"<svg class='plot' width='{W}' height='{H}' viewBox='0 0 {W} {H}' xmlns='http://www.w3.org/2000/svg'>",
         f"<rect x='{LEFT}' y='{TOP}' width='{pw}' height='{ph}' fill='#fff' stroke='#999'/>"]
    for d in range(lo, hi + 1):  # decades: grid and labels
        yy = y(10.0 ** d)
        s.append(f"<line x1='{LEFT}' x2='{LEFT + pw}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='#e4e4e4'/>")
        s.append(f"<text x='{LEFT - 6}' y='{yy + 4:.1f}' text-anchor='end' class='tick'>1e{d}</text>")
    blocks = {}
    for i, r in enumerate(rows):
        m = re.match(r"(?:token_refiner\.)?blocks\.(\d+)\.", r["layer"])
        key = ("r" if r["layer"].startswith("token_refiner") else "b") + (m.group(1) if m else "")
        if m and key not in blocks:
            blocks[key] = i
    for key, i in blocks.items():
        xx = LEFT + pw * i / n
        s.append(f"<line x1='{xx:.1f}' x2='{xx:.1f}' y1='{TOP}' y2='{TOP + ph}' stroke='#eee'/>")
        s.append(f"<text x='{xx + 2:.1f}' y='{TOP + ph + 14}' class='tick'>{'ref ' if key[0] == 'r' else ''}"
                 f"{key[1:]}</text>")
    s.append(f"<text x='{LEFT + pw / 2}' y='{H - 8}' text-anchor='middle' class='axis'>comparisons in execution "
             f"order (numbers: DiT block, ref: token-refiner block)</text>")
    s.append(f"<text transform='translate(16,{TOP + ph / 2}) rotate(-90)' text-anchor='middle' class='axis'>"
             f"error (rel-L2, log)</text>")
    limit_pts = [(x(i), y(r["limit"])) for i, r in enumerate(rows) if _finite(r["limit"]) and r["limit"] > 0]
    if limit_pts:
        path = " ".join(f"{'M' if j == 0 else 'L'}{a:.1f},{b:.1f}" for j, (a, b) in enumerate(limit_pts))
        s.append(f"<path d='{path}' fill='none' stroke='#d08000' stroke-width='1.5' class='limit'/>")
    for i, r in enumerate(rows):
        if r["error"] == 0.0:  # bit for bit: on the bottom edge, hollow
            s.append(f"<circle cx='{x(i):.1f}' cy='{TOP + ph - 3}' r='2.5' fill='none' stroke='#888'><title>"
                     f"{_e(r['layer'])}: identical</title></circle>")
            continue
        if not (_finite(r["error"]) and r["error"] > 0):
            continue
        color = "#1f77b4" if r["passed"] else "#d62728"
        s.append(f"<circle cx='{x(i):.1f}' cy='{y(r['error']):.1f}' r='{2.5 if r['passed'] else 4}' "
                 f"fill='{color}'><title>{_e(r['layer'])}: {_fmt(r['error'])} (limit {_fmt(r['limit'])})"
                 f"</title></circle>")
    if first_failure is not None:
        i = next((j for j, r in enumerate(rows) if r["layer"] == first_failure), None)
        if i is not None:
            s.append(f"<line x1='{x(i):.1f}' x2='{x(i):.1f}' y1='{TOP}' y2='{TOP + ph}' stroke='#d62728' "
                     f"stroke-dasharray='4,3'/>")
            anchor = "end" if x(i) > LEFT + pw / 2 else "start"
            dx = -4 if anchor == "end" else 4
            s.append(f"<text x='{x(i) + dx:.1f}' y='{TOP + 12}' text-anchor='{anchor}' class='failtext'>first "
                     f"failure: {_e(first_failure)}</text>")
    s.append(f"<g class='legend' transform='translate({LEFT + 8},{TOP + ph - 30})'>"
             "<circle cx='4' cy='0' r='3' fill='#1f77b4'/><text x='12' y='4'>error (within its limit)</text>"
             "<circle cx='4' cy='14' r='4' fill='#d62728'/><text x='12' y='18'>error over its limit</text>"
             "<line x1='170' x2='190' y1='0' y2='0' stroke='#d08000' stroke-width='1.5'/>"
             "<text x='196' y='4'>limit (its rule)</text>"
             "<circle cx='174' cy='14' r='2.5' fill='none' stroke='#888'/><text x='182' y='18'>identical (bit for bit)"
             "</text></g>")
    s.append("</svg>")
    return "".join(s)


_HEAD = """<!doctype html><html><head><meta charset='utf-8'><title>Parity report</title><style>
body{font-family:system-ui,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}
td a,td small,td code{overflow-wrap:anywhere}table{width:100%}
.ok{color:#17702a}.bad{color:#c01818;font-weight:bold}.fail{background:#fdecec;padding:6px 10px;border-left:4px solid
#c01818}.note{color:#666;font-size:13px}code{font-size:12px}.cmd{display:block;margin-top:4px;word-break:break-all}
.tick{font-size:11px;fill:#555}.axis{font-size:12px;fill:#333}.failtext{font-size:12px;fill:#c01818}
.legend text{font-size:11px;fill:#333}small{color:#666}.sum{font-size:15px}
.ladder{width:auto;margin:8px 0}.ladder .this{font-weight:bold}
</style></head><body>"""
