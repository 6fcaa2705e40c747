"""The speed/quality frontier measured on the machine at hand, and the tiers chosen from it.

    python -m benchmarks.frontier --trace-dir DIR --comfy-root R --out OUT [--candidates F] [--contract C]
        [--steps 3] [--device cuda] [--install]

1. **Candidates** (`frontier-candidates.json`: attention backends, sol_attn's tau, the 8-bit block linears by layer
   set and format, fa3_fp8, the exact backends): each one that cannot run here is left out with one line saying why
   (its backend unavailable, an 8-bit GEMM that would be emulated).
2. **Quality**, on every structured case of the validation set (`parity_tests.validation.structured()`: local
   attention, S >= 5,000, where the approximate modes engage), built and recorded by ComfyUI into `--trace-dir` where
   missing (`--comfy-root`): each candidate's x0 against ComfyUI's fp32 twin, the worse of video and audio, as ×
   ComfyUI+sage's error and × ComfyUI bf16's (`quality.py`); a candidate's figure is its worst case.
3. **Speed**: s/step at the benchmark contract's workload (`run_contract.py`: full-size synthetic weights), in the same
   run as ComfyUI's default and `--use-sage-attention`.
4. **Tiers** (`choose`): per tier, the fastest candidate inside the tier's bound (the exact tier: the fastest exact
   candidate), with a margin for data the choice never saw (`margin`: choose on all cases but one, judge on the one
   left out, the worst such gap over the cases), so a candidate qualifies when its worst case × the margin is inside
   the bound. A tier no candidate qualifies for is left out, with one line.

Writes OUT/frontier.json (every candidate's figures, ComfyUI's, the choices), OUT/tiers.json (what the runtime reads:
`h3direct generate --tier NAME --tiers OUT/tiers.json`; `--install` also copies it to h3direct's cache, the default),
OUT/frontier.png (s/step against worst-case error, Pareto points marked, ComfyUI's two configurations, each tier's
bound as a line) and OUT/report.html (the plot and the tables). `--smoke`: tiny sizes on any device (plumbing).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402  (puts the repo root on sys.path)

PROG = "benchmarks.frontier"
CANDIDATES = HERE / "frontier-candidates.json"
CONTRACT = HERE / "ref2va-960x544-124f.json"
COMFY = ("default", "sage")  # ComfyUI's configurations timed beside the candidates (the contract's names)


# ---------------------------------------------------------------- candidates

def load_grid(path: Path) -> tuple[dict, dict, list[str]]:
    """(candidates, tiers, exact order) of a candidates file."""
    try:
        grid = json.loads(Path(path).read_text())
        return grid["candidates"], grid["tiers"], grid["exact_order"]
    except (OSError, ValueError, KeyError) as exc:
        C.usage_error(f"--candidates {path}: {exc}", PROG)


def expand(spec: dict, exact: str) -> dict:
    """A candidate with `{exact}` replaced by the exact backend that runs here, as a contract path."""
    text = json.dumps(spec).replace("{exact}", exact)
    path = json.loads(text)
    return {"class": "exact" if is_exact_path(path) else "approximate", **path}


def is_exact_path(path: dict) -> bool:
    from h3direct.dit.attention import is_exact

    return path.get("fp8_linear", "off") == "off" and is_exact(C.path_options(path).attention)


def left_out_reason(path: dict, device) -> str | None:
    """Why a candidate cannot run as itself here (None: it can): an attention backend it calls that is unavailable,
    or an 8-bit GEMM that would be emulated."""
    import torch

    from h3direct.checkpoint.quant.w8a8 import gemm_reason
    from h3direct.dit.attention import unavailable_reason
    from h3direct.dit.options import backends_in_effect

    options = C.path_options(path)
    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    for backend in backends_in_effect(options.attention):
        why = unavailable_reason(options.attention.using(backend), like)
        if why is not None:
            return f"{backend}: {why}"
    if options.kernels.fp8_linear != "off" and torch.device(device).type == "cuda":
        why = gemm_reason(options.kernels.fp8_linear_format, device)
        if why is not None:
            return f"{options.kernels.fp8_linear_format} GEMM emulated: {why}"
    return None


def exact_here(order: list[str], device) -> str:
    import torch

    from h3direct.dit.attention import unavailable_reason

    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    return next((b for b in order if unavailable_reason(b, like) is None), "sdpa")


# ---------------------------------------------------------------- the choice

def worst(row: dict, cases: list[str] | None = None) -> float:
    """A candidate's worst error × ComfyUI+sage over `cases` (default: every case it was measured on); inf where it
    has no finite figure on one of them (the worst may be that one: out of every bound)."""
    errs = [row["x_sage"].get(c, math.nan) for c in (row["x_sage"] if cases is None else cases)]
    return max(errs, default=math.inf) if all(math.isfinite(e) for e in errs) else math.inf


def eligible(rows: dict, rule: str) -> dict:
    """The candidates a tier may take: exact ones for the exact tier, every candidate measured everywhere else."""
    return {n: r for n, r in rows.items() if (rule != "exact" or r["exact"]) and math.isfinite(r["s_per_step"])}


def choose(rows: dict, bound: float | None, rule: str, cases: list[str] | None = None,
           margin: float = 1.0) -> str | None:
    """The fastest candidate whose worst error over `cases` × `margin` is within `bound` (exact: the fastest exact
    candidate); None when none qualifies."""
    pool = eligible(rows, rule)
    if rule != "exact":
        pool = {n: r for n, r in pool.items() if worst(r, cases) * margin <= bound}
    return min(pool, key=lambda n: pool[n]["s_per_step"], default=None)


def margin(rows: dict, bound: float, rule: str, cases: list[str]) -> tuple[float, list[dict]]:
    """The worst gap between the case a choice never saw and those it was made on: for each case h, choose on the
    others, then the chosen candidate's error on h / its worst on the others (>= 1 when h was the worse); the margin
    is the largest such gap (1 with a single case: nothing to hold out). Returns (margin, the folds)."""
    folds = []
    for held in cases if len(cases) > 1 else []:
        seen = [c for c in cases if c != held]
        name = choose(rows, bound, rule, seen)
        if name is None or held not in rows[name]["x_sage"]:
            folds.append({"held_out": held, "chosen": name, "gap": None})
            continue
        gap = rows[name]["x_sage"][held] / worst(rows[name], seen)
        folds.append({"held_out": held, "chosen": name, "gap": gap})
    gaps = [f["gap"] for f in folds if f["gap"] is not None]
    return max([1.0, *gaps]), folds


def pareto(rows: dict) -> list[str]:
    """The candidates no other beats on both axes (s/step and worst error × ComfyUI+sage)."""
    pts = {n: (r["s_per_step"], worst(r)) for n, r in rows.items() if math.isfinite(r["s_per_step"])}
    return sorted((n for n, (t, e) in pts.items()
                   if not any(t2 <= t and e2 <= e and (t2, e2) != (t, e) for t2, e2 in pts.values())),
                  key=lambda n: pts[n][0])


def choose_tiers(rows: dict, tiers: dict, cases: list[str]) -> dict:
    """{tier: {"chosen", "margin", "folds", ...}} for every tier of the grid; one line each for a tier that no
    candidate qualifies for."""
    out = {}
    for name, t in tiers.items():
        m, folds = (1.0, []) if t["rule"] == "exact" else margin(rows, t["bound"], t["rule"], cases)
        chosen = choose(rows, t["bound"], t["rule"], cases, m)
        out[name] = {"rule": t["rule"], "bound": t["bound"], "margin": m, "folds": folds, "chosen": chosen}
        if chosen is None:
            C.log(f"tier {name}: no candidate qualifies (bound {t['bound']} x ComfyUI+sage, margin x{m:.3f}: the "
                  f"worst case x the margin must be within the bound)")
        else:
            r = rows[chosen]
            C.log(f"tier {name}: {chosen} ({r['s_per_step']:.3f} s/step, worst x{worst(r):.2f} ComfyUI+sage, "
                  f"margin x{m:.3f})")
    return out


# ---------------------------------------------------------------- measuring

def measure_quality(contract: dict, names: list[str], trace_dir: Path, cases: list[str], device: str,
                    comfy_root: str | None) -> dict:
    """{case: quality.measure's result} over the structured cases (`quality.measure_cases`' per-case results)."""
    import quality

    return quality.measure_cases(contract, names, trace_dir, cases, device, comfy_root)["per_case"]


def measure_speed(contract: dict, names: list[str], args, device: str) -> dict:
    """run_contract on the candidates (one process for h3direct, one per ComfyUI configuration): its result."""
    import run_contract

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


def rows_of(contract: dict, names: list[str], speed: dict, quality: dict) -> dict:
    """{candidate: {s_per_step, exact, x_sage: {case: x}, x_bf16: {case: x}, options}}."""
    rows = {}
    for n in names:
        res = speed["paths"][n]
        x_sage, x_bf16, failed = {}, {}, {}
        for case, q in quality.items():
            p = (q.get("paths") or {}).get(n) or {}
            if p.get("status") == "ok":
                x_sage[case], x_bf16[case] = p["error_x_comfyui_sage"], p["error_x_comfyui_bf16"]
            elif C.any_failed([p.get("status")]):
                failed[case] = p["status"]
        rows[n] = {"s_per_step": res["s_per_step"] if res.get("status") == "ok" else math.inf,
                   "status": res.get("status"), "exact": is_exact_path(contract["paths"][n]),
                   "options": C.path_options(contract["paths"][n]).flat(), "path": contract["paths"][n],
                   "x_sage": x_sage, "x_bf16": x_bf16, "failed": failed}
    return rows


def comfy_rows(speed: dict, quality: dict) -> dict:
    """ComfyUI's configurations: s/step from the speed run, worst error × ComfyUI+sage over the cases."""
    out = {}
    configs = (speed.get("comfyui") or {}).get("configs") or {}
    for name in COMFY:
        x = [q["comfyui"][name]["error_x_comfyui_sage"] for q in quality.values()
             if q.get("status") == "ok" and name in q.get("comfyui", {})]
        c = configs.get(name) or {}
        out[name] = {"s_per_step": c.get("s_per_step") if c.get("status") == "ok" else None,
                     "worst_x_sage": max(x, default=math.nan)}
    return out


# ---------------------------------------------------------------- writing

def tiers_file(machine: dict, rows: dict, choices: dict, comfy: dict, made: dict) -> dict:
    """The runtime's tiers file (`h3direct.app.tiers`, schema h3-tiers/1), with every candidate's figures."""
    from h3direct.app.tiers import SCHEMA
    from h3direct.dit.options import Options

    defaults = Options().flat()
    tiers = {}
    for name, c in choices.items():
        if c["chosen"] is None:
            continue
        r = rows[c["chosen"]]
        options = {k: v for k, v in r["options"].items() if v != defaults[k] or k == "attention"}
        sage = comfy.get("sage", {}).get("s_per_step")
        tiers[name] = {"options": options, "rule": c["rule"], "bound": c["bound"], "candidate": c["chosen"],
                       "s_per_step": r["s_per_step"], "x_comfyui_sage": sage / r["s_per_step"] if sage else None,
                       "error_x_comfyui_sage": worst(r), "error_x_comfyui_bf16": max(r["x_bf16"].values(),
                                                                                     default=math.nan),
                       "margin": c["margin"]}
    return {"schema": SCHEMA, "machine": machine, "made": made, "tiers": tiers,
            "candidates": {n: {k: v for k, v in r.items() if k != "path"} for n, r in rows.items()},
            "comfyui": comfy, "choices": choices}


def plot(rows: dict, comfy: dict, choices: dict, path: Path) -> Path:
    """s/step against worst-case error × ComfyUI+sage (log): every candidate, the Pareto points marked, ComfyUI's
    default and +sage, each tier's bound as a vertical line and its choice ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    front = set(pareto(rows))
    for n, r in rows.items():
        if not math.isfinite(r["s_per_step"]) or not r["x_sage"]:
            continue
        x, y = worst(r), r["s_per_step"]
        ax.scatter([x], [y], s=46 if n in front else 22, c="#1f6fb2" if n in front else "#9aa7b4", zorder=3)
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7, color="#333333")
    xs = [r["x_sage"] for r in rows.values()]
    for name, c in comfy.items():
        if c.get("s_per_step") and math.isfinite(c.get("worst_x_sage", math.nan)):
            ax.scatter([c["worst_x_sage"]], [c["s_per_step"]], marker="s", s=60, c="#d9480f", zorder=4)
            ax.annotate(f"ComfyUI {name}", (c["worst_x_sage"], c["s_per_step"]), textcoords="offset points",
                        xytext=(5, -10), fontsize=8, color="#d9480f")
    for name, c in choices.items():
        if c["bound"] is not None:
            ax.axvline(c["bound"], color="#2b8a3e", lw=1, ls="--", zorder=1)
            ax.annotate(f"{name} bound", (c["bound"], 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                        textcoords="offset points", fontsize=8, color="#2b8a3e")
        if c["chosen"] is not None:
            r = rows[c["chosen"]]
            ax.scatter([worst(r)], [r["s_per_step"]], s=180, facecolors="none", edgecolors="#2b8a3e", lw=2, zorder=5)
    ax.set_xscale("log")
    ax.set_xlabel("worst-case output error × ComfyUI --use-sage-attention's (structured validation cases)")
    ax.set_ylabel("s / step at the contract's workload")
    ax.set_title("speed / quality frontier (blue: Pareto; squares: ComfyUI; rings: the chosen tiers)", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    if not any(xs):
        ax.set_xlim(0.5, 10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def report_html(frontier: dict, png: Path) -> str:
    e = html.escape
    img = base64.b64encode(png.read_bytes()).decode()
    rows = frontier["candidates"]
    cases = sorted({c for r in rows.values() for c in r["x_sage"]})
    head = "".join(f"<th>{e(c)}</th>" for c in cases)
    body = []
    for n, r in sorted(rows.items(), key=lambda kv: kv[1]["s_per_step"]):
        cells = "".join(f"<td>{r['x_sage'].get(c, math.nan):.2f}</td>" for c in cases)
        body.append(f"<tr><td>{e(n)}</td><td>{r['s_per_step']:.3f}</td><td>{worst(r):.2f}</td>{cells}</tr>")
    tiers = "".join(f"<li><b>{e(n)}</b>: {e(str(c['chosen']))} (bound {c['bound']}, margin ×{c['margin']:.3f})</li>"
                    for n, c in frontier["choices"].items())
    left = "".join(f"<li>{e(n)}: {e(w)}</li>" for n, w in frontier["left_out"].items())
    return (f"<!doctype html><meta charset=utf-8><title>frontier</title><h1>Speed / quality frontier</h1>"
            f"<p>{e(frontier['machine'].get('device_name', ''))}, commit {e(str(frontier['made'].get('commit')))}</p>"
            f"<img alt='frontier' src='data:image/png;base64,{img}'><h2>Tiers</h2><ul>{tiers}</ul>"
            f"<h2>Candidates (error × ComfyUI+sage per case)</h2><table border=1 cellspacing=0 cellpadding=3>"
            f"<tr><th>candidate</th><th>s/step</th><th>worst</th>{head}</tr>{''.join(body)}</table>"
            f"<h2>Left out here</h2><ul>{left}</ul>")


# ---------------------------------------------------------------- the command

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    ap.add_argument("--trace-dir", required=True, type=Path, help="the validation set's folder (recorded where missing)")
    ap.add_argument("--out", required=True, type=Path, help="where frontier.json, tiers.json, the plot and report go")
    ap.add_argument("--comfy-root", default=None, help="ComfyUI checkout: record missing cases, time ComfyUI")
    ap.add_argument("--candidates", default=CANDIDATES, type=Path)
    ap.add_argument("--contract", default=CONTRACT, type=Path, help="the workload, weights and ComfyUI configurations")
    ap.add_argument("--case", action="append", default=None,
                    help="a validation case (repeatable; default: the contract's quality cases, every structured case "
                         "of the validation set)")
    ap.add_argument("--candidate", action="append", default=None, metavar="NAME",
                    help="measure only these candidates of the file (repeatable; default: all)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per candidate (default 3)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--install", action="store_true", help="also copy tiers.json to h3direct's cache (the default "
                    "tiers file of `--tier`)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device (a plumbing check, not a result)")
    args = ap.parse_args(argv)
    import quality

    from h3direct.app.tiers import device_name
    from parity_tests import validation

    candidates, tiers, order = load_grid(args.candidates)
    unknown = [n for n in args.candidate or [] if n not in candidates]
    if unknown:
        C.usage_error(f"--candidate {unknown[0]}: not in {args.candidates} ({', '.join(candidates)})", PROG)
    candidates = {n: c for n, c in candidates.items() if not args.candidate or n in args.candidate}
    try:
        contract = json.loads(args.contract.read_text())
    except (OSError, ValueError) as exc:
        C.usage_error(f"--contract {args.contract}: {exc}", PROG)
    dev = C.run_device(args)
    exact = exact_here(order, dev)
    paths, left_out = {}, {}
    for name, spec in candidates.items():
        path = expand(spec, exact)
        why = left_out_reason(path, dev)
        if why is None:
            paths[name] = path
        else:
            left_out[name] = why
            C.log(f"left out {name}: {why}")
    if not paths:
        C.usage_error("no candidate runs here", PROG)
    contract = {**contract, "paths": paths, "targets": {},
                "comfyui": {k: v for k, v in contract.get("comfyui", {}).items() if k in COMFY}}
    cases = args.case or quality.cases_of(contract.get("quality"))
    names = list(paths)
    if args.comfy_root:  # the cases not recorded yet, built and recorded at once (bf16, fp32 twin, sage)
        known = {c.name for c in validation.CASES}
        missing = [c for c in cases if c in known and _unrecorded(args.trace_dir, c)]
        if missing:
            validation.build(args.trace_dir, device=str(dev), only=missing)
            validation.record(args.trace_dir, args.comfy_root, device=str(dev), jobs=8, only=missing, sage=True)
    quality = measure_quality(contract, names, args.trace_dir, cases, str(dev), args.comfy_root)
    missing = {c: q["status"] for c, q in quality.items() if q.get("status") != "ok"}
    for c, why in missing.items():
        C.log(f"case {c}: {why}")
    measured = [c for c in cases if c not in missing]
    if not measured:
        C.usage_error("no structured case was measured (record them: --comfy-root)", PROG)
    speed = measure_speed(contract, names, args, str(dev))
    rows = rows_of(contract, names, speed, {c: quality[c] for c in measured})
    comfy = comfy_rows(speed, {c: quality[c] for c in measured})
    choices = choose_tiers(rows, tiers, measured)
    env = speed.get("env", {})
    machine = {"device_name": device_name(dev), "capability": env.get("capability"),
               "packages": env.get("packages"), "cuda": env.get("cuda"), "smoke": args.smoke}
    made = {"commit": speed.get("commit"), "tree": speed.get("tree"), "date": speed.get("date"),
            "command": ["python", "-m", PROG, *(argv if argv is not None else sys.argv[1:])],
            "cases": measured, "steps": args.steps, "workload": speed.get("workload")}
    args.out.mkdir(parents=True, exist_ok=True)
    tiers_out = tiers_file(machine, rows, choices, comfy, made)
    frontier = {**tiers_out, "left_out": left_out, "pareto": pareto(rows), "quality": quality,
                "comfyui_speed": speed.get("comfyui")}
    C.write_result(args.out / "frontier.json", frontier)
    C.write_result(args.out / "tiers.json", tiers_out)
    png = plot(rows, comfy, choices, args.out / "frontier.png")
    (args.out / "report.html").write_text(report_html(frontier, png))
    if args.install:
        from h3direct.app.tiers import default_path

        default_path().parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(args.out / "tiers.json", default_path())
        C.log(f"installed: {default_path()}")
    C.log(f"frontier: {args.out / 'frontier.json'}, tiers: {args.out / 'tiers.json'}, plot: {png}, "
          f"report: {args.out / 'report.html'}")
    failures = {n: s for n, r in rows.items() for s in C.any_failed([r["status"], *r["failed"].values()])}
    for name, status in failures.items():
        C.log(f"candidate {name} {status} (not chosen; the run exits 1)")
    return 1 if failures else 0


def _unrecorded(root: Path, name: str) -> bool:
    import quality

    case = quality.find_case(root, name)
    return case is None or case.sage_twin is None


if __name__ == "__main__":
    raise SystemExit(main())
