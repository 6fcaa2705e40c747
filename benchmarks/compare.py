"""Check a benchmark result against its contract: first that the result ran the contract, then its targets.

    python -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f.json --result R.json
    python -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f-e2e.json --result R.json

The DiT contract:

Rules (one line each, FAIL when broken): the result is not a --smoke run; it ran on the contract's device class;
its workload (canvas, frames, text tokens, S), weights and timed-step count are the contract's; every path ran with
the contract's settings (attention backend and options, FP8 linears; a tier path, `{"tier": NAME}`, its tier's
options as the result records them from its tiers file, which was chosen on the device the result ran on, one file
for every tier path); every ComfyUI configuration ran with the contract's settings. Targets
(contract["targets"][path][metric], {"max": x} or {"min": x}), one line each:
`x_comfyui_default` is ComfyUI's default configuration's s/step measured in the same run over the path's;
`x_comfyui_best` the same with the fastest ComfyUI configuration of the path's class (exact or approximate);
`x_comfyui_sage` the same with ComfyUI `--use-sage-attention`; `floor_ratio` the path's s/step over the hot floor
measured in the same run; `error_x_comfyui_bf16` / `error_x_comfyui_sage` the path's quality (benchmarks/quality.py:
its output's error against ComfyUI's fp32 twin, the worse of video and audio, as a multiple of ComfyUI bf16's /
ComfyUI+sage's own, on each of the contract's quality cases: the worst case, taken here from the per-case figures,
and a case without a figure is a miss). A rule: the quality was measured on the contract's cases. A figure the result
lacks, or one that is not a finite number (inf, NaN, a string, true/false), is a miss.

The end-to-end contract (kind "e2e"): the result is not a --smoke run; it ran on the contract's device class; its
workload (task, canvas, frames, prompt, steps, sampler, scheduler, cfg, seed, fps) and weights are the contract's;
every configuration (weight format) is in it, and each side that ran it (h3direct; ComfyUI when measured) ran with
the contract's settings (h3direct: attention, options, FP8 linears, DiT / text-encoder formats, NVFP4 mode, VAE
dtype; ComfyUI: its settings and attention, the formats), gave the text encoder the contract's text_tokens, ran the
contract's steps, wrote an mp4 of the contract's frames, size and one audio stream, and reported every stage as a
finite number. Targets (contract["targets"][config][metric]): `total_ratio` (h3direct total_s / ComfyUI total_s of
the same configuration and run; no same-run ComfyUI is a miss) and h3direct's own figures (`mp4_write_s`, ...).

Exit codes: 0 every rule holds and every target is met, 1 otherwise, 2 bad input (unreadable file, another
contract).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks.quality import cases_of
from h3direct.app.frontier.cases import METRICS, number, worst


def tier_spec(flat: dict) -> dict:
    """A tier's flat options (`h3direct.app.tiers.Tier.options`) as a contract path's attention, FP8 linears and
    options (an option the tier does not name takes its default, as `Options.from_flat` gives it)."""
    from h3direct.dit.options import DEFAULT_BACKEND

    options = dict(flat)
    return {"attention": options.pop("attention", DEFAULT_BACKEND), "fp8_linear": options.pop("fp8_linear", "off"),
            "options": options}


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


def _ok(entry) -> bool:
    return isinstance(entry, dict) and entry.get("status", "ok") == "ok"


# ---------------------------------------------------------------- did the result run the contract?

def _run_rules(contract: dict, result: dict) -> list[tuple[str, str | None]]:
    """The rules of every contract: not a smoke run, the contract's device class."""
    out = [("not a smoke run", "the result is a --smoke run (tiny sizes): not a measurement" if result.get("smoke")
            is not False else None)]
    want_dev, got_dev = contract.get("device"), result.get("device")
    classes = want_dev if isinstance(want_dev, list) else [want_dev] if want_dev else []
    out.append(("device", None if not classes or any(d in str(got_dev) for d in classes) else
                f"the contract is for {' or '.join(map(repr, classes))}, the result ran on {got_dev!r}"))
    return out


def differs(want: dict, got: dict, prefix: str = "") -> list[str]:
    """Each key of `want` whose value `got` does not have, as "<prefix>key got (contract want)"."""
    return [f"{prefix}{k} {got.get(k)!r} (contract {v!r})" for k, v in want.items() if got.get(k) != v]


def _why(diff: list[str]) -> str | None:
    """A rule's verdict: None when nothing differs, else what does."""
    return "; ".join(diff) or None


def rules(contract: dict, result: dict) -> list[tuple[str, str | None]]:
    """(rule, None when it holds else why not) for every rule of the DiT contract (module docstring)."""
    out = _run_rules(contract, result)
    w, r = contract["workload"], result.get("workload") or {}
    pairs = {"width": "width", "height": "height", "frames": "frames", "text_tokens": "text_len", "seq_len": "seq_len"}
    out.append(("workload", _why(differs({k: w[k] for k in pairs if k in w}, {k: r.get(rk) for k, rk in pairs.items()}))))
    out.append(("weights", _why(differs(contract["weights"], result.get("weights") or {}))))
    want = contract["steps"]
    diff = differs({k: want[k] for k in ("warmup", "timed")}, result.get("steps") or {})
    for name, p in (result.get("paths") or {}).items():
        if _ok(p) and len(p.get("step_s") or []) != want["timed"]:
            diff.append(f"{name} timed {len(p.get('step_s') or [])} steps")
    out.append(("timed steps", _why(diff)))
    if any("tier" in spec for spec in contract["paths"].values()):
        out.append(("tiers file", _tiers_file_rule(contract, result)))
    for name, spec in contract["paths"].items():
        p = (result.get("paths") or {}).get(name)
        if not isinstance(p, dict):
            out.append((f"path {name}", "not in the result"))
            continue
        if "tier" in spec:  # its settings are the tier's of the tiers file the result names
            tier = p.get("tier") if isinstance(p.get("tier"), dict) else {}
            if tier.get("name") != spec["tier"]:
                out.append((f"path {name} settings", f"ran tier {tier.get('name')!r} (contract {spec['tier']!r})"))
                continue
            spec = tier_spec(tier.get("options") or {})
        s = p.get("settings") or {}
        expect = {"attention": spec["attention"], "fp8_linear": spec.get("fp8_linear", "off")}
        ran = s.get("options") or {}  # every option the path ran with, under its flat name
        diff = differs(expect, s) + differs(spec.get("options", {}), ran, "options ")
        out.append((f"path {name} settings", _why(diff)))
    q = result.get("quality")
    if contract.get("quality") and isinstance(q, dict):
        want = contract_cases(contract)
        out.append(("quality cases", None if q.get("cases") == want else
                    f"measured on {q.get('cases')!r}, the contract's cases are {want!r}"))
    comfy = result.get("comfyui")
    for name, spec in (contract.get("comfyui") or {}).items():
        c = (comfy or {}).get("configs", {}).get(name) if isinstance(comfy, dict) else None
        if c is None:
            continue  # no same-run ComfyUI: the ratio targets miss, with the reason
        diff = differs({k: spec[k] for k in ("settings", "attention", "class")}, c)
        out.append((f"ComfyUI {name} settings", _why(diff)))
    return out


def _tiers_file_rule(contract: dict, result: dict) -> str | None:
    """The tier paths took their options from one tiers file, chosen on the device the result ran on."""
    t = result.get("tiers")
    if not isinstance(t, dict):
        return "the result names no tiers file (its tier paths' options are unknown)"
    chosen_on = (t.get("machine") or {}).get("device_name")
    if chosen_on != result.get("device"):
        return f"its tiers were chosen on {chosen_on!r}, the result ran on {result.get('device')!r}"
    ran = [(result.get("paths") or {}).get(n) for n, spec in contract["paths"].items() if "tier" in spec]
    shas = {p["tier"].get("sha256") for p in ran if isinstance(p, dict) and isinstance(p.get("tier"), dict)}
    other = shas - {t.get("sha256")}  # (a path without its tier record fails its own settings rule)
    return f"a tier path ran from another tiers file (sha256 {sorted(map(str, other))})" if other else None


def contract_cases(contract: dict) -> list[str] | None:
    """The contract's quality cases (`quality.cases_of`), None when its entry names none."""
    try:
        return cases_of(contract.get("quality"))
    except ValueError:
        return None


# ---------------------------------------------------------------- the figures

def ratios(contract: dict, result: dict) -> dict[str, dict[str, float]]:
    """Per path of the result: x_comfyui_default, x_comfyui_best and floor_ratio where the same-run figures exist."""
    configs = (result.get("comfyui") or {}).get("configs") or {}
    comfy = {n: number(c.get("s_per_step")) for n, c in configs.items() if _ok(c)}
    floor = result.get("hot_floor")
    floor_s = number(floor.get("s_per_step")) if _ok(floor) else None
    out = {}
    for name, p in (result.get("paths") or {}).items():
        ours = number(p.get("s_per_step")) if _ok(p) else None
        if not ours:
            continue
        cls = (contract["paths"].get(name) or {}).get("class")
        same = [s for n, s in comfy.items() if s and (contract.get("comfyui") or {}).get(n, {}).get("class") == cls]
        values = {}
        if comfy.get("default"):
            values["x_comfyui_default"] = comfy["default"] / ours
        if comfy.get("sage"):
            values["x_comfyui_sage"] = comfy["sage"] / ours
        if same:
            values["x_comfyui_best"] = min(same) / ours
        if floor_s:
            values["floor_ratio"] = ours / floor_s
        out[name] = values
    return out


def value_of(contract: dict, result: dict, path: str, metric: str) -> tuple[float | None, str]:
    """(value, note) of one metric of one path; None when the result cannot provide it as a finite number."""
    p = (result.get("paths") or {}).get(path)
    if not isinstance(p, dict):
        return None, f"path {path!r} not in the result"
    if not _ok(p):
        return None, f"path {path!r}: {p.get('status')}"
    if metric in METRICS:  # the worst over the contract's cases, from the per-case figures
        q = p.get("quality")
        if not isinstance(q, dict):
            return None, (result.get("quality") or {}).get("status") or "quality not measured"
        cases = contract_cases(contract)
        if cases is None:
            return None, "the contract names no quality cases"
        v, note = worst(q, cases, metric)
        return v, note if v is not None else f"quality: {note}"
    if metric in ("x_comfyui_default", "x_comfyui_sage", "x_comfyui_best", "floor_ratio"):
        if number(p.get("s_per_step")) is None:
            return None, f"s_per_step {p.get('s_per_step')!r} is not a finite number"
        v = ratios(contract, result).get(path, {}).get(metric)
        if v is not None:
            return v, ""
        if metric == "floor_ratio":
            floor = result.get("hot_floor")
            return None, f"no hot floor ({floor.get('status') if isinstance(floor, dict) else 'not measured'})"
        return None, result.get("comfyui_note") or "no same-run ComfyUI of that class"
    v = number(p.get(metric))
    return v, "" if v is not None else f"{metric} {p.get(metric)!r} is not a finite number"


def compare(contract: dict, result: dict, value=value_of) -> list[dict]:
    """One row per target: the figure (`value(contract, result, path or configuration, metric)`), met or not."""
    rows = []
    for path, targets in contract["targets"].items():
        for metric, bound in targets.items():
            v, note = value(contract, result, path, metric)
            op, limit = ("<=", bound["max"]) if "max" in bound else (">=", bound["min"])
            ok = v is not None and (v <= limit if op == "<=" else v >= limit)
            rows.append({"path": path, "metric": metric, "value": v, "op": op, "limit": limit, "passed": ok,
                         "note": note})
    return rows


def info_lines(contract: dict, result: dict) -> list[str]:
    """The same-run ComfyUI configurations, every path's ratios, and the clocks and power of each timed run."""
    lines = []
    comfy = result.get("comfyui") if isinstance(result.get("comfyui"), dict) else {}
    if not comfy:
        lines.append(result.get("comfyui_note") or "no same-run ComfyUI")
    else:
        lines.append(f"ComfyUI {comfy.get('version')} (commit {comfy.get('commit')}), comfy-kitchen "
                     f"{comfy.get('comfy_kitchen')}, SageAttention {comfy.get('sageattention')}")
    lines.append(measured_code(result))
    for name, c in (comfy.get("configs") or {}).items():
        s = number(c.get("s_per_step"))
        what = f"{s:.3f} s/step ({c.get('chosen')})" if _ok(c) and s else c.get("status")
        lines.append(f"ComfyUI {name:13s} {c.get('class')}, {c.get('settings')} settings: {what}")
    for name, values in ratios(contract, result).items():
        if values:
            lines.append(f"{name:12s} " + ", ".join(f"{k} {v:.3f}" for k, v in values.items()))
    q = result.get("quality")
    if isinstance(q, dict):
        cases = q.get("cases") if isinstance(q.get("cases"), list) else [q.get("case")]
        lines.append(f"quality cases {', '.join(map(str, cases))}: {q.get('status')}")
    quality_rows = [(f"ComfyUI {n}", c.get("quality")) for n, c in (comfy.get("configs") or {}).items()]
    quality_rows += [(n, p.get("quality")) for n, p in (result.get("paths") or {}).items()]
    for name, pq in quality_rows:
        per_case = pq.get("cases") if isinstance(pq, dict) else None
        for case, f in (per_case or {}).items() if isinstance(per_case, dict) else ():
            if not isinstance(f, dict) or "x_comfyui_bf16" not in f:
                lines.append(f"{name:12s} quality on {case}: {(f or {}).get('status') if isinstance(f, dict) else f}")
                continue
            x = f["x_comfyui_bf16"] if isinstance(f["x_comfyui_bf16"], dict) else {}
            lines.append(f"{name:12s} quality on {case}: x{x.get('video', math.nan):.2f} / "
                         f"x{x.get('audio', math.nan):.2f} ComfyUI bf16 (video / audio), "
                         f"x{f.get('error_x_comfyui_sage', math.nan):.2f} ComfyUI+sage (worse output)")
    runs = [(name, p.get("gpu_clock_power")) for name, p in (result.get("paths") or {}).items()]
    runs.append(("hot floor", (result.get("hot_floor") or {}).get("gpu_clock_power")))
    for name, gp in runs:
        if isinstance(gp, dict) and "sm_clock_mhz_median" in gp:
            lines.append(f"{name:12s} SM clock median {gp['sm_clock_mhz_median']:.0f} MHz (max seen "
                         f"{gp['sm_clock_mhz_max']:.0f}), power median {gp['power_w_median']:.0f} of "
                         f"{gp['power_limit_w']:.0f} W, at the power cap in {100 * gp['power_capped_share']:.0f} % "
                         "of samples")
    return lines


# ---------------------------------------------------------------- the end-to-end contract (kind "e2e")

E2E_STAGES = ("text_encode_s", "denoise_s", "video_decode_s", "audio_decode_s", "mp4_write_s", "total_s")
E2E_WORKLOAD = ("task", "width", "height", "frames", "prompt", "steps", "sampler", "scheduler", "cfg", "seed", "fps")


def _expected_settings(contract: dict, name: str, side: str) -> dict:
    spec = contract["configs"][name]
    formats = {"dit": spec["dit"], "text_encoder": spec["text_encoder"]}
    if side == "comfyui":
        c = contract["comfyui"]
        return {"settings": c["settings"], "attention": c["attention"], **formats}
    h = contract["h3direct"]
    return {"attention": h["attention"], "fp8_linear": h.get("fp8_linear", "off"), "vae_dtype": h["vae_dtype"],
            "nvfp4_mode": spec.get("nvfp4_mode"), **formats}


def e2e_rules(contract: dict, result: dict) -> list[tuple[str, str | None]]:
    """(rule, None when it holds else why not) for every rule of the e2e contract (module docstring)."""
    out = _run_rules(contract, result)
    w, r = contract["workload"], result.get("workload") or {}
    want = {**{k: w[k] for k in E2E_WORKLOAD if k in w}, "warmup_steps": contract.get("warmup_steps", 1)}
    out.append(("workload", _why(differs(want, r))))
    out.append(("weights", _why(differs(contract["weights"], result.get("weights") or {}))))
    for name in contract["configs"]:
        entry = (result.get("configs") or {}).get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("h3direct"), dict):
            out.append((f"{name}", "not in the result"))
            continue
        for side in ("h3direct", "comfyui"):
            got = entry.get(side)
            if not isinstance(got, dict) or not _ok(got):
                continue  # not measured or not run: its targets miss, with the status
            s = got.get("settings") or {}
            diff = differs(_expected_settings(contract, name, side), s)
            if side == "h3direct":
                diff += differs(contract["h3direct"].get("options", {}), s.get("options") or {}, "options ")
            out.append((f"{name} {side} settings", _why(diff)))
            mp4 = got.get("mp4") or {}
            made = {"text_tokens": got.get("text_tokens"), "steps": got.get("steps"), "mp4 frames": mp4.get("frames"),
                    "mp4 width": mp4.get("width"), "mp4 height": mp4.get("height"),
                    "mp4 audio streams": mp4.get("audio_streams")}
            want = {"text_tokens": w.get("text_tokens"), "steps": w["steps"], "mp4 frames": w["frames"],
                    "mp4 width": w["width"], "mp4 height": w["height"], "mp4 audio streams": 1}
            diff = differs({k: v for k, v in want.items() if v is not None}, made)
            out.append((f"{name} {side} generation", _why(diff)))
            stages = got.get("stages") or {}
            bad = [f"{k} {stages.get(k)!r}" for k in E2E_STAGES if number(stages.get(k)) is None]
            if number(got.get("peak_gpu_gib")) is None and "cuda" in str(result.get("env", {}).get("device", "cuda")):
                bad.append(f"peak_gpu_gib {got.get('peak_gpu_gib')!r}")
            out.append((f"{name} {side} figures", ("not finite numbers: " + ", ".join(bad)) if bad else None))
    return out


def e2e_ratios(result: dict) -> dict[str, dict[str, float]]:
    """Per configuration with both sides measured: total_ratio = h3direct total_s / ComfyUI total_s."""
    out = {}
    for name, entry in (result.get("configs") or {}).items():
        h, c = entry.get("h3direct"), entry.get("comfyui")
        if not (_ok(h) and _ok(c)):
            continue
        ours, theirs = (number((x.get("stages") or {}).get("total_s")) for x in (h, c))
        if ours is not None and theirs:
            out[name] = {"total_ratio": ours / theirs}
    return out


def e2e_value_of(contract: dict, result: dict, name: str, metric: str) -> tuple[float | None, str]:
    """(value, note) of one metric of one configuration (h3direct's figure, or the ratio to ComfyUI)."""
    entry = (result.get("configs") or {}).get(name)
    h = entry.get("h3direct") if isinstance(entry, dict) else None
    if not isinstance(h, dict):
        return None, f"configuration {name!r} not in the result"
    if not _ok(h):
        return None, f"h3direct {name}: {h.get('status')}"
    if metric == "total_ratio":
        v = e2e_ratios(result).get(name, {}).get("total_ratio")
        if v is not None:
            return v, ""
        c = entry.get("comfyui")
        if not isinstance(c, dict):
            return None, result.get("comfyui_note") or "no same-run ComfyUI"
        if not _ok(c):
            return None, f"ComfyUI {name}: {c.get('status')}"
        return None, "total_s of a side is not a finite number"
    raw = (h.get("stages") or {}).get(metric, h.get(metric))
    v = number(raw)
    return v, "" if v is not None else f"{metric} {raw!r} is not a finite number"


def measured_code(result: dict) -> str:
    """Which h3direct ran: the commit of this repository whose files are the result's `tree`, else what is known."""
    from benchmarks._common import commit_of_tree

    tree = result.get("tree")
    if not tree:
        return f"h3direct: no tree recorded (its checkout's HEAD: {result.get('commit')})"
    commit = commit_of_tree(tree)
    return (f"h3direct: tree {tree[:12]} = commit {commit[:12]}" if commit else
            f"h3direct: tree {tree[:12]}, which no commit here has (its checkout's HEAD: {result.get('commit')})")


def e2e_info_lines(contract: dict, result: dict) -> list[str]:
    """Each configuration's stage table, both sides, the ComfyUI and the h3direct that ran."""
    comfy = result.get("comfyui") if isinstance(result.get("comfyui"), dict) else {}
    lines = [f"ComfyUI {comfy.get('version')} (commit {comfy.get('commit')}), comfy-kitchen "
             f"{comfy.get('comfy_kitchen')}" if comfy else (result.get("comfyui_note") or "no same-run ComfyUI"),
             measured_code(result)]
    for name, entry in (result.get("configs") or {}).items():
        for side in ("h3direct", "comfyui"):
            got = entry.get(side) if isinstance(entry, dict) else None
            if not isinstance(got, dict):
                continue
            if not _ok(got):
                lines.append(f"{name:6s} {side:8s} {got.get('status')}")
                continue
            st = got.get("stages") or {}
            cells = [f"{k.removesuffix('_s')} {number(st.get(k)):.2f}" if number(st.get(k)) is not None
                     else f"{k.removesuffix('_s')} {st.get(k)!r}" for k in E2E_STAGES]
            busy = number(got.get("mp4_encode_busy_s"))
            peak = number(got.get("peak_gpu_gib"))
            lines.append(f"{name:6s} {side:8s} " + ", ".join(cells) + " s"
                         + (f" (mp4 encoder busy {busy:.2f} s)" if busy is not None else "")
                         + (f", peak {peak:.2f} GiB" if peak is not None else ""))
    for name, values in e2e_ratios(result).items():
        lines.append(f"{name:6s} total_ratio {values['total_ratio']:.3f}")
    return lines


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
    e2e = contract.get("kind") == "e2e"
    keys = ("targets", "workload", "weights", "configs", "h3direct", "comfyui") if e2e else (
        "targets", "workload", "weights", "steps", "paths")
    for key in keys:
        if not isinstance(contract.get(key), dict):
            return _bad(f"--contract {args.contract}: no {key!r} object")
    if result.get("contract") != contract.get("contract"):
        return _bad(f"--result {args.result} is for contract {result.get('contract')!r}, "
                    f"not {contract.get('contract')!r}")
    check, value, info = (e2e_rules, e2e_value_of, e2e_info_lines) if e2e else (rules, value_of, info_lines)
    broken = 0
    for rule, why in check(contract, result):
        broken += why is not None
        print(f"{'ok  ' if why is None else 'FAIL'} rule   {rule}" + (f": {why}" if why else ""))
    rows = compare(contract, result, value)
    for r in rows:
        v = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        extra = f"  ({r['note']})" if r["note"] else ""
        print(f"{'pass' if r['passed'] else 'MISS'} {r['path']:12s} {r['metric']:20s} {v:>8s} {r['op']} "
              f"{r['limit']:g}{extra}")
    for line in info(contract, result):
        print(f"info {line}")
    missed = sum(not r["passed"] for r in rows)
    print(f"{len(rows) - missed} of {len(rows)} targets met" + (f", {missed} missed" if missed else "")
          + (f"; {broken} rule(s) broken: the result did not run the contract" if broken else ""))
    return 1 if missed or broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
