"""Check a benchmark result against its contract: one line per (path, metric), pass or MISS; exit 1 on any miss.

    python -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f.json --result R.json

Targets (contract["targets"][path][metric]) are {"max": x} or {"min": x}. `x_comfyui` is ComfyUI's s/step measured
in the same run divided by the path's s/step; a result without a same-run ComfyUI measurement cannot meet a ratio
target (it is reported as a miss, never divided by a stored constant). A metric the result lacks is a miss.
Exit codes: 0 every target met, 1 a miss, 2 bad input (unreadable file, wrong contract).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: str, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SystemExit(_bad(f"--{what} {path}: cannot read ({exc.strerror})")) from None
    except json.JSONDecodeError as exc:
        raise SystemExit(_bad(f"--{what} {path}: not JSON ({exc.msg} at line {exc.lineno})")) from None
    if not isinstance(data, dict):
        raise SystemExit(_bad(f"--{what} {path}: expected a JSON object"))
    return data


def _bad(msg: str) -> int:
    print(f"benchmarks.compare: error: {msg}", file=sys.stderr)
    return 2


def value_of(result: dict, path: str, metric: str) -> tuple[float | None, str]:
    """(value, note) of one metric of one path; None when the result cannot provide it."""
    p = (result.get("paths") or {}).get(path)
    if not isinstance(p, dict):
        return None, f"path {path!r} not in the result"
    if p.get("status", "ok") != "ok":
        return None, f"path {path!r}: {p.get('status')}"
    if metric == "x_comfyui":
        comfy = result.get("comfyui")
        if not isinstance(comfy, dict) or not comfy.get("s_per_step"):
            return None, result.get("comfyui_note") or "no same-run ComfyUI"
        ours = p.get("s_per_step")
        if not ours:
            return None, "no s_per_step"
        return comfy["s_per_step"] / ours, f"ComfyUI {comfy['s_per_step']:.3f} s/step in the same run"
    v = p.get(metric)
    if not isinstance(v, int | float):
        return None, f"{metric} not measured"
    return float(v), ""


def compare(contract: dict, result: dict) -> list[dict]:
    rows = []
    for path, targets in contract["targets"].items():
        if not isinstance(targets, dict):
            continue  # "device"
        for metric, bound in targets.items():
            v, note = value_of(result, path, metric)
            if "max" in bound:
                op, limit = "<=", bound["max"]
                ok = v is not None and v <= limit
            else:
                op, limit = ">=", bound["min"]
                ok = v is not None and v >= limit
            rows.append({"path": path, "metric": metric, "value": v, "op": op, "limit": limit, "passed": ok,
                         "note": note})
    return rows


def gpu_conditions(result: dict) -> list[tuple[str, dict]]:
    """(path or "comfyui", clocks/power summary) for every timed run the result sampled (run_contract's
    `gpu_clock_power`): a step held at the board's power cap runs below the clock its kernels reach alone."""
    found = [(name, p.get("gpu_clock_power")) for name, p in (result.get("paths") or {}).items()]
    found.append(("comfyui", (result.get("comfyui") or {}).get("gpu_clock_power")))
    return [(n, g) for n, g in found if isinstance(g, dict) and "sm_clock_mhz_median" in g]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n")[0])
    ap.add_argument("--contract", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    try:
        contract = _load(args.contract, "contract")
        result = _load(args.result, "result")
    except SystemExit as exc:
        return int(exc.code)
    if not isinstance(contract.get("targets"), dict):
        return _bad(f"--contract {args.contract}: no 'targets' object")
    if result.get("contract") != contract.get("contract"):
        return _bad(f"--result {args.result} is for contract {result.get('contract')!r}, "
                    f"not {contract.get('contract')!r}")
    want_dev, got_dev = contract["targets"].get("device"), result.get("device")
    if want_dev and got_dev and want_dev not in str(got_dev):
        print(f"note: targets are for {want_dev}; this result ran on {got_dev}")
    rows = compare(contract, result)
    for r in rows:
        v = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        status = "pass" if r["passed"] else "MISS"
        extra = f"  ({r['note']})" if r["note"] else ""
        print(f"{status:4s} {r['path']:12s} {r['metric']:14s} {v:>8s} {r['op']} {r['limit']:g}{extra}")
    for name, gp in gpu_conditions(result):
        print(f"info {name:12s} SM clock median {gp['sm_clock_mhz_median']:.0f} MHz (max seen "
              f"{gp['sm_clock_mhz_max']:.0f}), power median {gp['power_w_median']:.0f} of {gp['power_limit_w']:.0f} W, "
              f"at the power cap in {100 * gp['power_capped_share']:.0f} % of samples")
    missed = sum(not r["passed"] for r in rows)
    print(f"{len(rows) - missed} of {len(rows)} targets met" + (f", {missed} missed" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
