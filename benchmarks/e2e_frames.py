"""The e2e frames comparison of the approximate paths (parity_tests/e2e_frames.py) as a runner: build a model folder,
then compare every approximate path with the device's exact one and propose calibrated budget entries.

    python3 benchmarks/e2e_frames.py build --out /tmp/e2e_bf16 [--weights bf16|nvfp4] [--dit-arg=--attention-structure
        --dit-arg=local] [--width 512 --height 512 --frames 56]
    python3 benchmarks/e2e_frames.py compare --model /tmp/e2e_bf16 [--model ...] --device cuda \\
        --paths sage2,ck_int8,kj_head_sliced,sol_attn,fa3_fp8,fp8_linear --out R.json

`build` writes a head_dim-128 "small" DiT (`python -m h3direct make-checkpoint --preset small`, extra flags through
--dit-arg), the tiny synthetic video and audio VAEs (`--component video_vae|audio_vae --preset tiny`, as the bundled
models), seeded text states [1, 64, text_dim] with text tags, and `e2e.json` (geometry, steps, seed, weights key).
The default geometry, 512x512, 56 frames, packs 17x16x16 = 4,352 video + 93 audio + 64 text = 4,509 tokens per
attention call: above H3_SOL_MIN_TOKENS (4,096), so sol_attn runs its kernel in the DiT blocks.

`compare`: per model, the exact reference twice (its determinism: PSNR inf when bitwise), then each path
(`--repeats` times, per model: an approximate kernel may not be deterministic); per path PSNR mean/min and SSIM mean/min over
frames, attention call counts (sol_attn: kernel vs fallback), the verdict of the budgets table when it has an entry,
and a proposed entry from the worst measurement over models and repeats with a margin of 2x in error:
  PSNR floors  = measured - 20 log10(2) = measured - 6.02 dB, rounded up to 0.1 dB (the margin stays <= 2x);
  SSIM floors  = 1 - 2 (1 - measured), the dissimilarity 2 (1 - measured) rounded down to 2 significant digits.
A path that cannot run here is recorded with the reason. Exit 0 unless the arguments are bad (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402,F401  (puts the repo root on sys.path)

DB_2X = 20.0 * math.log10(2.0)
APPROX_DEFAULT = "sage2,ck_int8,kj_head_sliced,sol_attn,fa3_fp8,fp8_linear"


# ---- build ---------------------------------------------------------------------------------------

def build(args) -> int:
    import torch
    from safetensors.torch import save_file

    from h3direct.config import H3Config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"dit": "dit.safetensors", "video_vae": "video_vae.safetensors", "audio_vae": "audio_vae.safetensors",
             "text_embeds": "text_embeds.safetensors"}
    make = [sys.executable, "-m", "h3direct", "make-checkpoint", "--seed", str(args.seed)]
    dit = make + ["--component", "dit", "--preset", args.preset, "--quant", "nvfp4" if args.weights == "nvfp4"
                  else "none", "--output", str(out / files["dit"])]
    if args.weights == "nvfp4":
        dit += ["--nvfp4-layers", "dit"]
    steps = [dit + list(args.dit_arg)]
    for comp in ("video_vae", "audio_vae"):
        steps.append(make + ["--component", comp, "--preset", args.vae_preset, "--output", str(out / files[comp])])
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"e2e_frames build: {' '.join(cmd[2:])} failed: {(r.stderr or r.stdout).strip()[-400:]}",
                  file=sys.stderr)
            return 2
    cfg = H3Config.from_name(args.preset)
    g = torch.Generator().manual_seed(args.seed + 1)
    save_file({"text_states": torch.randn(1, args.text_len, cfg.text_dim, generator=g),
               "token_tags": torch.ones(args.text_len, dtype=torch.long)}, str(out / files["text_embeds"]))
    weights = "nvfp4_w4a16" if args.weights == "nvfp4" else "bf16"  # NVFP4 below sm_100 runs W4A16
    spec = {"width": args.width, "height": args.height, "frames": args.frames, "steps": args.steps,
            "seed": args.seed, "weights": weights, "vae_config": args.vae_preset, "files": files,
            "about": f"{args.preset} DiT ({args.weights}{' ' + ' '.join(args.dit_arg) if args.dit_arg else ''}), "
                     f"{args.vae_preset} VAEs, {args.width}x{args.height}x{args.frames}, {args.steps} steps, "
                     f"text {args.text_len}"}
    (out / "e2e.json").write_text(json.dumps(spec, indent=1) + "\n")
    print(f"e2e model folder {out}: {spec['about']}")
    return 0


# ---- compare -------------------------------------------------------------------------------------

def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _fm_json(fm: dict) -> dict:
    """JSON-safe metrics: an infinite PSNR (bitwise frames) becomes null and is listed under psnr_inf."""
    return {k: _num(v) for k, v in fm.items()} | {"psnr_inf": [k for k in ("psnr_mean", "psnr_min")
                                                              if fm[k] == math.inf]}


def propose(worst: dict) -> dict:
    """Floors with a 2x error margin from the worst measured metrics (see the module docstring)."""
    def psnr(v):
        return math.ceil((v - DB_2X) * 10.0) / 10.0

    def ssim(v):
        d = 2.0 * (1.0 - v)
        if d <= 0:
            return 1.0
        e = math.floor(math.log10(d)) - 1
        return round(1.0 - math.floor(d / 10.0 ** e) * 10.0 ** e, 12)

    return {"psnr_db": psnr(worst["psnr_mean"]), "psnr_min_db": psnr(worst["psnr_min"]),
            "ssim_mean": ssim(worst["ssim_mean"]), "ssim_min": ssim(worst["ssim_min"])}


def _write(path, out: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1, default=str) + "\n")


def compare(args) -> int:
    import torch

    from h3direct.errors import H3Error
    from h3direct.traces.budgets import frames_verdict, load_budgets
    from parity_tests import e2e_frames as E

    budgets = load_budgets(args.budgets)
    paths = [p for p in args.paths.split(",") if p]
    device = args.device
    compute = E.compute_of(device)
    reference = args.reference or E.exact_reference(device)
    out: dict = {"device": device, "compute": compute, "reference": reference,
                 "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else None,
                 "env": {k: v for k, v in os.environ.items() if k.startswith(("H3_SOL_", "H3_HEAD_SLICE"))},
                 "models": [], "paths": {}, "proposed": {}}
    for mi, model_dir in enumerate(args.model):
        repeats = args.repeats[min(mi, len(args.repeats) - 1)]
        model = E.E2EModel.load(None if model_dir == "bundled" else model_dir)
        mres = {"model": model_dir, "about": model.about, "weights": model.weights, "id": model.id, "paths": {}}
        out["models"].append(mres)
        t = time.perf_counter()
        ref = E.run_frames(model, ["--attention", reference], device=device)
        again = E.run_frames(model, ["--attention", reference], device=device)
        same = bool(torch.equal(ref.frames, again.frames))
        det = E.frame_metrics(again.frames, ref.frames)
        mres["reference"] = {"path": reference, "seconds": round(ref.seconds, 3), "tokens": ref.tokens,
                             "frames_shape": list(ref.frames.shape), "bitwise_repeat": same,
                             "repeat_metrics": _fm_json(det), "attention_calls": ref.attention_calls}
        print(f"[{model.id}] exact {reference}: {ref.frames.shape[0]} frames, S = {ref.tokens} (+ text), "
              f"repeat bitwise {same} (PSNR {det['psnr_mean']:.2f} dB), {time.perf_counter() - t:.1f} s", flush=True)
        for path in paths:
            rec: dict = {"kind": E.kind_of(path)}
            mres["paths"][path] = rec
            why = E.unavailable(path, device)
            if rec["kind"] == "unknown":
                why = "not an attention backend of this h3direct (not registered)"
            elif why is None and rec["kind"] == "exact":
                why = "an exact path here (nothing approximate to compare)"
            if why is not None:
                rec["skipped"] = why
                print(f"[{model.id}] {path}: skipped ({why})", flush=True)
                continue
            runs = []
            try:
                for _ in range(repeats):
                    r = E.run_frames(model, E.path_flags(path, reference), device=device)
                    fm = E.frame_metrics(r.frames, ref.frames)
                    runs.append({"metrics": _fm_json(fm), "seconds": round(r.seconds, 3),
                                 "attention_calls": r.attention_calls, "_fm": fm})
            except (H3Error, RuntimeError, ImportError, ValueError) as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                rec["traceback"] = traceback.format_exc()[-2000:]
                print(f"[{model.id}] {path}: ERROR {rec['error']}", flush=True)
                continue
            worst = {k: min(x["_fm"][k] for x in runs) for k in ("psnr_mean", "psnr_min", "ssim_mean", "ssim_min")}
            worst["frames"] = runs[0]["_fm"]["frames"]
            rec["runs"] = [{k: v for k, v in x.items() if k != "_fm"} for x in runs]
            rec["worst"] = _fm_json(worst)
            rec["repeats_identical"] = len({json.dumps(x["metrics"], sort_keys=True) for x in runs}) == 1
            try:
                b = E.frames_budget(budgets, path, compute, model.weights, reference)
                ok, rule = frames_verdict(b, worst)
                rec["gate"] = {"passed": ok, "rule": rule}
            except H3Error as exc:
                rec["gate"] = {"passed": False, "rule": str(exc).splitlines()[0]}
            calls = runs[0]["attention_calls"]
            print(f"[{model.id}] {path}: PSNR mean {worst['psnr_mean']:.2f} / min {worst['psnr_min']:.2f} dB, "
                  f"SSIM mean {worst['ssim_mean']:.8f} / min {worst['ssim_min']:.8f} (worst of {len(runs)}, "
                  f"repeats identical {rec['repeats_identical']}){' calls ' + json.dumps(calls) if calls else ''}; "
                  f"gate: {'PASS' if rec['gate']['passed'] else 'FAIL'} ({rec['gate']['rule'][:160]})", flush=True)
            agg = out["paths"].setdefault(path, {"worst": None, "models": []})
            agg["models"].append(model.id)
            agg["worst"] = worst if agg["worst"] is None else {
                k: min(agg["worst"][k], worst[k]) for k in ("psnr_mean", "psnr_min", "ssim_mean", "ssim_min")}
            _write(args.out, out)  # after every path: a run cut short by its timeout keeps what it measured
    gpu = out["gpu"] or ""
    where = "the H200" if "H200" in gpu else (gpu or "the CPU")
    for path, agg in out["paths"].items():
        w = agg["worst"]
        floors = propose(w)
        about = "; ".join(m["about"] for m in out["models"] if path in m["paths"] and "worst" in m["paths"][path])
        key = E.budget_key(path, compute, "*", reference)
        out["proposed"][path] = {
            **key, **floors,
            "provenance": (f"measured on {where}, {time.strftime('%Y-%m-%d')}, {args.script} "
                           f"(benchmarks/e2e_frames.py compare): {path} vs {reference}, same seed and inputs, "
                           f"{'/'.join(map(str, args.repeats))}x each, h3direct's pipeline ({about}), video latent decoded to float frames; "
                           f"worst measured PSNR mean {w['psnr_mean']:.2f} / min {w['psnr_min']:.2f} dB, "
                           f"SSIM mean {w['ssim_mean']:.8f} / min {w['ssim_min']:.8f}; floors at 2x that error "
                           f"(PSNR - 6.02 dB rounded up to 0.1 dB; 1 - SSIM doubled, rounded down to 2 digits)")}
        agg["worst"] = _fm_json(w)
    _write(args.out, out)
    if out["proposed"]:
        print("\n# proposed e2e frames entries (append to the H200 block of parity_tests/budgets.toml):")
        for e in out["proposed"].values():
            print("\n[[budget]]")
            for k, v in e.items():
                print(f"{k} = {json.dumps(v)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write an e2e model folder")
    b.add_argument("--out", required=True)
    b.add_argument("--preset", default="small")
    b.add_argument("--weights", choices=["bf16", "nvfp4"], default="bf16")
    b.add_argument("--vae-preset", default="tiny")
    b.add_argument("--dit-arg", action="append", default=[], help="extra make-checkpoint flag for the DiT "
                   "(repeatable; --dit-arg=--attention-structure --dit-arg=local)")
    b.add_argument("--width", type=int, default=512)
    b.add_argument("--height", type=int, default=512)
    b.add_argument("--frames", type=int, default=56)
    b.add_argument("--steps", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--text-len", type=int, default=64)
    c = sub.add_parser("compare", help="exact vs each approximate path, decoded frames")
    c.add_argument("--model", action="append", required=True, help="model folder (repeatable) or 'bundled'")
    c.add_argument("--paths", default=APPROX_DEFAULT)
    c.add_argument("--device", default="cuda")
    c.add_argument("--reference", default=None, help="exact reference (default: fa3, else cudnn_sdpa, else sdpa)")
    c.add_argument("--repeats", default="2", help="runs of each path per model: N, or N1,N2,... per --model "
                   "(the last one for the rest)")
    c.add_argument("--budgets", default=None)
    c.add_argument("--out", default=None)
    c.add_argument("--script", default="benchmarks/gpu_e2eapx.sh",
                   help="the GPU script that ran this comparison, named in the proposed entries' provenance")
    args = p.parse_args(argv)
    if args.cmd == "compare":
        bad = [m for m in args.model if m != "bundled" and not (Path(m) / "e2e.json").is_file()]
        if bad:
            p.error(f"--model: not an e2e model folder (no e2e.json): {', '.join(bad)}")
        try:
            args.repeats = [int(x) for x in args.repeats.split(",")]
        except ValueError:
            p.error(f"--repeats: not a list of integers: {args.repeats!r}")
        if min(args.repeats) < 1:
            p.error("--repeats must be >= 1")
    return build(args) if args.cmd == "build" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
