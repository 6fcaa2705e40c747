"""Run a benchmark contract (benchmarks/ref2va-960x544-124f.json) and write its result JSON.

    python -m benchmarks.run_contract --contract benchmarks/ref2va-960x544-124f.json --out R.json [--comfy-root R]
    python -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f.json --result R.json

Per path of the contract (exact, approximate: an attention backend plus H3_* options): s/step (median of the timed
Denoiser calls after the warm-up), the sum of the timed steps, text refine, VAE decode (fp16 video + fp32 audio),
end to end, peak GPU memory. Weights: the contract's synthetic full-size checkpoint built on the GPU.
With --comfy-root, ComfyUI (its own loader, CFGGuider at cfg 1, its default attention) steps the same weights and
workload in the same process, once before and once after h3direct, so `x_comfyui` is a same-run ratio; without it the result says
"no same-run ComfyUI". --smoke: tiny sizes (CPU check of the plumbing; not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402  (puts the repo root on sys.path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_contract", description=__doc__.split("\n")[0])
    ap.add_argument("--contract", required=True)
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--paths", default=None, help="comma list of the contract's paths (default all)")
    ap.add_argument("--comfy-root", default=None, help="ComfyUI checkout: time it in the same run")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: the contract's)")
    ap.add_argument("--no-vae", action="store_true", help="skip the VAE decode (end_to_end is then not reported)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device (plumbing check)")
    ap.add_argument("--fp8-linear", nargs="?", const="stream", default=None, choices=("off", "stream", "resident"),
                    help="FP8 W8A8 block linears for every path (default: each path's \"fp8_linear\", else off)")
    return ap.parse_args(argv)


def _contract(path: str) -> dict:
    try:
        c = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"run_contract: error: --contract {path}: {exc}") from None
    for key in ("contract", "workload", "weights", "steps", "paths"):
        if key not in c:
            raise SystemExit(f"run_contract: error: --contract {path}: missing {key!r}")
    return c


def run_h3direct(contract: dict, args, wl: dict, preset, dev) -> tuple[dict, dict]:
    import torch
    from bench_dit import make_inputs
    from synthetic_gpu import build_audio_vae, build_dit, build_video_vae

    from h3direct.config import H3Config
    from h3direct.dit.attention import attention_stats, reset_attention_stats, unavailable_reason
    from h3direct.dit.denoiser import Denoiser, audio_scale_of

    w = contract["weights"]
    config = H3Config.from_name(preset.dit_config)
    resident_before = C.allocated_gib(dev) or 0.0  # not ours (e.g. what ComfyUI's round left): kept out of our peak
    model, build = build_dit(config, w["dit"], dev, nvfp4_mode=w.get("nvfp4_mode", "w4a16"), seed=w.get("seed", 0))
    video, audio, text, cond = make_inputs(config, wl, dev, w.get("seed", 0))
    sigma = torch.tensor([0.8], dtype=torch.float32, device=dev)
    warmup, timed = contract["steps"]["warmup"], args.steps or contract["steps"]["timed"]
    like = torch.empty(0, device=dev, dtype=model.compute_dtype)
    paths = {}
    names = args.paths.split(",") if args.paths else list(contract["paths"])
    for name in names:
        if name not in contract["paths"]:
            raise SystemExit(f"run_contract: error: --paths: {name!r} is not a path of the contract")

    def fp8_of(name):
        return args.fp8_linear or contract["paths"][name].get("fp8_linear", "off")

    modes = {fp8_of(n) for n in names} - {"off"}
    if len(modes) > 1 or not modes <= {"stream", "resident"}:
        raise SystemExit(f"run_contract: error: fp8_linear: one of stream, resident per run, got {sorted(modes)}")
    # the exact paths first, then the model's block linears become FP8 once for the fp8 paths (in place)
    names = [n for n in names if fp8_of(n) == "off"] + [n for n in names if fp8_of(n) != "off"]
    for name in names:
        spec = contract["paths"][name]
        if fp8_of(name) != "off" and getattr(model, "fp8_linear", "off") == "off":
            from h3direct.dit.linear import apply_fp8_linears

            apply_fp8_linears(model, fp8_of(name))
            C.free_memory(dev)
        attn = spec["attention"]
        res = {"attention": attn, "options": spec.get("options", {}), "fp8_linear": fp8_of(name)}
        with C.env_options(spec.get("options", {})):
            reason = unavailable_reason(attn, like)
            if reason is not None:
                paths[name] = {**res, "status": f"unavailable: {reason}"}
                C.log(f"{name}: {attn} unavailable: {reason}")
                continue
            reset_attention_stats()
            with torch.inference_mode():
                C.sync(dev)
                t = time.perf_counter()
                context = model.preprocess_text(text, backend=attn)
                C.sync(dev)
                res["text_refine_s"] = time.perf_counter() - t
                den = Denoiser(model, context, cond, audio_scale=audio_scale_of(model), backend=attn)
                C.reset_peak(dev)
                with C.GpuSampler(dev) as gpu:
                    r = C.time_calls(lambda den=den: den(video, audio, sigma), dev, warmup=warmup, iters=timed)
            res.update(status="ok", warmup_s=r["warmup_s"], step_s=r["times_s"], s_per_step=r["median_s"],
                       denoise_total_s=sum(r["times_s"]), peak_gpu_gib=_minus(C.peak_gib(dev), resident_before),
                       attention_calls=attention_stats() or None, gpu_clock_power=gpu.summary)
        paths[name] = res
        C.log(f"{name} ({attn}): {res['s_per_step']:.3f} s/step, peak {res['peak_gpu_gib']} GiB")
    info = {"build": build, "seq_len": wl["seq_len"], "resident_before_gib": resident_before}
    del model
    C.free_memory(dev)
    if not args.no_vae:
        from h3direct.vae import decode_audio, decode_video

        vdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[contract.get("vae_dtype",
                                                                                                    "fp16")]
        vae, _ = build_video_vae(preset.vae_preset, dev, dtype=vdtype)
        avae, _ = build_audio_vae(preset.vae_preset, dev)
        g = torch.Generator(device="cpu").manual_seed(1)
        z = torch.randn(wl["video_latent"], generator=g).to(dev)
        za = torch.randn(wl["audio_latent"], generator=g).to(dev)
        with torch.inference_mode():
            decode_video(vae, z[:, :, :2, :4, :4].contiguous(), contract.get("vae_dtype", "fp16"))  # warm-up
            C.sync(dev)
            t = time.perf_counter()
            decode_video(vae, z, contract.get("vae_dtype", "fp16"))
            decode_audio(avae, za)
            C.sync(dev)
            vae_s = time.perf_counter() - t
        del vae, avae
        C.free_memory(dev)
        for res in paths.values():
            if res.get("status") == "ok":
                res["vae_decode_s"] = vae_s
                res["end_to_end_s"] = res["text_refine_s"] + res["denoise_total_s"] + vae_s
    return paths, info


def _minus(a: float | None, b: float) -> float | None:
    return None if a is None else a - b


def run_comfyui(root: str, contract: dict, args, wl: dict, preset, dev) -> dict:
    """One round of ComfyUI's own loader and sampler on the same synthetic weights and workload: s/step of its
    model calls. Its model is unloaded afterwards and torch's process-wide switches are put back."""
    from oracle.comfy_env import open_comfy

    cuda = C.is_cuda(dev)
    switches = _torch_switches()
    env = open_comfy(root, device="cuda" if cuda else "cpu", compute_dtype="bf16" if cuda else "fp32")
    try:
        return _comfy_round(env, contract, args, wl, preset, dev)
    finally:
        mm = env.model_management
        for name in ("unload_all_models", "soft_empty_cache"):
            if hasattr(mm, name):
                getattr(mm, name)()
        C.free_memory(dev)
        _torch_switches(switches)  # h3direct's steps run with torch's defaults, not the oracle's deterministic mode


def _torch_switches(saved: dict | None = None) -> dict:
    """Read (or, given `saved`, restore) the process-wide torch switches that opening ComfyUI changes."""
    import torch

    now = {"deterministic": (torch.are_deterministic_algorithms_enabled(),
                             torch.is_deterministic_algorithms_warn_only_enabled()),
           "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
           "matmul_tf32": torch.backends.cuda.matmul.allow_tf32}
    if saved is not None:
        torch.use_deterministic_algorithms(saved["deterministic"][0], warn_only=saved["deterministic"][1])
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
    return now


def _comfy_round(env, contract: dict, args, wl: dict, preset, dev) -> dict:
    import torch
    from bench_dit import make_inputs

    from h3direct.checkpoint.synthetic import iter_dit_tensors
    from h3direct.config import H3Config

    w = contract["weights"]
    cuda = C.is_cuda(dev)
    config = H3Config.from_name(preset.dit_config)
    quant = "nvfp4" if w["dit"] == "nvfp4" else "none"
    sd = {k: (t.cpu() if k.endswith(".comfy_quant") else t)
          for k, t in iter_dit_tensors(config, quant, w.get("seed", 0), str(dev), nvfp4_refiner=False)}
    t0 = time.perf_counter()
    patcher = env.sd.load_diffusion_model_state_dict(sd)
    del sd
    if patcher is None or type(patcher.model).__name__ != "MiniMaxH3":
        raise RuntimeError(f"ComfyUI did not detect MiniMaxH3 in the synthetic weights "
                           f"({type(getattr(patcher, 'model', None)).__name__})")
    load_s = time.perf_counter() - t0
    video, audio, text, cond = make_inputs(config, wl, "cpu", w.get("seed", 0))
    refs = [{"kind": "image", "latent": r["latent"], "latent_t": 1, "latent_h": r["latent_h"],
             "latent_w": r["latent_w"], "ref_audio_t": 0} for r in cond.refs]
    tags = torch.zeros(text.shape[1], dtype=torch.int64)
    conditioning = [[text.float(), {"minimax_token_tags": tags, "minimax_refs": refs}]]
    warmup, timed = contract["steps"]["warmup"], args.steps or contract["steps"]["timed"]
    n = warmup + timed
    times: list[float] = []

    def steps(model, x, sigmas, extra_args=None, callback=None, disable=None):
        for i in range(n):
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
    noise = nested.NestedTensor([torch.randn_like(video.cpu()), torch.randn_like(audio.cpu())])
    latent = nested.NestedTensor([video.cpu(), audio.cpu()])
    sigmas = torch.linspace(0.9, 0.1, n + 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), C.GpuSampler(dev) as gpu:
        guider.sample(noise, latent, env.samplers.KSAMPLER(steps), sigmas, disable_pbar=True, seed=0)
    per = times[warmup:]
    res = {"s_per_step": statistics.median(per), "step_s": per, "warmup_s": times[:warmup], "load_s": load_s,
           "attention": env.attention_function(), "comfyui_commit": env.commit,
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / C.GIB if cuda else None,
           "gpu_clock_power": gpu.summary}
    del guider, patcher
    return res


def merge_comfy_rounds(rounds: list[dict]) -> dict:
    """ComfyUI timed before and after h3direct (so neither side gets the cooler GPU): s/step is the median of every
    timed step of every round; the rounds are kept as measured."""
    steps = [t for r in rounds for t in r["step_s"]]
    peaks = [r["peak_gpu_gib"] for r in rounds if r.get("peak_gpu_gib") is not None]
    return {**rounds[0], "s_per_step": statistics.median(steps), "step_s": steps,
            "warmup_s": [t for r in rounds for t in r["warmup_s"]], "peak_gpu_gib": max(peaks) if peaks else None,
            "rounds": rounds}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    contract = _contract(args.contract)
    preset = C.PRESETS["tiny" if args.smoke else "full"]
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = args.device
    wl_spec = contract["workload"]
    if args.smoke:
        wl = C.workload(preset.width, preset.height, preset.frames, preset.text_len)
    else:
        wl = C.workload(wl_spec["width"], wl_spec["height"], wl_spec["frames"], wl_spec["text_tokens"])
        if wl["seq_len"] != wl_spec.get("seq_len", wl["seq_len"]):
            raise SystemExit(f"run_contract: error: workload gives S = {wl['seq_len']}, contract says "
                             f"{wl_spec['seq_len']}")
    result = {"contract": contract["contract"], "smoke": args.smoke, "device": C.env_info(dev).get("gpu") or dev,
              "env": C.env_info(dev), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "workload": wl}
    if C.is_cuda(dev):  # cuBLAS's handle (and its workspace) made with torch's defaults, before ComfyUI's settings
        torch.ones(8, 8, device=dev) @ torch.ones(8, 8, device=dev)
    rounds, failed = [], None

    def comfy_round():
        nonlocal failed
        if not args.comfy_root or failed:
            return
        try:
            rounds.append(run_comfyui(args.comfy_root, contract, args, wl, preset, dev))
            C.log(f"ComfyUI round {len(rounds)}: {rounds[-1]['s_per_step']:.3f} s/step")
        except Exception as exc:  # noqa: BLE001 - reported in the result; compare then misses the ratios
            failed = f"same-run ComfyUI failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"

    comfy_round()
    result["paths"], result["h3direct"] = run_h3direct(contract, args, wl, preset, dev)
    comfy_round()
    if args.comfy_root:
        result["comfyui"] = merge_comfy_rounds(rounds) if rounds and not failed else None
        if failed:
            result["comfyui_note"] = failed
    else:
        result["comfyui"] = None
        result["comfyui_note"] = "no same-run ComfyUI (run with --comfy-root to measure x_comfyui)"
    if result["comfyui"]:
        for p in result["paths"].values():
            if p.get("status") == "ok":
                p["x_comfyui"] = result["comfyui"]["s_per_step"] / p["s_per_step"]
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    C.log(f"result: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
