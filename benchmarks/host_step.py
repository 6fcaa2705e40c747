"""Where the GPU idles during a full-size DiT step, and whether a warm step still synchronizes with the host.

    python3 benchmarks/host_step.py [--preset full] [--attention auto] [--steps 4] [--out R.json]

On one model (built once, NVFP4 W4A16 as benchmarks/profile_dit.py builds it; fa3 when importable, else sdpa):
1. the host mirror of σ -> (t_video, t_audio) (`timesteps.host_stream_times`, device_type=cuda) against the device's
   own float32 ops, for the 1000 schedule levels, the schedulers' sigmas and random σ: mismatches (must be 0);
2. a warm-up step, then `--steps` steps with torch.cuda.synchronize() around each (as a sampler loop that syncs per
   step, and as run_contract's steps look from the host), each σ a fresh tensor tagged by its host value (what the
   sampler passes), under torch.profiler: per step wall, GPU busy (union of kernel / memcpy / memset intervals),
   idle = wall − busy, the largest gaps with the kernels around them and the host op that launched the next one,
   and the synchronizing runtime calls made inside the Denoiser call;
3. torch.cuda.set_sync_debug_mode("warn") over: a warm step with the same σ tensor, one with a fresh tagged σ, one
   with a fresh untagged σ (one read-back expected), and the uncached path (no step invariants, σ and tags read
   back: the old plan) — the synchronizing calls each makes, with their h3direct call sites;
4. bitwise: warm Denoiser x0 vs the uncached path's, at two σ;
5. CUDA-event timing without per-step syncs (run_contract's `time_calls`): the Denoiser and the uncached path.
Prints a summary; JSON to --out (default $OUT/host_step.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")


# ---------------------------------------------------------------- 1. host mirror of the σ arithmetic

def check_host_times(dev) -> dict:
    import torch

    from h3direct.dit.timesteps import audio_sigma, host_stream_times, sigma_from_timestep
    from h3direct.sampling.schedules import SCHEDULERS, FlowSigmas, scheduler_sigmas

    g = torch.Generator().manual_seed(0)
    cases = FlowSigmas(12.0).table.tolist() + torch.rand(4096, generator=g).tolist()
    for name in SCHEDULERS:
        for steps in (8, 30, 50):
            cases += scheduler_sigmas(name, steps).tolist()
    cases += [1.0, 0.0, 1e-7, 1e-6, 0.999, 0.001]
    # the ops as the Denoiser and plan_timesteps apply them, elementwise over a batch
    sig = torch.tensor(cases, dtype=torch.float32, device=dev)
    sv = ((sig * 1000.0).float() / 1000.0).float().clamp(min=1e-6)
    tv, ta = (1.0 - sv).cpu().tolist(), (1.0 - audio_sigma(sv, 12.0, 3.0)).cpu().tolist()
    bad = [s for s, a, b in zip(cases, tv, ta, strict=True)
           if host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type=dev.type) != (a, b)]
    # and exactly the per-call path (0-dim ops) on a few
    bad_scalar = []
    for s in cases[::97]:
        ts = (torch.tensor([s], device=dev).reshape(-1)[:1].float() * 1000.0).float()
        v = sigma_from_timestep(ts)
        want = (float(1.0 - v), float(1.0 - audio_sigma(v, 12.0, 3.0)))
        if host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type=dev.type) != want:
            bad_scalar.append(s)
    cpu_differs = sum(host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type="cpu")
                      != host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type=dev.type) for s in cases)
    return {"cases": len(cases), "mismatches": len(bad), "mismatch_examples": bad[:8],
            "scalar_cases": len(cases[::97]), "scalar_mismatches": len(bad_scalar),
            "cpu_rounding_differs": cpu_differs}


# ---------------------------------------------------------------- 2. trace analysis

def _load_trace(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return [e for e in data.get("traceEvents", data if isinstance(data, list) else []) if e.get("ph") == "X"]


def _innermost_op(ops_by_tid: dict, tid, t0: float, t1: float) -> str | None:
    best = None
    for e in ops_by_tid.get(tid, ()):
        if e["ts"] <= t0 and e["ts"] + e["dur"] >= t1 and (best is None or e["dur"] <= best["dur"]):
            best = e
    return best["name"] if best else None


def analyse_trace(events: list[dict], steps: int, top: int = 8) -> list[dict]:
    """Per step window (user annotation host_step<i>): wall, busy, idle, largest gaps, syncs inside den<i>."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATS]
    by_corr = {e.get("args", {}).get("correlation"): e for e in runtime}
    ops_by_tid: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_tid.setdefault(e.get("tid"), []).append(e)
    ann = {e["name"]: e for e in events if e.get("cat") == "user_annotation"}
    out = []
    for i in range(steps):
        w = ann.get(f"host_step{i}")
        d = ann.get(f"den{i}")
        if w is None:
            out.append({"step": i, "error": "no annotation in the trace"})
            continue
        w0, w1 = w["ts"], w["ts"] + w["dur"]
        ks = [e for e in gpu if e["ts"] < w1 and e["ts"] + e["dur"] > w0]
        busy, gaps = 0.0, []
        cur_s = cur_e = None
        prev = None  # kernel whose end closes the current merged interval
        for e in ks:
            s, t = max(e["ts"], w0), min(e["ts"] + e["dur"], w1)
            if cur_e is None:
                gaps.append((s - w0, None, e))
                cur_s, cur_e, prev = s, t, e
            elif s > cur_e:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, prev, e))
                cur_s, cur_e, prev = s, t, e
            elif t > cur_e:
                cur_e, prev = t, e
        if cur_e is not None:
            busy += cur_e - cur_s
            gaps.append((w1 - cur_e, prev, None))
        wall = w1 - w0

        def describe(g, w0=w0):
            size, before, after = g
            item = {"gap_ms": size / 1e3, "before": before["name"][:90] if before else "(step start)",
                    "after": after["name"][:90] if after else "(step end)"}
            if after is not None:
                item["at_ms"] = (after["ts"] - w0) / 1e3
                rt = by_corr.get(after.get("args", {}).get("correlation"))
                if rt is not None:
                    item["launched_by"] = _innermost_op(ops_by_tid, rt.get("tid"), rt["ts"], rt["ts"] + rt["dur"])
                    item["launch_to_start_ms"] = (after["ts"] - rt["ts"]) / 1e3
            return item

        syncs = []
        if d is not None:
            d0, d1 = d["ts"], d["ts"] + d["dur"]
            for e in runtime:
                n = e["name"]
                # explicit waits, blocking copies, and allocator calls long enough to have waited for the device
                if d0 <= e["ts"] <= d1 and ("Synchronize" in n or n in ("cudaMemcpy", "cuMemcpy")
                                            or ("Memcpy" in n and e["dur"] > 50)
                                            or (("Malloc" in n or "Free" in n or "cuMem" in n) and e["dur"] > 20)):
                    syncs.append({"call": n, "ms": e["dur"] / 1e3, "at_ms": (e["ts"] - w0) / 1e3,
                                  "in_op": _innermost_op(ops_by_tid, e.get("tid"), e["ts"], e["ts"] + e["dur"])})
        big = sorted(gaps, key=lambda g: -g[0])
        out.append({"step": i, "wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "idle_ms": (wall - busy) / 1e3,
                    "kernels": len(ks), "gaps_over_50us": sum(1 for g in gaps if g[0] > 50),
                    "idle_in_gaps_over_50us_ms": sum(g[0] for g in gaps if g[0] > 50) / 1e3,
                    "lead_ms": gaps[0][0] / 1e3 if gaps else None, "tail_ms": gaps[-1][0] / 1e3 if gaps else None,
                    "den_ms": d["dur"] / 1e3 if d else None,
                    "largest_gaps": [describe(g) for g in big[:top]], "syncs_in_denoiser": syncs})
    return out


# ---------------------------------------------------------------- 3. sync debug mode

def syncs_during(fn) -> list[dict]:
    """Synchronizing CUDA calls torch reports in sync-debug 'warn' mode while fn() runs, with project call sites."""
    import torch

    seen: dict = {}

    def hook(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "/h3direct/" in f.filename or "/benchmarks/" in f.filename]
        site = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in reversed(stack[-3:]))
        key = (str(message).splitlines()[0][:80], site)
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.current_stream().synchronize()  # not counted: issued after the mode is reset below
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [{"message": m, "site": s, "count": n} for (m, s), n in seen.items()]


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    import torch
    from bench_dit import make_inputs
    from synthetic_gpu import build_dit
    from torch.profiler import ProfilerActivity, profile, record_function

    from h3direct.config import H3Config
    from h3direct.dit.attention import unavailable_reason
    from h3direct.dit.denoiser import Denoiser, audio_scale_of, model_forward
    from h3direct.sampling import host_sigma

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(C.PRESETS), default="full")
    ap.add_argument("--weights", default="nvfp4")
    ap.add_argument("--attention", default="auto", help="auto: fa3 when it can run, else sdpa")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    res: dict = {"env": C.env_info(dev)}
    out = args.out or (str(Path(os.environ["OUT"]) / "host_step.json") if os.environ.get("OUT") else None)

    def save():
        if out:
            Path(out).write_text(json.dumps(C._jsonable(res), indent=1))

    if cuda:
        res["host_times"] = check_host_times(dev)
        C.log(f"host sigma mirror: {res['host_times']}")
    p = C.PRESETS[args.preset]
    config = H3Config.from_name(p.dit_config)
    wl = C.workload(p.width, p.height, p.frames, p.text_len)
    model, info = build_dit(config, args.weights, dev, nvfp4_mode=p.nvfp4_mode)
    res["build"] = info
    C.log(f"model built: {info.get('model_gib', 0):.2f} GiB in {info.get('build_s', 0):.0f} s")
    video, audio, text, cond = make_inputs(config, wl, dev, 0)
    # the app hands the tags over on the device; all text (tag 1) gives the same runs as no tags
    cond.text_token_tags = torch.ones(wl["text_len"], dtype=torch.int64, device=dev)
    like = torch.empty(0, device=dev, dtype=model.compute_dtype)
    attn = args.attention
    if attn == "auto":
        attn = "fa3" if unavailable_reason("fa3", like) is None else "sdpa"
    res["attention"] = attn
    scale = audio_scale_of(model)
    with torch.inference_mode():
        ctx = model.preprocess_text(text, backend=attn)
    den = Denoiser(model, ctx, cond, audio_scale=scale, backend=attn)
    dtype = model.compute_dtype

    def uncached(sigma):
        """The plan before the step invariants: σ and tags read back, condition rows / rope made every step."""
        s = sigma.reshape(-1)[:1].float()
        ts = (s * 1000.0).float()
        with torch.no_grad():
            ov, oa = model_forward(model, video.to(dtype), audio.to(dtype), ts, ctx, cond, audio_scale=scale,
                                   backend=attn, layout=den._layout)
        return video - ov.float() * s.reshape(1, 1, 1, 1, 1), audio - oa.float() * s.reshape(1, 1, 1, 1)

    def fresh(value, tagged=True):
        t = torch.tensor([value], dtype=torch.float32).to(dev)  # made outside the timed regions
        return host_sigma.tag(t, value) if tagged else t

    def profiled():  # 2. synchronized steps under the profiler
        sigmas = [fresh(0.8 - 0.1 * i) for i in range(args.steps)]
        walls = []
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for i, s in enumerate(sigmas):
                C.sync(dev)
                t0 = time.perf_counter()
                with record_function(f"host_step{i}"):
                    C.sync(dev)
                    with record_function(f"den{i}"):
                        den(video, audio, s)
                    C.sync(dev)
                walls.append(time.perf_counter() - t0)
        res["synced_wall_s"] = walls
        C.log(f"profiled steps: wall {[round(w, 4) for w in walls]}")
        trace = f"/tmp/host_step_trace_{os.getpid()}.json"
        prof.export_chrome_trace(trace)
        try:
            res["steps"] = analyse_trace(_load_trace(trace), args.steps)
        finally:
            os.unlink(trace)

    def sync_debug():  # 3. sync debug mode
        with torch.inference_mode(False):  # a normal tensor, as run_contract's σ: untagged, its read remembered
            same = torch.tensor([0.55], device=dev)
        den(video, audio, same)
        tagged, untagged, old = fresh(0.45), fresh(0.35, tagged=False), fresh(0.25)
        C.sync(dev)
        res["sync_debug"] = {
            "warm_same_sigma": syncs_during(lambda: den(video, audio, same)),
            "warm_fresh_tagged_sigma": syncs_during(lambda: den(video, audio, tagged)),
            "warm_fresh_untagged_sigma": syncs_during(lambda: den(video, audio, untagged)),
            "uncached_path": syncs_during(lambda: uncached(old)),
        }

    def bitwise():  # 4. cached vs uncached
        bit = res["bitwise_cached_vs_uncached"] = {}
        for v in (0.8, 0.3):
            a, b = den(video, audio, fresh(v)), uncached(fresh(v))
            bit[str(v)] = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            del a, b
        if not all(bit.values()):  # nondeterministic kernels, or a real difference?
            a, b = uncached(fresh(0.8)), uncached(fresh(0.8))
            bit["uncached_twice_equal"] = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            del a, b

    def timing():  # 5. without the profiler: synced steps, and CUDA events without per-step syncs (run_contract)
        if time.perf_counter() - t_start > 150 and cuda:
            res["timing_skipped"] = "time budget"
            return
        for key, fn in (("synced_wall_noprof_s", den), ("synced_wall_uncached_s", None)):
            walls = []
            for i in range(args.steps if fn is not None else max(2, args.steps - 1)):
                s = fresh(0.75 - 0.1 * i)
                C.sync(dev)
                t0 = time.perf_counter()
                if fn is None:
                    uncached(s)
                else:
                    fn(video, audio, s)
                C.sync(dev)
                walls.append(time.perf_counter() - t0)
            res[key] = walls
        same = fresh(0.8)
        res["events_denoiser_s"] = C.time_calls(lambda: den(video, audio, same), dev, warmup=0,
                                                iters=args.steps)["times_s"]
        res["events_uncached_s"] = C.time_calls(lambda: uncached(same), dev, warmup=0,
                                                iters=max(2, args.steps - 1))["times_s"]

    with torch.inference_mode():
        t0 = time.perf_counter()
        den(video, audio, torch.tensor([0.9], device=dev))
        C.sync(dev)
        res["warmup_s"] = time.perf_counter() - t0
        C.log(f"warm-up step {res['warmup_s']:.2f} s")
        for name, fn in (("profiled", profiled), ("sync_debug", sync_debug if cuda else None),
                         ("bitwise", bitwise), ("timing", timing)):
            if fn is None:
                continue
            try:  # one failing part does not lose the others
                fn()
            except Exception as exc:  # noqa: BLE001 - reported in the JSON and the summary
                res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                C.log(f"{name} failed: {res['errors'][name]}")
            save()
    res["total_s"] = time.perf_counter() - t_start
    save()
    summary(res)
    return 0


def summary(res: dict) -> None:
    print("\n== host/device idle per DiT step "
          f"({res.get('attention')}, {res.get('build', {}).get('weights')}; wall with a sync around each step)")
    ht = res.get("host_times")
    if ht:
        print(f"  host sigma mirror vs device ops: {ht['mismatches']} / {ht['cases']} mismatches (batched), "
              f"{ht['scalar_mismatches']} / {ht['scalar_cases']} (per-call ops); CPU rounding differs on "
              f"{ht['cpu_rounding_differs']}  -> {'OK' if ht['mismatches'] == ht['scalar_mismatches'] == 0 else 'FAIL'}")
    print(f"  {'step':>4} {'wall ms':>9} {'busy ms':>9} {'idle ms':>8} {'lead ms':>8} {'tail ms':>8} {'gaps>50us':>9}"
          f" {'in them ms':>10} {'syncs':>5}")
    for s in res.get("steps", []):
        if "error" in s:
            print(f"  {s['step']:>4} {s['error']}")
            continue
        print(f"  {s['step']:>4} {s['wall_ms']:9.2f} {s['busy_ms']:9.2f} {s['idle_ms']:8.2f} {s['lead_ms'] or 0:8.2f}"
              f" {s['tail_ms'] or 0:8.2f} {s['gaps_over_50us']:9d} {s['idle_in_gaps_over_50us_ms']:10.2f}"
              f" {len(s['syncs_in_denoiser']):5d}")
    steps = [s for s in res.get("steps", []) if "error" not in s]
    if steps:
        last = steps[-1]
        print(f"  largest gaps of step {last['step']}:")
        for g in last["largest_gaps"]:
            print(f"    {g['gap_ms']:7.3f} ms at {g.get('at_ms', float('nan')):8.2f} ms  {g['before'][:40]} -> "
                  f"{g['after'][:40]}  (launched by {g.get('launched_by')}, launch->start "
                  f"{g.get('launch_to_start_ms', float('nan')):.3f} ms)")
        for s in steps:
            for y in s["syncs_in_denoiser"][:4]:
                print(f"    step {s['step']} sync: {y['call']} {y['ms']:.3f} ms at {y['at_ms']:.2f} ms in {y['in_op']}")
    for name, rows in (res.get("sync_debug") or {}).items():
        n = sum(r["count"] for r in rows)
        print(f"  sync-debug {name}: {n} synchronizing call(s)")
        for r in rows[:6]:
            print(f"    {r['count']:3d}x {r['site'] or '(no project frame)'}")
    bit = res.get("bitwise_cached_vs_uncached")
    if bit:
        print(f"  bitwise cached vs uncached x0: {bit}")
    for key, what in (("synced_wall_s", "sync around each step, profiled"),
                      ("synced_wall_noprof_s", "sync around each step"),
                      ("synced_wall_uncached_s", "sync around each step, uncached path (old plan)"),
                      ("events_denoiser_s", "CUDA events, no per-step sync (run_contract)"),
                      ("events_uncached_s", "CUDA events, no per-step sync, uncached path")):
        if res.get(key):
            print(f"  {key:24s} median {statistics.median(res[key]):.4f} s  {[round(t, 4) for t in res[key]]}"
                  f"  ({what})")
    for name, err in (res.get("errors") or {}).items():
        print(f"  ERROR in {name}: {err}")
    if res.get("timing_skipped"):
        print(f"  timing skipped: {res['timing_skipped']}")
    print(f"  total {res.get('total_s', 0):.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
