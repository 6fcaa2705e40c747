"""A path's quality over cases: the one result format the frontier and the benchmark contract share.

Per case, a path's figures (`x_comfyui_bf16`, `x_comfyui_sage`: video and audio; `error_x_comfyui_bf16`,
`error_x_comfyui_sage`: the worse output) as multiples of ComfyUI bf16's and ComfyUI+sage's own error against
ComfyUI's fp32 twin, or the case's status where it has none; over the cases, the worst of each metric and where. A
case without a finite figure leaves no worst: the worst case may be the one missing.
"""

from __future__ import annotations

import math

METRICS = ("error_x_comfyui_bf16", "error_x_comfyui_sage")
FIGURES = ("x_comfyui_bf16", "x_comfyui_sage", *METRICS)


def number(x) -> float | None:
    """x as a float when it is a finite JSON number (not a bool, a string, inf or NaN), else None."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


def worst(entry, cases: list[str], metric: str) -> tuple[float | None, str]:
    """(the worst of `metric` over `cases`, where it was) of one path's quality over cases (`over_cases`), or (None,
    why not): a case without a finite figure leaves none, since the worst case may be the one missing."""
    if not isinstance(entry, dict):
        return None, "quality not measured"
    per_case = entry.get("cases")
    if not isinstance(per_case, dict):
        status = entry.get("status", "ok")
        return None, status if status != "ok" else "no figure per case (a result of a one-case contract)"
    values = {}
    for case in cases:
        raw = (per_case.get(case) or {}).get(metric)
        values[case] = number(raw)
        if values[case] is None:
            why = (per_case.get(case) or {}).get("status") or f"{metric} {raw!r} is not a finite number"
            return None, f"case {case}: {why}"
    if not values:
        return None, "no case"
    case = max(values, key=values.get)
    return values[case], f"worst case {case}"


def over_cases(per_case: dict[str, dict]) -> dict:
    """One path's (or ComfyUI configuration's) quality over cases: {case: its figures on it} (a case's status where
    it was not measured), the worst of each metric and where; status ok only when every case was measured."""
    cases = {c: ({k: q[k] for k in FIGURES} if q.get("status", "ok") == "ok" else {"status": q.get("status")})
             for c, q in per_case.items()}
    out = {"cases": cases}
    for metric in METRICS:
        v, where = worst(out, list(cases), metric)
        out[metric] = v
        if v is None:
            out["status"] = where
        else:
            out.setdefault("worst_case", {})[metric] = where.removeprefix("worst case ")
    out.setdefault("status", "ok")
    return out


def by_path(measured: dict[str, dict], kind: str = "paths", names: list[str] | None = None) -> dict[str, dict]:
    """{name: `over_cases`} of each of `names` (default: every one measured) among the paths (kind "paths") or the
    ComfyUI configurations (kind "comfyui") of per-case measurements ({case: {"status", "paths": {name: figures},
    "comfyui": {config: figures}}}); a case that was not measured is each one's status there, and a name a measured
    case lacks is "not measured" there."""
    if names is None:
        names = sorted({n for q in measured.values() for n in (q.get(kind) or {})})

    def of(name: str) -> dict:
        return {c: (q[kind].get(name) or {"status": "not measured"}) if q.get("status") == "ok" else
                {"status": q.get("status")} for c, q in measured.items()}

    return {n: over_cases(of(n)) for n in names}
