"""The frontier's measurements on the machine at hand, and the tiers chosen from them (README, "Choosing tiers on
your GPU"; the grid, the choice and the report: `h3direct.app.frontier`).

    python -m benchmarks.frontier --trace-dir DIR --comfy-root R --out OUT [--case NAME ...] [--candidate NAME ...]
        [--contract C] [--steps 3] [--time-all] [--device cuda] [--install]

Each candidate of the grid that runs here (one line for each that does not): its quality on every structured case of
the validation set (built and recorded by ComfyUI where missing) and the user's own cases in DIR (`quality.py`), its
s/step at the contract's workload in the same run as ComfyUI's (`run_contract.py`), unless its quality lets it take
no tier (`choice.not_worth_timing`: its speed cannot change a choice; `--time-all` times it too). OUT gets
frontier.json, tiers.json (`--install`: also the runtime's default), frontier.png and report.html. `--smoke`: tiny
sizes (plumbing).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from benchmarks import _common as C
from benchmarks import quality, run_contract
from h3direct.app.frontier import choice, grid, report

PROG = "benchmarks.frontier"
CONTRACT = Path(__file__).resolve().parent / "ref2va-960x544-124f.json"


def measure_speed(contract: dict, names: list[str], args, device: str) -> dict:
    """run_contract on the candidates (one process for h3direct, one per ComfyUI configuration): its result."""
    with tempfile.TemporaryDirectory(prefix="h3_frontier_") as tmp:
        path, out = Path(tmp) / "contract.json", Path(tmp) / "speed.json"
        path.write_text(json.dumps(contract))
        argv = ["--contract", str(path), "--out", str(out), "--paths", ",".join(names), "--device", device,
                "--floor-seconds", "0", "--no-vae", "--comfy-rounds", "1"]
        argv += ["--steps", str(args.steps)] + (["--comfy-root", args.comfy_root] if args.comfy_root else [])
        argv += ["--smoke"] if args.smoke else []
        rc = run_contract.main(argv)  # 1 with a result: some paths failed, each one's status says how
        if rc not in (0, 1) or not out.is_file():
            raise SystemExit(f"{PROG}: the speed run failed (run_contract exit {rc})")
        return json.loads(out.read_text())


def cases_here(args, contract: dict) -> list[str]:
    """--case, else the contract's quality cases and the user's own cases in --trace-dir (one line for each folder
    there that does not count, with why)."""
    from parity_tests import validation

    if args.case:
        return args.case
    own, others = validation.own_cases(args.trace_dir)
    for name, why in others.items():
        C.log(f"your case {name}: not counted ({why})")
    for name in own:
        C.log(f"your case {name}: counted with the structured cases")
    return quality.cases_of(contract.get("quality")) + own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    ap.add_argument("--trace-dir", required=True, type=Path, help="the validation set's folder (recorded where missing)")
    ap.add_argument("--out", required=True, type=Path, help="where frontier.json, tiers.json, the plot and report go")
    ap.add_argument("--comfy-root", default=None, help="ComfyUI checkout: record missing cases, time ComfyUI")
    ap.add_argument("--contract", default=CONTRACT, type=Path, help="the workload, weights and ComfyUI configurations")
    ap.add_argument("--case", action="append", default=None,
                    help="a case (repeatable; default: the contract's quality cases, every structured case of the "
                         "validation set, and your own cases in --trace-dir)")
    ap.add_argument("--candidate", action="append", default=None, metavar="NAME",
                    help="measure only these candidates of the grid (repeatable; default: all)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per candidate (default 3)")
    ap.add_argument("--time-all", action="store_true", help="time every candidate (default: those whose quality "
                    "lets them take a tier, the only ones whose speed can change a choice)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--install", action="store_true", help="also copy tiers.json to h3direct's cache (the default "
                    "tiers file of `--tier`)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device (a plumbing check, not a result)")
    args = ap.parse_args(argv)
    from h3direct.app.tiers import TIERS, device_name, install

    try:
        contract = json.loads(args.contract.read_text())
    except (OSError, ValueError) as exc:
        C.usage_error(f"--contract {args.contract}: {exc}", PROG)
    dev = C.run_device(args)
    candidates = grid.expand(grid.available_on(dev))
    unknown = [n for n in args.candidate or [] if n not in candidates]
    if unknown:
        C.usage_error(f"--candidate {unknown[0]}: not a candidate here ({', '.join(candidates)})", PROG)
    paths, left_out = {}, {}
    for name, path in candidates.items():
        if args.candidate and name not in args.candidate:
            continue
        why = grid.left_out_reason(path, dev)
        if why is None:
            paths[name] = path
        else:
            left_out[name] = why
            C.log(f"left out {name}: {why}")
    if not paths:
        C.usage_error("no candidate runs here", PROG)
    contract = {**contract, "paths": paths, "targets": {},
                "comfyui": {k: v for k, v in contract.get("comfyui", {}).items() if k in choice.COMFY}}
    cases, names = cases_here(args, contract), list(paths)
    q = quality.measure_cases(contract, names, args.trace_dir, cases, str(dev), args.comfy_root)["per_case"]
    for c, m in q.items():
        if m.get("status") != "ok":
            C.log(f"case {c}: {m['status']}")
    measured = [c for c in cases if q[c].get("status") == "ok"]
    if not measured:
        C.usage_error("no case was measured (record the structured cases: --comfy-root)", PROG)
    found = {"candidates": {n: {"exact": grid.is_exact(paths[n]), "options": grid.options_of(paths[n]).flat(),
                                "path": paths[n]} for n in names}, "quality": q, "made": {"cases": measured}}
    untimed = {} if args.time_all else choice.not_worth_timing(found, TIERS)
    if len(untimed) == len(names):  # none could take a tier: time them all, the run's figures are then all it gives
        untimed = {}
    for name, why in untimed.items():
        C.log(f"not timed {name}: qualifies for no tier ({why})")
    speed = measure_speed(contract, [n for n in names if n not in untimed], args, str(dev))
    env = speed.get("env", {})
    timed = {n: {"s_per_step": math.inf, "status": f"not timed: qualifies for no tier ({untimed[n]})"}
             if n in untimed else {"s_per_step": speed["paths"][n].get("s_per_step", math.inf),
                                   "status": speed["paths"][n].get("status")}
             for n in names}
    record = {"machine": {"device_name": device_name(dev), "capability": env.get("capability"),
                          "packages": env.get("packages"), "cuda": env.get("cuda"), "smoke": args.smoke},
              "made": {"commit": speed.get("commit"), "tree": speed.get("tree"), "date": speed.get("date"),
                       "command": ["python", "-m", PROG, *(argv if argv is not None else sys.argv[1:])],
                       "cases": measured, "steps": args.steps, "workload": speed.get("workload")},
              "candidates": {n: {**timed[n], **c} for n, c in found["candidates"].items()},
              "quality": q, "comfyui_speed": speed.get("comfyui"), "left_out": left_out}
    frontier, tiers = choice.choose_all(record, C.log)
    written = report.write(frontier, tiers, args.out)
    if args.install:
        C.log(f"installed: {install(written['tiers'])}")
    C.log(", ".join(f"{k}: {v}" for k, v in written.items()))
    failures = {n: s for n, r in frontier["candidates"].items()
                for s in C.any_failed([r["status"], *choice.failed_cases(r).values()])}
    for name, status in failures.items():
        C.log(f"candidate {name} {status} (not chosen; the run exits 1)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
