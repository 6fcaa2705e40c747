"""What a person reads of a frontier: the plot (s/step against worst-case error, every candidate, the Pareto points,
ComfyUI's two configurations, each tier's nominal bound and its effective one, the bound over its margin, the
chosen tiers ringed) and the HTML report (the plot, the tiers, the candidates sorted by speed with their error per
case, what was left out); `write` puts them beside the frontier's JSON and its tiers file."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from h3direct.app.frontier.choice import error, pareto, spread
from h3direct.app.tiers import SPARSE_SPREAD

BLUE, GREY, ORANGE, GREEN = "#1f6fb2", "#9aa7b4", "#d9480f", "#2b8a3e"
OFFSETS = [(5, 3), (5, -10), (-5, 3), (-5, -10), (5, 12), (5, -19), (-5, 12), (-5, -19)]  # points, tried in turn


def effective_bound(choice: dict) -> float | None:
    """A tier's bound over its margin: the worst case a candidate may have to qualify (None: the exact rules)."""
    return None if choice["bound"] is None else choice["bound"] / choice["margin"]


def place_labels(ax, labels: list[tuple[str, tuple, dict]], points: list[tuple] = ()) -> list:
    """Annotate `ax` with each (text, xy, style) in turn at the first offset of `OFFSETS` (style "offsets" replaces
    them) where the text overlaps no label placed before it and no marker of `points` (data coordinates); a label
    that fits nowhere is left off (the table names every candidate). Returns the labels placed."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    placed = []
    boxes = [Bbox.from_extents(x - 4, y - 4, x + 4, y + 4) for x, y in (ax.transData.transform(p) for p in points)]
    for text, xy, style in labels:
        style = dict(style)
        for dx, dy in style.pop("offsets", OFFSETS):
            a = ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), ha="left" if dx >= 0 else "right",
                            **style)
            box = a.get_window_extent(renderer).expanded(1.02, 1.1)
            if not any(box.overlaps(b) for b in boxes):
                placed.append(a)
                boxes.append(box)
                break
            a.remove()
    return placed


def plot(rows: dict, comfy: dict, choices: dict, path: Path) -> Path:
    """s/step against worst-case error × ComfyUI+sage (log): every candidate, the Pareto points marked, ComfyUI's
    default and +sage, each tier's nominal bound (dashed) and effective bound (dotted: the bound over its margin),
    its choice ringed; labels placed so that none overlaps another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6), dpi=110)
    front = set(pareto(rows))
    shown = {n: r for n, r in rows.items() if math.isfinite(r["s_per_step"]) and math.isfinite(error(r))}
    xs = [error(r) for r in shown.values()]
    for n, r in shown.items():
        ax.scatter([error(r)], [r["s_per_step"]], s=46 if n in front else 22, c=BLUE if n in front else GREY, zorder=3)
    for c in comfy.values():
        if c.get("s_per_step") and math.isfinite(c.get("worst_x_sage", math.nan)):
            ax.scatter([c["worst_x_sage"]], [c["s_per_step"]], marker="s", s=60, c=ORANGE, zorder=4)
            xs.append(c["worst_x_sage"])
    labels = []
    for i, (name, c) in enumerate(choices.items()):
        if c["chosen"] is not None:
            r = rows[c["chosen"]]
            ax.scatter([error(r)], [r["s_per_step"]], s=180, facecolors="none", edgecolors=GREEN, lw=2, zorder=5)
        if c["bound"] is None:
            continue
        eff = effective_bound(c)
        ax.axvline(c["bound"], color=GREEN, lw=1, ls="--", zorder=1)
        ax.axvline(eff, color=GREEN, lw=1, ls=":", zorder=1)
        xs += [c["bound"], eff]
        top = 0.97 - 0.13 * i
        for x, text in ((c["bound"], f"{name} bound ×{c['bound']:g}"),
                        (eff, f"{name} effective ×{eff:.2f} (÷ margin {c['margin']:.2f})")):
            labels.append((text, (x, top), {"xycoords": ("data", "axes fraction"), "fontsize": 7, "color": GREEN,
                                            "offsets": [(3, 0), (-3, 0), (3, -10), (-3, -10), (3, -20), (-3, -20)]}))
    ax.set_xscale("log")
    if xs:
        ax.set_xlim(min(xs) / 1.25, max(xs) * 1.6)
    else:
        ax.set_xlim(0.5, 10)
    ax.set_xlabel("worst-case output error × ComfyUI --use-sage-attention's (the cases of the frontier)")
    ax.set_ylabel("s / step at the contract's workload")
    ax.set_title("speed / quality frontier (blue: Pareto; squares: ComfyUI; rings: the chosen tiers; dashed: a tier's "
                 "bound, dotted: its bound over its margin)", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    for name, c in comfy.items():
        if c.get("s_per_step") and math.isfinite(c.get("worst_x_sage", math.nan)):
            labels.append((f"ComfyUI {name}", (c["worst_x_sage"], c["s_per_step"]), {"fontsize": 8, "color": ORANGE}))
    chosen = {c["chosen"] for c in choices.values()}
    for n in sorted(shown, key=lambda n: (n not in chosen, n not in front, shown[n]["s_per_step"])):
        labels.append((n, (error(shown[n]), shown[n]["s_per_step"]), {"fontsize": 7, "color": "#333333"}))
    place_labels(ax, labels, [(error(r), r["s_per_step"]) for r in shown.values()])
    fig.savefig(path)
    plt.close(fig)
    return path


def code_line(made: dict) -> str:
    """Which code measured the frontier, in words: its commit (with uncommitted changes, when so), else that the
    measuring checkout had no git history to name one; and the git tree of its files where recorded."""
    commit, tree = str(made.get("commit") or "unknown"), made.get("tree")
    if commit == "unknown":
        what = "commit not known (the measuring checkout had no git history)"
    elif commit.endswith("+changes"):
        what = f"commit {commit.removesuffix('+changes')[:12]} with uncommitted changes"
    else:
        what = f"commit {commit[:12]}"
    files = f"the files that ran: git tree {tree[:12]}" if tree else "the files that ran were not recorded"
    return f"{what}; {files}"


def tier_line(name: str, c: dict, rows: dict) -> str:
    """One tier in words: what was chosen (or that nothing qualified) and the rule it was chosen by."""
    if c["bound"] is None:
        rule = "the exact rules (no error bound: an exact attention backend and the checkpoint's own linears)"
    else:
        rule = (f"bound ×{c['bound']:g} ComfyUI+sage's error, margin ×{c['margin']:.3f}: effective bound "
                f"×{effective_bound(c):.3f} (the worst case must be within it)")
    if c["chosen"] is None:
        return f"{name}: no candidate qualifies; {rule}"
    r = rows[c["chosen"]]
    return f"{name}: {c['chosen']} ({r['s_per_step']:.3f} s/step, worst ×{error(r):.2f}); {rule}"


def candidate_rows(rows: dict) -> list[str]:
    """The candidates' names, fastest first (those without a speed last, by name)."""
    return sorted(rows, key=lambda n: (rows[n]["s_per_step"], n))


def report_html(frontier: dict, png: Path) -> str:
    e = html.escape
    img = base64.b64encode(png.read_bytes()).decode()
    rows = frontier["candidates"]
    cases = frontier["made"]["cases"]
    head = "".join(f"<th title='{e(c)}'>{e(c).replace('_', '_<wbr>')}</th>" for c in cases)
    body = []
    for n in candidate_rows(rows):
        r = rows[n]
        per_case = r["quality"].get("cases") or {}
        cells = "".join(f"<td>{_fmt(per_case.get(c, {}).get('error_x_comfyui_sage'))}</td>" for c in cases)
        speed = f"{r['s_per_step']:.3f}" if math.isfinite(r["s_per_step"]) else e(str(r.get("status")))
        worst_median = _fmt(spread(r)) + (" (sparse)" if r.get("sparse") else "")
        body.append(f"<tr><td>{e(n)}</td><td>{speed}</td><td>{_fmt(error(r))}</td><td>{worst_median}</td>{cells}</tr>")
    tiers = "".join(f"<li>{e(tier_line(n, c, rows))}</li>" for n, c in frontier["choices"].items())
    left = "".join(f"<li>{e(n)}: {e(w)}</li>" for n, w in frontier.get("left_out", {}).items()) or "<li>none</li>"
    style = ("<style>body{font-family:sans-serif;max-width:1100px;margin:auto}img{max-width:100%}"
             "table{border-collapse:collapse;font-size:12px;width:100%}td,th{border:1px solid #999;padding:2px 4px}"
             "th{max-width:8em;word-break:break-word}td{text-align:right}td:first-child{text-align:left}</style>")
    return (f"<!doctype html><meta charset=utf-8><title>frontier</title>{style}<h1>Speed / quality frontier</h1>"
            f"<p>{e(frontier['machine'].get('device_name', ''))}; {e(code_line(frontier['made']))}</p>"
            f"<img alt='frontier' src='data:image/png;base64,{img}'><h2>Tiers</h2><ul>{tiers}</ul>"
            f"<h2>Candidates, fastest first (error × ComfyUI+sage per case)</h2>"
            f"<p>worst / median: the worst case over the median case; a sparse candidate takes a tier only while it "
            f"is within ×{SPARSE_SPREAD:g}.</p><table>"
            f"<tr><th>candidate</th><th>s/step</th><th>worst</th><th>worst / median</th>{head}</tr>"
            f"{''.join(body)}</table>"
            f"<h2>Left out here</h2><ul>{left}</ul>")


def _fmt(x) -> str:
    return f"{x:.2f}" if isinstance(x, int | float) and math.isfinite(x) else "–"


def write(frontier: dict, tiers: dict, out: Path) -> dict[str, Path]:
    """frontier.json, tiers.json, frontier.png and report.html of a chosen frontier (`choice.choose_all`) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"frontier": out / "frontier.json", "tiers": out / "tiers.json", "plot": out / "frontier.png",
             "report": out / "report.html"}
    paths["frontier"].write_text(json.dumps(jsonable(frontier), indent=1))
    paths["tiers"].write_text(json.dumps(jsonable(tiers), indent=1))
    plot(frontier["candidates"], frontier["comfyui"], frontier["choices"], paths["plot"])
    paths["report"].write_text(report_html(frontier, paths["plot"]))
    return paths


def jsonable(x):
    """A result as JSON holds it (the benchmarks' results too): keys as strings, tuples as lists, inf as "inf", NaN as
    null, anything else not JSON's as its str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, int | float | str | bool) or x is None:
        return x
    return str(x)
