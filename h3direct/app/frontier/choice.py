"""The choice of tiers from a frontier's measurements: per tier of `app.tiers.TIERS`, the fastest candidate inside
the tier's bound, with a margin for data the choice never saw.

The measurements (`rows_of`): per candidate its s/step at the contract's workload and its quality over the cases
(`cases.over_cases` of the per-case figures); ComfyUI's configurations likewise (`comfy_rows`). A candidate's error is
its worst case × ComfyUI+sage's error (`error`). The margin (`margin`): choose on all cases but one, judge on the one
left out, the worst such gap over the cases; a candidate qualifies when its worst case × the margin is inside the
bound. A sparse candidate (an attention backend that drops key blocks) qualifies only while its error is even over
the cases it is chosen on (`spread`, within `tiers.SPARSE_SPREAD`). The exact tier takes the fastest exact
candidate. A tier no candidate qualifies for is left out, with one line. A candidate whose quality qualifies it for
no tier, over the cases or any fold of them, is never chosen whatever its speed (`not_worth_timing`: the frontier
does not time it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from h3direct.app.frontier import cases as Q

COMFY = ("default", "sage")  # ComfyUI's configurations timed beside the candidates (the contract's names)
SAGE = "error_x_comfyui_sage"


def rows_of(frontier: dict) -> dict:
    """{candidate: {s_per_step, status, exact, options, quality}} of a frontier's measurements: its candidates' speed
    (`candidates`: s_per_step, status, exact, options) and their quality over its cases (`cases.by_path` of the
    per-case measurements, `quality`, on the cases `made.cases`)."""
    cases = frontier["made"]["cases"]
    measured = {c: frontier["quality"][c] for c in cases}
    quality = Q.by_path(measured, "paths", list(frontier["candidates"]))
    rows = {}
    for name, c in frontier["candidates"].items():
        s = Q.number(c.get("s_per_step"))
        rows[name] = {"s_per_step": s if s is not None and c.get("status") == "ok" else math.inf,
                      "status": c.get("status"), "exact": c["exact"], "sparse": sparse(c["options"]),
                      "options": c["options"], "quality": quality[name]}
    return rows


def not_worth_timing(frontier: dict, tiers: dict) -> dict[str, str]:
    """{candidate: why} of the candidates whose speed cannot change a choice, by their quality alone (a frontier's
    `candidates` without speeds, its `quality` and `made.cases`; `tiers` {name: (rule, bound)}): every choice takes
    the fastest candidate that qualifies, so one that is not exact and qualifies for no tier's bound over the cases,
    nor over any fold's (`margin`'s held-out choices, at margin 1, the loosest a choice applies), is never taken."""
    rows = rows_of({**frontier, "candidates": {n: {**c, "s_per_step": 0.0, "status": "ok"}
                                               for n, c in frontier["candidates"].items()}})
    cases = frontier["made"]["cases"]
    seen = [cases, *(others for _, others in folds(cases))]
    bounds = [bound for rule, bound in tiers.values() if rule != "exact"]
    out = {}
    for name, r in rows.items():
        if r["exact"] or any(qualifies(r, b, s) for b in bounds for s in seen):
            continue
        why = f"worst x{error(r):.2f} ComfyUI+sage"
        out[name] = why + (f", worst / median {spread(r):.2f}" if r["sparse"] else "")
    return out


def sparse(options: dict) -> bool:
    """Whether a candidate's attention (its flat options' `attention`) drops key blocks (`attention.is_sparse`)."""
    from h3direct.dit.attention import is_sparse
    from h3direct.dit.options import Options

    return is_sparse(Options.from_flat(options).attention)


def comfy_rows(frontier: dict) -> dict:
    """ComfyUI's configurations: s/step from the speed run (`comfyui_speed`), their worst error × ComfyUI+sage over
    the cases (NaN where a case lacks it)."""
    cases = frontier["made"]["cases"]
    quality = Q.by_path({c: frontier["quality"][c] for c in cases}, "comfyui", list(COMFY))
    configs = (frontier.get("comfyui_speed") or {}).get("configs") or {}
    out = {}
    for name in COMFY:
        c = configs.get(name) or {}
        worst, _ = Q.worst(quality[name], cases, SAGE)
        out[name] = {"s_per_step": c.get("s_per_step") if c.get("status") == "ok" else None,
                     "worst_x_sage": math.nan if worst is None else worst}
    return out


def error(row: dict, cases: list[str] | None = None) -> float:
    """A candidate's worst error × ComfyUI+sage over `cases` (default: every case it was measured on); inf where it
    has no finite figure on one of them (the worst may be that one: out of every bound)."""
    q = row["quality"]
    worst, _ = Q.worst(q, list(q.get("cases") or {}) if cases is None else cases, SAGE)
    return math.inf if worst is None else worst


def spread(row: dict, cases: list[str] | None = None) -> float:
    """A candidate's worst case over its median case (error × ComfyUI+sage, over `cases`, default every case it was
    measured on): 1 where every case errs alike; inf where a case has no finite figure."""
    q = row["quality"]
    per = [error(row, [c]) for c in (list(q.get("cases") or {}) if cases is None else cases)]
    if not per or not all(math.isfinite(e) for e in per):
        return math.inf
    med = statistics.median(per)
    return max(per) / med if med > 0 else (1.0 if max(per) == 0 else math.inf)


def failed_cases(row: dict) -> dict[str, str]:
    """{case: status} of the cases where the candidate's measurement failed (raised)."""
    return {c: q["status"] for c, q in (row["quality"].get("cases") or {}).items()
            if str(q.get("status", "")).startswith("failed: ")}


def eligible(rows: dict, rule: str) -> dict:
    """The candidates a tier may take: exact ones for the exact tier, every candidate timed everywhere else."""
    return {n: r for n, r in rows.items() if (rule != "exact" or r["exact"]) and math.isfinite(r["s_per_step"])}


def choose(rows: dict, bound: float | None, rule: str, cases: list[str] | None = None,
           margin: float = 1.0) -> str | None:
    """The fastest candidate whose worst error over `cases` × `margin` is within `bound`, a sparse one only while its
    spread over `cases` is within `SPARSE_SPREAD` (exact: the fastest exact candidate); None when none qualifies."""
    pool = eligible(rows, rule)
    if rule != "exact":
        pool = {n: r for n, r in pool.items() if qualifies(r, bound, cases, margin)}
    return min(pool, key=lambda n: pool[n]["s_per_step"], default=None)


def qualifies(row: dict, bound: float, cases: list[str] | None = None, margin: float = 1.0) -> bool:
    """Whether a candidate's worst error over `cases` × `margin` is within `bound`, and, a sparse one, its spread
    over them within `SPARSE_SPREAD`."""
    from h3direct.app.tiers import SPARSE_SPREAD

    return error(row, cases) * margin <= bound and not (row["sparse"] and spread(row, cases) > SPARSE_SPREAD)


def margin(rows: dict, bound: float, rule: str, cases: list[str]) -> tuple[float, list[dict]]:
    """The worst gap between the case a choice never saw and those it was made on: for each case h, choose on the
    others, then the chosen candidate's error on h / its worst on the others (>= 1 when h was the worse); the margin
    is the largest such gap (1 with a single case: nothing to hold out). Returns (margin, the folds)."""
    out = []
    for held, seen in folds(cases):
        name = choose(rows, bound, rule, seen)
        on_held = error(rows[name], [held]) if name is not None else math.inf
        gap = on_held / error(rows[name], seen) if math.isfinite(on_held) else None
        out.append({"held_out": held, "chosen": name, "gap": gap})
    gaps = [f["gap"] for f in out if f["gap"] is not None]
    return max([1.0, *gaps]), out


def folds(cases: list[str]) -> list[tuple[str, list[str]]]:
    """The leave-one-out folds of `cases`: (the case held out, the others) for each, none for a single case."""
    return [(held, [c for c in cases if c != held]) for held in (cases if len(cases) > 1 else [])]


def pareto(rows: dict) -> list[str]:
    """The candidates no other beats on both axes (s/step and worst error × ComfyUI+sage), fastest first."""
    pts = {n: (r["s_per_step"], error(r)) for n, r in rows.items() if math.isfinite(r["s_per_step"])}
    return sorted((n for n, (t, e) in pts.items()
                   if not any(t2 <= t and e2 <= e and (t2, e2) != (t, e) for t2, e2 in pts.values())),
                  key=lambda n: pts[n][0])


def choose_tiers(rows: dict, tiers: dict, cases: list[str], log: Callable[[str], None] = print) -> dict:
    """{tier: {"rule", "bound", "margin", "folds", "chosen"}} for every tier of `tiers` ({name: (rule, bound)}); one
    line each (`log`) for the choice, or for a tier that no candidate qualifies for."""
    out = {}
    for name, (rule, bound) in tiers.items():
        m, folds = (1.0, []) if rule == "exact" else margin(rows, bound, rule, cases)
        chosen = choose(rows, bound, rule, cases, m)
        out[name] = {"rule": rule, "bound": bound, "margin": m, "folds": folds, "chosen": chosen}
        if chosen is None:
            log(f"tier {name}: no candidate qualifies (bound {bound} x ComfyUI+sage, margin x{m:.3f}: the worst case x "
                f"the margin must be within the bound)")
        else:
            r = rows[chosen]
            log(f"tier {name}: {chosen} ({r['s_per_step']:.3f} s/step, worst x{error(r):.2f} ComfyUI+sage, margin "
                f"x{m:.3f})")
    return out


def tiers_file(frontier: dict, rows: dict, choices: dict, comfy: dict) -> dict:
    """The runtime's tiers file (`app.tiers`, schema h3-tiers/1): per chosen tier its options (those that differ from
    the defaults, and the attention backend), rule, bound and figures, with every candidate's figures."""
    from h3direct.app.tiers import SCHEMA
    from h3direct.dit.options import Options

    defaults = Options().flat()
    sage = comfy.get("sage", {}).get("s_per_step")
    tiers = {}
    for name, c in choices.items():
        if c["chosen"] is None:
            continue
        r = rows[c["chosen"]]
        tiers[name] = {"options": {k: v for k, v in r["options"].items() if v != defaults[k] or k == "attention"},
                       "rule": c["rule"], "bound": c["bound"], "candidate": c["chosen"], "s_per_step": r["s_per_step"],
                       "x_comfyui_sage": sage / r["s_per_step"] if sage else None,
                       SAGE: error(r), "error_x_comfyui_bf16": r["quality"].get("error_x_comfyui_bf16"),
                       "margin": c["margin"]}
    return {"schema": SCHEMA, "machine": frontier["machine"], "made": frontier["made"], "tiers": tiers,
            "candidates": rows, "comfyui": comfy, "choices": choices}


def choose_all(frontier: dict, log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """(the frontier with its choice, the tiers file) of a frontier's measurements, by the tiers of `app.tiers`."""
    from h3direct.app.tiers import TIERS

    rows, comfy = rows_of(frontier), comfy_rows(frontier)
    choices = choose_tiers(rows, TIERS, frontier["made"]["cases"], log)
    tiers = tiers_file(frontier, rows, choices, comfy)
    return {**frontier, **tiers, "pareto": pareto(rows)}, tiers
