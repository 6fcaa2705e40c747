"""Run a benchmark contract (benchmarks/ref2va-960x544-124f.json) and write its result JSON.

    python -m benchmarks.run_contract --contract benchmarks/ref2va-960x544-124f.json --out R.json [--comfy-root R]
    python -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f.json --result R.json

A contract of kind "e2e" (benchmarks/ref2va-960x544-124f-e2e.json: a whole generation to an mp4, per stage, both
sides) is run by `run_e2e.py` (its flags: --configs, --tokenizer, --merge). What follows is the DiT contract.

h3direct, per path of the contract (an attention backend with its options, FP8 linears or not): s/step (median of
the timed Denoiser calls after the warm-up, CUDA events), the sum of the timed steps, text refine, peak GPU memory,
the path's recorded settings; then the hot floor (the four block GEMMs and the exact path's attention at the
contract's shapes, cycled for --floor-seconds as a DiT block does: GEMMs + attention sustained, x num_layers); then
the VAE decode (fp16 video + fp32 audio) and end to end. Weights: the contract's synthetic full-size checkpoint built
on the GPU.

With --comfy-root, ComfyUI in every configuration of the contract's "comfyui" table (its default as the oracle opens
it; --use-sage-attention and its fastest exact setting as main.py starts it), each in its own process (ComfyUI
reads its flags once per process), its own loader and CFGGuider at cfg 1, the same weights and workload, once before
h3direct and once after (--comfy-rounds): x_comfyui_default and x_comfyui_best are same-run ratios. Without it the
result says "no same-run ComfyUI". --smoke: tiny sizes (a CPU check of the plumbing; compare refuses it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import _common as C
from benchmarks.compare import ratios, tier_spec
from h3direct.app.frontier.grid import options_of

# ComfyUI attention names (oracle.comfy_env.ATTENTION_FLAGS) -> the package the flag needs, when not ComfyUI's own
ATTENTION_PACKAGES = {"sage": "sageattention", "flash": "flash_attn"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_contract", description=__doc__.split("\n")[0])
    ap.add_argument("--contract", required=True)
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--paths", default=None, help="comma list of the contract's paths (default all)")
    ap.add_argument("--comfy-root", default=None, help="ComfyUI checkout: time it in the same run")
    ap.add_argument("--comfy-rounds", type=int, choices=(1, 2), default=2,
                    help="ComfyUI before h3direct only (1) or before and after (2, default)")
    ap.add_argument("--comfy-timeout", type=float, default=600.0, help="seconds for one ComfyUI configuration")
    ap.add_argument("--comfy-only", default=None, metavar="CONFIG:ATTENTION",
                    help="time one ComfyUI configuration of the contract with one of its attention settings in this "
                         "process and write its JSON to --out (what the run does in a subprocess per configuration; "
                         "e2e: CONFIG)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: the contract's; compare refuses "
                                                            "another count)")
    ap.add_argument("--floor-seconds", type=float, default=None,
                    help="length of the hot-floor loop (default: the contract's; 0 skips it)")
    ap.add_argument("--no-vae", action="store_true", help="skip the VAE decode (end_to_end is then not reported)")
    ap.add_argument("--quality-dir", default=None, type=Path, metavar="DIR",
                    help="the validation set's folder: measure every path's quality on each of the contract's quality "
                         "cases (benchmarks/quality.py; with --comfy-root a case not recorded there is recorded first)")
    ap.add_argument("--tiers", default=None, metavar="FILE",
                    help="the tiers file the contract's tier paths take their options from (default: $H3_TIERS, "
                         "else the runtime's <cache>/tiers.json); chosen on this GPU by `python -m benchmarks.frontier`")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device (plumbing check, not a result)")
    e2e = ap.add_argument_group("e2e contract (run_e2e.py)")
    e2e.add_argument("--configs", default=None, help="comma list of the contract's configurations (default all)")
    e2e.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="the Qwen2 tokenizer's folder (default: the --comfy-root checkout's qwen25_tokenizer)")
    e2e.add_argument("--merge", nargs="+", default=None, metavar="RESULT",
                     help="write one result (--out) from runs of disjoint configurations")
    return ap.parse_args(argv)


_fail = C.usage_error


def _contract(path: str) -> dict:
    try:
        c = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        _fail(f"--contract {path}: {exc}")
    if not isinstance(c, dict):
        _fail(f"--contract {path}: expected a JSON object")
    if c.get("kind") == "e2e":
        return c
    for key in ("contract", "workload", "weights", "steps", "paths"):
        if key not in c:
            _fail(f"--contract {path}: missing {key!r}")
    return c


def _check_args(args, contract: dict, dev: str) -> tuple[list[str], dict, dict | None]:
    """(the paths to run, the contract with its tier paths resolved, the tiers file's record); every bad flag is a
    one-line error here, before anything is built."""
    names = args.paths.split(",") if args.paths else list(contract["paths"])
    unknown = [n for n in names if n not in contract["paths"]]
    if unknown:
        _fail(f"--paths: {', '.join(unknown)} not a path of the contract ({', '.join(contract['paths'])})")
    from h3direct.app.env import read_tiers
    from h3direct.errors import H3Error

    floor_path, _ = _floor(contract, args)
    contract, tiers = resolve_tier_paths(contract, list(dict.fromkeys(names + ([floor_path] if floor_path else []))),
                                           args.tiers or read_tiers(), dev)

    for n in names:
        try:
            options_of(contract["paths"][n])
        except H3Error as exc:
            _fail(f"--contract: path {n}: {exc}")
    modes = {contract["paths"][n].get("fp8_linear", "off") for n in names} - {"off"}
    if len(modes) > 1:
        _fail(f"one fp8_linear mode per run, the paths ask {sorted(modes)} (run them with --paths in two runs)")
    C.check_run_flags(args)
    if contract.get("quality") or args.quality_dir is not None:
        from benchmarks import quality

        try:
            quality.cases_of(contract.get("quality"))
        except ValueError as exc:
            _fail(f"--contract: {exc}")
    if args.quality_dir is not None:
        if args.quality_dir.exists() and not args.quality_dir.is_dir():
            _fail(f"--quality-dir {args.quality_dir}: not a directory")
    return names, contract, tiers


def resolve_tier_paths(contract: dict, names: list[str], tiers_path, device: str):
    """(contract, tiers record) with each of `names` whose path names a tier (`{"tier": NAME, "class": ...}`) given
    that tier's options from the tiers file at `tiers_path` (None: the runtime's default), which must have been chosen
    on `device`'s kind of device. The record (file, sha256, machine, made) goes into the result; None when no path of
    `names` names a tier. A missing, malformed or foreign file, or a tier it lacks, is one line and exit 2."""
    wanted = [n for n in names if "tier" in contract["paths"][n]]
    if not wanted:
        return contract, None
    from h3direct.app import tiers as T
    from h3direct.errors import H3Error

    try:
        found = T.load_for(tiers_path, device)
        chosen = {n: found.get(contract["paths"][n]["tier"]) for n in wanted}
    except H3Error as exc:
        _fail(f"--tiers: {exc}")
    paths = dict(contract["paths"])
    for n, tier in chosen.items():
        paths[n] = {**paths[n], **tier_spec(tier.options), "tier_record": tier.provenance(found)}
    record = {"file": str(found.path.resolve()), "sha256": found.sha256, "machine": found.machine,
              "made": {k: found.made.get(k) for k in ("commit", "tree", "date", "cases")}}
    return {**contract, "paths": paths}, record


def _floor(contract: dict, args) -> tuple[str | None, float]:
    """(the path whose attention the hot floor runs, its seconds: --floor-seconds, else the contract's); no path when
    there is no floor (0 seconds, or a contract without that path)."""
    floor = contract.get("floor", {})
    seconds = floor.get("seconds", 15.0) if args.floor_seconds is None else args.floor_seconds
    path = floor.get("path", "exact")
    return (path if seconds > 0 and path in contract["paths"] else None), seconds


def _workload(contract: dict, smoke: bool) -> tuple[dict, C.Preset]:
    preset = C.PRESETS["tiny" if smoke else "full"]
    if smoke:
        return C.workload(preset.width, preset.height, preset.frames, preset.text_len), preset
    w = contract["workload"]
    wl = C.workload(w["width"], w["height"], w["frames"], w["text_tokens"])
    if wl["seq_len"] != w.get("seq_len", wl["seq_len"]):
        _fail(f"--contract: its workload gives S = {wl['seq_len']}, it says {w['seq_len']}")
    return wl, preset


# ---------------------------------------------------------------- h3direct

def _load_time(model, options) -> None:
    """The path's load-time kernel options on the built model (`dit.loader.apply_load_time`)."""
    from h3direct.dit.loader import apply_load_time

    apply_load_time(model, **options.kernels.load_time())


def run_h3direct(contract: dict, args, names: list[str], wl: dict, preset, dev) -> tuple[dict, dict, dict | None]:
    import torch

    from benchmarks.bench_dit import make_inputs
    from benchmarks.synthetic_gpu import build_dit
    from h3direct.config import H3Config

    w = contract["weights"]
    config = H3Config.from_name(preset.dit_config)
    model, build = build_dit(config, w["dit"], dev, nvfp4_mode=w.get("nvfp4_mode", "w4a16"), seed=w.get("seed", 0))
    inputs = make_inputs(config, wl, dev, w.get("seed", 0))
    like = torch.empty(0, device=dev, dtype=model.compute_dtype)
    opts = {n: options_of(contract["paths"][n]) for n in names}
    paths = {}
    # the exact paths first; then the block linears become FP8 once, in place, for the FP8 paths
    for name in sorted(names, key=lambda n: opts[n].kernels.fp8_linear != "off"):
        _load_time(model, opts[name])
        C.free_memory(dev)
        try:
            paths[name] = _run_path(contract, args, name, opts[name], model, build, inputs, like, dev)
        except Exception as exc:  # noqa: BLE001  one path's failure is its result; the other paths are still timed
            paths[name] = {"class": contract["paths"][name].get("class"), "status": C.failed(exc)}
            C.log(f"{name}: {paths[name]['status']}")
    del model, inputs
    C.free_memory(dev)
    floor = None
    floor_path, seconds = _floor(contract, args)
    if floor_path is not None:
        exact = contract["paths"][floor_path]
        floor = hot_floor(config, wl["seq_len"], options_of(exact), dev, seconds, w.get("seed", 0))
        C.log(f"hot floor ({exact['attention']}): {floor.get('s_per_step', floor.get('status'))}")
    if not args.no_vae:
        vae_s = vae_decode(contract, preset, wl, dev)
        for res in paths.values():
            if res.get("status") == "ok":
                res["vae_decode_s"] = vae_s
                res["end_to_end_s"] = res["text_refine_s"] + res["denoise_total_s"] + vae_s
    return paths, {"build": build, "seq_len": wl["seq_len"]}, floor


def _run_path(contract: dict, args, name: str, options, model, build: dict, inputs, like, dev) -> dict:
    """One path: its text refine and timed Denoiser steps with its own options, its calls counted for itself."""
    import torch

    from h3direct.counts import counting
    from h3direct.dit.attention import unavailable_reason
    from h3direct.dit.denoiser import Denoiser, audio_scale_of

    spec, (video, audio, text, cond) = contract["paths"][name], inputs
    res = {"class": spec.get("class"), "settings": C.path_settings(model, options, build, like)}
    if "tier_record" in spec:  # a tier path: the tier it ran (name, file, sha256, options)
        res["tier"] = spec["tier_record"]
    reason = unavailable_reason(options.attention, like)
    if reason is not None:
        C.log(f"{name}: {options.attention.backend} unavailable: {reason}")
        return {**res, "status": f"unavailable: {reason}"}
    sigma = torch.tensor([0.8], dtype=torch.float32, device=dev)
    warmup, timed = contract["steps"]["warmup"], args.steps or contract["steps"]["timed"]
    with torch.inference_mode(), counting() as calls:
        C.sync(dev)
        t = time.perf_counter()
        context = model.preprocess_text(text, options=options)
        C.sync(dev)
        res["text_refine_s"] = time.perf_counter() - t
        den = Denoiser(model, context, cond, audio_scale=audio_scale_of(model), options=options)
        C.reset_peak(dev)
        with C.GpuSampler(dev) as gpu:
            r = C.time_calls(lambda: den(video, audio, sigma), dev, warmup=warmup, iters=timed)
    res.update(status="ok", warmup_s=r["warmup_s"], step_s=r["times_s"], s_per_step=r["median_s"],
               denoise_total_s=sum(r["times_s"]), peak_gpu_gib=C.peak_gib(dev),
               attention_calls=calls.as_dict().get("attention"), gpu_clock_power=gpu.summary)
    C.log(f"{name} ({options.attention.backend}): {res['s_per_step']:.3f} s/step, peak {res['peak_gpu_gib']} GiB")
    return res


def hot_floor(config, seq_len: int, options, dev, seconds: float, seed: int) -> dict:
    """GEMMs + attention, sustained: the four block GEMMs (bf16 activations times NVFP4-rounded weights, what W4A16
    multiplies by) and one call of the exact path's attention (`options.attention`) at [1, heads, S, head_dim], cycled in a block's order (qkv, attention,
    out, fc1, fc2) for `seconds`; per call the mean of the loop's second half (steady clocks and power); the floor
    is num_layers x their sum. What the exact path cannot beat at the clocks this GPU holds under that load."""
    import torch
    import torch.nn.functional as F

    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from h3direct.dit.attention import attention as attend
    from h3direct.dit.attention import unavailable_reason

    g = torch.Generator(device=dev).manual_seed(seed)
    dtype = torch.bfloat16
    shapes = C.block_gemm_shapes(config, seq_len)
    xs = {n: torch.randn(m, k, device=dev, generator=g, dtype=dtype) for n, m, _, k in shapes}
    ws = {}
    for n, _, out, k in shapes:
        q4 = quantize_nvfp4((0.02 * torch.randn(out, k, device=dev, generator=g)).to(dtype))
        ws[n] = dequantize_nvfp4(q4.packed, q4.block_scale, q4.global_scale, dtype, (out, k))
    h, d = config.num_attention_heads, config.attention_head_dim
    q, k, v = (torch.randn(1, h, seq_len, d, device=dev, generator=g, dtype=dtype) for _ in range(3))
    attention = options.attention.backend
    reason = unavailable_reason(options.attention, q)
    if reason is not None:
        return {"attention": attention, "status": f"unavailable: {reason}"}
    calls = {n: (lambda n=n: F.linear(xs[n], ws[n])) for n in xs} | {
        "attention": lambda: attend(q, k, v, options.attention)}
    order = ["qkv_proj", "attention", "out_proj", "fc1", "fc2"]
    for name in order:  # warm-up: kernel choice and compilation
        calls[name]()
    C.sync(dev)
    times: dict[str, list[float]] = {n: [] for n in order}
    cuda = C.is_cuda(dev)

    def cycle():  # one block's calls back to back (CUDA events, one wait per cycle), as the step runs them
        marks = []
        for name in order:
            a = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                a.record()
            calls[name]()
            b = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                b.record()
            marks.append((name, a, b))
        C.sync(dev)
        for name, a, b in marks:
            times[name].append(a.elapsed_time(b) / 1e3 if cuda else b - a)

    end = time.perf_counter() + seconds
    with C.GpuSampler(dev, period_ms=200) as gpu:
        while time.perf_counter() < end or not times["fc2"]:
            cycle()
    ms = {n: 1e3 * statistics.fmean(t[len(t) // 2:]) for n, t in times.items()}
    return {"attention": attention, "status": "ok", "seconds": seconds, "calls": len(times["fc2"]), "ms": ms,
            "s_per_step": config.num_layers * sum(ms.values()) / 1e3, "gpu_clock_power": gpu.summary}


def vae_decode(contract: dict, preset, wl: dict, dev) -> float:
    import torch

    from benchmarks.synthetic_gpu import build_audio_vae, build_video_vae
    from h3direct.vae import decode_audio, decode_video

    name = contract.get("vae_dtype", "fp16")
    vae, _ = build_video_vae(preset.vae_preset, dev, dtype={"fp16": torch.float16, "bf16": torch.bfloat16,
                                                            "fp32": torch.float32}[name])
    avae, _ = build_audio_vae(preset.vae_preset, dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    z = torch.randn(wl["video_latent"], generator=g).to(dev)
    za = torch.randn(wl["audio_latent"], generator=g).to(dev)
    with torch.inference_mode():
        decode_video(vae, z[:, :, :2, :4, :4].contiguous(), name)  # warm-up
        C.sync(dev)
        t = time.perf_counter()
        decode_video(vae, z, name)
        decode_audio(avae, za)
        C.sync(dev)
        seconds = time.perf_counter() - t
    del vae, avae
    C.free_memory(dev)
    return seconds


# ---------------------------------------------------------------- ComfyUI, one configuration per process

def comfy_worker(args, contract: dict) -> int:
    """--comfy-only CONFIG:ATTENTION: open ComfyUI with that configuration's settings, step the contract's weights
    and workload through its own loader and sampler, write the timing JSON to --out."""
    config_name, _, attention = args.comfy_only.partition(":")
    spec = (contract.get("comfyui") or {}).get(config_name)
    if spec is None or attention not in spec["attention"]:
        _fail(f"--comfy-only {args.comfy_only!r}: not a configuration of the contract")
    device = args.device or "cpu"
    if spec["settings"] == "user" and device == "cuda":
        from oracle.comfy_env import prepare_user_process

        prepare_user_process(args.comfy_root)  # before torch: ComfyUI's CUDA allocator choice
    from oracle.comfy_env import open_comfy

    cuda = device == "cuda"
    env = open_comfy(args.comfy_root, device=device, compute_dtype="bf16" if cuda else "fp32", attention=attention,
                     settings=spec["settings"])
    wl, preset = _workload(contract, args.smoke)
    res = _comfy_steps(env, contract, args, wl, preset, device)
    res.update(config=config_name, attention=attention, settings=spec["settings"], **C.comfy_provenance(env))
    C.write_result(args.out, res)
    return 0


def _comfy_steps(env, contract: dict, args, wl: dict, preset, dev) -> dict:
    import torch

    from benchmarks.bench_dit import make_inputs
    from h3direct.config import H3Config

    w = contract["weights"]
    cuda = C.is_cuda(dev)
    config = H3Config.from_name(preset.dit_config)
    patcher, load_s = C.comfy_dit(env, config, w["dit"], w.get("seed", 0), dev)
    video, audio, text, cond = make_inputs(config, wl, "cpu", w.get("seed", 0))
    refs = [{"kind": "image", "latent": r["latent"], "latent_t": 1, "latent_h": r["latent_h"],
             "latent_w": r["latent_w"], "ref_audio_t": 0} for r in cond.refs]
    tags = torch.zeros(text.shape[1], dtype=torch.int64)
    conditioning = [[text.float(), {"minimax_token_tags": tags, "minimax_refs": refs}]]
    warmup, timed = contract["steps"]["warmup"], args.steps or contract["steps"]["timed"]
    times: list[float] = []

    def steps(model, x, sigmas, extra_args=None, callback=None, disable=None):
        for i in range(warmup + timed):
            C.sync(dev)
            t = time.perf_counter()
            x = model(x, sigmas[i] * x.new_ones([x.shape[0]]), **(extra_args or {}))
            C.sync(dev)
            times.append(time.perf_counter() - t)
        return x

    guider = env.samplers.CFGGuider(patcher)
    guider.set_cfg(1.0)
    guider.inner_set_conds({"positive": conditioning})
    nested = env.nested_tensor
    noise = nested.NestedTensor([torch.randn_like(video), torch.randn_like(audio)])
    latent = nested.NestedTensor([video, audio])
    sigmas = torch.linspace(0.9, 0.1, warmup + timed + 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), C.GpuSampler(dev) as gpu:
        guider.sample(noise, latent, env.samplers.KSAMPLER(steps), sigmas, disable_pbar=True, seed=0)
    return {"status": "ok", "s_per_step": statistics.median(times[warmup:]), "step_s": times[warmup:],
            "warmup_s": times[:warmup], "load_s": load_s,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / C.GIB if cuda else None, "gpu_clock_power": gpu.summary}


def comfy_round(args, contract: dict, dev: str, order: list[tuple[str, str]]) -> dict:
    """One round: each (configuration, attention) in its own `--comfy-only` process; a missing package or a failed
    process is that entry's status."""
    out = {}
    for config_name, attention in order:
        key = f"{config_name}:{attention}"
        package = ATTENTION_PACKAGES.get(attention)
        if package and importlib.util.find_spec(package) is None:
            out[key] = {"status": f"unavailable: {package} is not importable here"}
            C.log(f"ComfyUI {key}: {out[key]['status']}")
            continue
        out[key] = C.run_comfy_process(args, key, dev)
        C.log(f"ComfyUI {key}: " + (f"{out[key]['s_per_step']:.3f} s/step" if out[key].get("status") == "ok"
                                    else out[key]["status"]))
    return out


def merge_comfy(contract: dict, rounds: list[dict]) -> dict:
    """Per configuration: each attention setting's rounds merged (s/step = median of every timed step of every
    round), the fastest that ran chosen."""
    configs = {}
    for name, spec in contract["comfyui"].items():
        tried = {}
        for attention in spec["attention"]:
            runs = [r[f"{name}:{attention}"] for r in rounds if f"{name}:{attention}" in r]
            ok = [x for x in runs if x.get("status") == "ok"]
            if not ok:
                tried[attention] = {"status": runs[0]["status"] if runs else "not run"}
                continue
            steps = [t for x in ok for t in x["step_s"]]
            peaks = [x["peak_gpu_gib"] for x in ok if x.get("peak_gpu_gib") is not None]
            tried[attention] = {**ok[0], "s_per_step": statistics.median(steps), "step_s": steps,
                                "peak_gpu_gib": max(peaks) if peaks else None, "rounds": runs}
        ran = {a: t for a, t in tried.items() if t.get("status") == "ok"}
        best = min(ran, key=lambda a: ran[a]["s_per_step"]) if ran else None
        configs[name] = {"class": spec["class"], "settings": spec["settings"], "attention": spec["attention"],
                         "chosen": best, "tried": tried,
                         **({"status": "ok", "s_per_step": ran[best]["s_per_step"],
                             "peak_gpu_gib": ran[best]["peak_gpu_gib"]} if best else
                            {"status": "; ".join(f"{a}: {t['status']}" for a, t in tried.items())})}
    return configs


def add_quality(contract: dict, args, names: list[str], dev, result: dict) -> None:
    """The quality axis (benchmarks/quality.py): each path's and each ComfyUI configuration's output error on every
    case of the contract's quality entry and the worst of them, after the timings, on the same device."""
    from benchmarks import quality

    spec = contract.get("quality")
    if not spec:
        return
    cases = quality.cases_of(spec)
    if args.quality_dir is None:
        result["quality"] = {"cases": cases, "status": "not measured (run with --quality-dir)"}
        return
    q = quality.measure_cases(contract, names, args.quality_dir, cases, str(dev), args.comfy_root)
    result["quality"] = {"cases": q["cases"], "status": q["status"]}
    for name, values in q["paths"].items():
        result["paths"][name]["quality"] = values
    for name, values in q["comfyui"].items():
        config = ((result.get("comfyui") or {}).get("configs") or {}).get(name)
        if config is not None:
            config["quality"] = values


def main(argv=None) -> int:
    args = parse_args(argv)
    contract = _contract(args.contract)
    if contract.get("kind") == "e2e":
        from benchmarks import run_e2e

        if args.quality_dir is not None:
            _fail("--quality-dir: the e2e contract has no quality axis (the DiT contract has)")
        return run_e2e.main(args, contract, argv)
    given = [flag for flag, value in (("--configs", args.configs), ("--tokenizer", args.tokenizer),
                                      ("--merge", args.merge)) if value is not None]
    if given:
        _fail(f"{', '.join(given)}: a flag of the e2e contract, not of {contract['contract']}")
    if args.comfy_only:
        if not args.comfy_root:
            _fail("--comfy-only needs --comfy-root")
        from h3direct.errors import H3Error

        try:
            return comfy_worker(args, contract)
        except H3Error as exc:  # a missing package, a checkout without H3: one line for the result's status
            print(f"run_contract: error: {exc}", file=sys.stderr)
            return 2
    dev = C.run_device(args)
    names, contract, tiers = _check_args(args, contract, dev)
    wl, preset = _workload(contract, args.smoke)
    w = contract["weights"]
    result = {**C.result_header(contract, args, argv, dev, wl),
              "steps": {"warmup": contract["steps"]["warmup"], "timed": args.steps or contract["steps"]["timed"]},
              "tiers": tiers}
    order = [(n, a) for n, spec in (contract.get("comfyui") or {}).items() for a in spec["attention"]]
    rounds = []
    if args.comfy_root:
        rounds.append(comfy_round(args, contract, dev, order))
    result["paths"], result["h3direct"], result["hot_floor"] = run_h3direct(contract, args, names, wl, preset, dev)
    build = result["h3direct"]["build"]  # the weights as built
    result["weights"] = {"source": "synthetic", "dit_preset": preset.dit_config, "dit": build["weights"],
                         "nvfp4_mode": build["nvfp4_mode"], "seed": w.get("seed", 0)}
    if args.comfy_root and args.comfy_rounds == 2:
        rounds.append(comfy_round(args, contract, dev, order[::-1]))
    if args.comfy_root:
        configs = merge_comfy(contract, rounds)
        first = next((x for r in rounds for x in r.values() if x.get("status") == "ok"), {})
        result["comfyui"] = {"commit": first.get("commit"), "version": first.get("version"),
                             "comfy_kitchen": first.get("environment", {}).get("comfy_kitchen"),
                             "sageattention": result["env"]["packages"]["sageattention"], "configs": configs}
    else:
        result["comfyui"] = None
        result["comfyui_note"] = "no same-run ComfyUI (run with --comfy-root to measure x_comfyui_*)"
    add_quality(contract, args, names, dev, result)
    for name, values in ratios(contract, result).items():
        result["paths"][name].update(values)
    C.write_result(args.out, result)
    C.log(f"result: {args.out}")
    failures = C.any_failed([p.get("status") for p in result["paths"].values()]
                            + [c.get("status") for p in result["paths"].values()
                               for c in ((p.get("quality") or {}).get("cases") or {}).values()])
    if failures:
        C.log(f"{len(failures)} path measurements failed (their status in the result): {failures[0]}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
