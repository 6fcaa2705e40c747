"""The contract's quality axis: how far each path's output is from fp32, next to ComfyUI's own, on the structured
cases of the validation set recorded on the same GPU; a path's figure is its worst case.

    python -m benchmarks.quality --contract benchmarks/ref2va-960x544-124f.json --trace-dir DIR [--case NAME ...]
        [--paths a,b] [--comfy-root R] [--device cuda] [--out Q.json]

A path (an entry of the contract's "paths": attention backend, options, FP8 linears) runs one denoiser step of a
case with its own options (`h3direct.traces.evaluate.one_step`, the free run the gate makes) and its x0
(`sampler.denoised.video` / `.audio`) is measured against ComfyUI's fp32 twin of the case (rel-L2), in units of
ComfyUI bf16's own error against the same twin (`x_comfyui_bf16`) and of ComfyUI `--use-sage-attention`'s
(`x_comfyui_sage`), both recorded beside the case (`parity_tests.validation record`; `--comfy-root` records a
case that is missing). The path's figures on a case are the worse of its two outputs; over the contract's cases
(`contract["quality"]["cases"]`: a list of names, or "structured" for every structured case of the validation set,
`parity_tests.validation.structured()`) they are the worst case, and a case that was not measured leaves the path
without a figure (`h3direct.app.frontier.cases`, the format the frontier shares). ComfyUI's configurations get the same measurement from their recordings: the default is
ComfyUI bf16 (1 by definition), sage its sage recording.
`run_contract --quality-dir DIR` and the frontier run this after their timings, on the same GPU; this CLI measures
any cases (default: the contract's) and paths.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks import _common as C
from h3direct.app.frontier.cases import by_path
from h3direct.app.frontier.grid import options_of

OUTPUTS = ("video", "audio")
PROG = "benchmarks.quality"


def record_missing(root: Path, names: list[str], comfy_root: str, device: str) -> None:
    """Build and record, all at once, the cases of `names` that are cases of the validation set and are not recorded
    in `root` with their fp32 twin and sage recording (bf16, fp32 twin, --use-sage-attention; ComfyUI at `comfy_root`)."""
    from parity_tests import validation

    known = {c.name for c in validation.CASES}
    missing = [n for n in names if n in known and validation.judgeable(root / n)[0] is None]
    if missing:
        validation.build(root, device=device, only=missing)
        validation.record(root, comfy_root, device=device, jobs=8, only=missing, sage=True)


def recorded_case(root: Path, name: str):
    """(the bf16 case `root/name` with ComfyUI's fp32 twin and sage recording, None) or (None, why not)."""
    from parity_tests import validation

    case, why = validation.judgeable(root / name)
    if case is None:
        known = name in {c.name for c in validation.CASES}
        how = "record it: --comfy-root" if known else "not a case of the validation set either"
        return None, f"{root / name}: {why} ({how})"
    return case, None


def _figures(points: dict, key: str) -> dict:
    """{video: x, audio: x, worst: x} of one row of `ladder.measure`'s points: `key` err / ComfyUI bf16 and / sage."""
    x_bf16, x_sage = {}, {}
    for stream in OUTPUTS:
        p = points.get(f"sampler.denoised.{stream}")
        if p is None:
            continue
        err = getattr(p, key)
        x_bf16[stream] = err / p.comfy if p.comfy > 0 else math.nan
        x_sage[stream] = err / p.sage if p.sage > 0 else math.nan
    return {"x_comfyui_bf16": x_bf16, "x_comfyui_sage": x_sage,
            "error_x_comfyui_bf16": max(x_bf16.values(), default=math.nan),
            "error_x_comfyui_sage": max(x_sage.values(), default=math.nan)}


def measure_path(case, options, device: str) -> dict:
    """One path's quality on `case` (module docstring): its options' weights (FP8 linears as asked), one step."""
    import torch

    from h3direct.dit.attention import unavailable_reason
    from h3direct.dit.loader import load_dit
    from h3direct.traces.evaluate import one_step
    from h3direct.traces.inputs import load_inputs
    from parity_tests import ladder
    from parity_tests.models import nvfp4_mode

    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    reason = unavailable_reason(options.attention, like)
    if reason is not None:
        return {"status": f"unavailable: {reason}"}
    model = load_dit(case.checkpoint, compute_dtype=case.compute, nvfp4_mode=nvfp4_mode(case), device=device,
                     **options.kernels.load_time())
    with torch.inference_mode():
        out = one_step(model, load_inputs(case.inputs), backend=options, device=device)
    points = ladder.measure(out, ladder.references(case))
    del model
    C.free_memory(device)
    err = {s: points[f"sampler.denoised.{s}"].err for s in OUTPUTS if f"sampler.denoised.{s}" in points}
    return {"status": "ok", "case": case.trace.parent.name, "err": err, **_figures(points, "err")}


def comfy_quality(case) -> dict:
    """ComfyUI's configurations' quality on `case`: default = its bf16 recording, sage = its sage recording."""
    from parity_tests import ladder

    refs = ladder.references(case)
    names = [f"sampler.denoised.{s}" for s in OUTPUTS]
    tensors = {n: refs.low.get(n) for n in names if refs.low is not None and n in refs.low}
    points = ladder.measure(tensors, refs)
    return {"default": {"case": case.trace.parent.name, **_figures(points, "comfy")},
            "sage": {"case": case.trace.parent.name, **_figures(points, "sage")}}


def cases_of(spec: dict | None) -> list[str]:
    """The case names of a contract's "quality" entry: its "cases" (a list of names, or "structured": every
    structured case of the validation set). ValueError when it names none."""
    cases = (spec or {}).get("cases")
    if cases == "structured":
        from parity_tests import validation

        cases = [c.name for c in validation.structured()]
    if not isinstance(cases, list) or not cases or not all(isinstance(c, str) for c in cases):
        raise ValueError(f'its "quality" entry names no cases (a list of names, or "structured"), got {cases!r}')
    return cases


def measure_cases(contract: dict, names: list[str], root: Path, cases: list[str], device: str,
                  comfy_root: str | None = None) -> dict:
    """Every path of `names` and every ComfyUI configuration on every case of `cases` (`measure`; with `comfy_root`
    the validation set's cases not recorded yet are first built and recorded), and over them (`h3direct.app.frontier.cases`):
    {"cases", "status", "per_case": {case: measure's}, "paths": {name: ...}, "comfyui": {...}}."""
    if comfy_root:
        record_missing(root, cases, comfy_root, device)
    per_case = {c: measure(contract, names, root, c, device) for c in cases}
    missing = [f"{c}: {q['status']}" for c, q in per_case.items() if q.get("status") != "ok"]
    return {"cases": cases, "status": "ok" if not missing else "not measured on " + "; ".join(missing),
            "per_case": per_case, "paths": by_path(per_case, "paths", names), "comfyui": by_path(per_case, "comfyui")}


def measure(contract: dict, names: list[str], root: Path, case_name: str, device: str) -> dict:
    """{"case", "paths": {name: quality}, "comfyui": {config: quality}} or {"status": why not}."""
    case, problem = recorded_case(root, case_name)
    if problem is not None:
        return {"case": case_name, "status": f"not measured: {problem}"}
    out = {"case": case_name, "status": "ok", "paths": {}, "comfyui": comfy_quality(case)}
    for name in names:
        try:
            res = measure_path(case, options_of(contract["paths"][name]), device)
        except Exception as exc:  # noqa: BLE001  one path's failure is its result; the other paths are still measured
            res = {"status": C.failed(exc)}
            C.free_memory(device)
        out["paths"][name] = res
        if res.get("status") == "ok":
            C.log(f"quality {case_name} {name}: x{res['error_x_comfyui_bf16']:.2f} ComfyUI bf16, "
                  f"x{res['error_x_comfyui_sage']:.2f} ComfyUI+sage")
        else:
            C.log(f"quality {case_name} {name}: {res['status']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n")[0])
    ap.add_argument("--contract", required=True)
    ap.add_argument("--trace-dir", required=True, type=Path, help="the validation set's folder")
    ap.add_argument("--case", action="append", default=None,
                    help="a validation case (repeatable; default: the contract's quality cases)")
    ap.add_argument("--paths", default=None, help="comma list of the contract's paths (default all)")
    ap.add_argument("--comfy-root", default=None, help="record a missing case with this ComfyUI checkout")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None, help="result JSON (default: print only)")
    args = ap.parse_args(argv)
    try:
        contract = json.loads(Path(args.contract).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        C.usage_error(f"--contract {args.contract}: {exc}", PROG)
    names = args.paths.split(",") if args.paths else list(contract.get("paths", {}))
    unknown = [n for n in names if n not in contract.get("paths", {})]
    if unknown:
        C.usage_error(f"--paths: {', '.join(unknown)} not a path of the contract", PROG)
    try:
        cases = args.case or cases_of(contract.get("quality"))
    except ValueError as exc:
        C.usage_error(f"--contract {args.contract}: {exc}; give --case", PROG)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            C.usage_error("--device cuda: no CUDA device here", PROG)
    if args.comfy_root:
        record_missing(args.trace_dir, cases, args.comfy_root, args.device)
    results = [measure(contract, names, args.trace_dir, c, args.device) for c in cases]
    if args.out:
        C.write_result(args.out, {"contract": contract.get("contract"), "cases": results})
    for r in results:
        print(ladder_table(r))
    failures = C.any_failed(p.get("status") for r in results for p in (r.get("paths") or {}).values())
    return 0 if all(r.get("status") == "ok" for r in results) and not failures else 1


def ladder_table(r: dict) -> str:
    """One case's ladder as markdown: ComfyUI's rows, then each path, × ComfyUI bf16 (video / audio) and × sage."""
    if r.get("status") != "ok":
        return f"{r['case']}: {r.get('status')}"
    lines = [f"{r['case']}", "", "| mode | × ComfyUI bf16 (video / audio) | × ComfyUI+sage (worse output) |",
             "|---|---|---|"]
    rows = [(f"ComfyUI {n}", q) for n, q in r["comfyui"].items()] + list(r["paths"].items())
    for name, q in rows:
        if q.get("status", "ok") != "ok":
            lines.append(f"| {name} | {q['status']} | |")
            continue
        x = q["x_comfyui_bf16"]
        lines.append(f"| {name} | {x.get('video', math.nan):.2f} / {x.get('audio', math.nan):.2f} | "
                     f"{q['error_x_comfyui_sage']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
