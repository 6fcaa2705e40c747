"""DiT speed/memory at the PERFORMANCE.md workload: one sampler step (one `Denoiser` call, cfg 1) per config.

Ref2VA 960x544x124, one reference image at the target canvas, 256 text tokens -> packed sequence S = 20,050.
For each weight format (nvfp4 = W4A16 on Hopper, bf16) x attention backend (sdpa, cudnn_sdpa, ck_int8):
1 warm-up + N timed steps (CUDA events), median; peak memory (max_memory_allocated, reset per config);
weights resident. Kernel ceilings measured in the same run: bf16 matmul 8192^3, the four block GEMMs at S,
attention alone at S (56 heads x 128) per backend, the NVFP4 -> bf16 dequantization of one step.

    python -m benchmarks.bench_dit --preset full --device cuda          # the H200 run
    python -m benchmarks.bench_dit --preset tiny --device cpu           # validation, seconds
"""

from __future__ import annotations

import argparse
import hashlib

from benchmarks import _common as C

ATTENTION_DEFAULT = "sdpa,cudnn_sdpa,ck_int8"
WEIGHTS_DEFAULT = "nvfp4,bf16"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_arguments(ap, default_budget=240.0)
    ap.add_argument("--weights", default=WEIGHTS_DEFAULT, help=f"comma list of bf16,nvfp4 (default {WEIGHTS_DEFAULT})")
    ap.add_argument("--attention", default=ATTENTION_DEFAULT, help=f"comma list (default {ATTENTION_DEFAULT})")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per config (after 1 warm-up)")
    ap.add_argument("--text-len", type=int, default=None, help="text tokens (default 256; tiny 8)")
    ap.add_argument("--sigma", type=float, default=0.8, help="sigma of the benchmarked step")
    ap.add_argument("--nvfp4-mode", choices=("w4a16", "w4a4"), default=None,
                    help="NVFP4 compute mode (default w4a16: what ComfyUI runs on Hopper)")
    ap.add_argument("--mlp-chunks", type=int, default=1)
    ap.add_argument("--fp8-linear", nargs="?", const="stream", default="off", choices=("off", "stream", "resident"),
                    help="FP8 W8A8 block linears (opt-in approximate path; bare flag = stream)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="an option by its flat name (repeatable), e.g. --option sol_tau=1.3")
    ap.add_argument("--profile", nargs="?", type=int, const=25, default=0, metavar="TOP",
                    help="one more step of each config under torch.profiler: its TOP kernels (default 25) and the "
                         "GPU time by kind (GEMM, attention, dequantization, ...)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel ceilings")
    ap.add_argument("--kernel-iters", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true",
                    help="print the workload, S and FLOP per step; build nothing")
    args = ap.parse_args(argv)
    from h3direct.dit.options import parse_assignments
    from h3direct.errors import H3Error

    try:
        args.options = parse_assignments(args.option)
    except H3Error as exc:
        ap.error(str(exc))
    return args


# ---------------------------------------------------------------- kernels

def _randn(dev, *shape):
    import torch

    return torch.randn(*shape, device=dev, dtype=torch.bfloat16)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _bench_matmul(dev, n: int, iters: int) -> dict:
    import torch

    a, b = _randn(dev, n, n), _randn(dev, n, n)
    r = C.time_calls(lambda: torch.matmul(a, b), dev, warmup=2, iters=max(iters, 5))
    return {"name": f"matmul_{n}", "m": n, "n": n, "k": n, "ms": r["median_s"] * 1e3,
            "tflops": 2 * n ** 3 / r["median_s"] / 1e12}


def _bench_gemm(dev, name: str, m: int, n: int, k: int, iters: int) -> dict:
    import torch.nn.functional as F

    x, w = _randn(dev, m, k), _randn(dev, n, k)
    r = C.time_calls(lambda: F.linear(x, w), dev, warmup=1, iters=iters)
    return {"name": name, "m": m, "n": n, "k": k, "ms": r["median_s"] * 1e3,
            "tflops": 2 * m * n * k / r["median_s"] / 1e12}


TORCH_SDPA_EXTRAS = ("torch_flash", "torch_efficient")  # forced PyTorch kernels, for reference


def _bench_attention(run: C.Run, dev, backends: list[str], heads: int, seq: int, head_dim: int) -> list[dict]:
    import torch.nn.functional as F

    from h3direct.dit import attention as attn_mod

    q, k, v = _randn(dev, 1, heads, seq, head_dim), _randn(dev, 1, heads, seq, head_dim), \
        _randn(dev, 1, heads, seq, head_dim)
    flop = 4.0 * seq * seq * heads * head_dim
    registry = getattr(attn_mod, "_REGISTRY", {})
    out = []
    for name in list(backends) + list(TORCH_SDPA_EXTRAS):
        entry = {"backend": name, "shape": [1, heads, seq, head_dim]}
        out.append(entry)
        if name in TORCH_SDPA_EXTRAS:
            if not C.is_cuda(dev):
                entry["skipped"] = "CUDA only"
                continue
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kind = SDPBackend.FLASH_ATTENTION if name == "torch_flash" else SDPBackend.EFFICIENT_ATTENTION

            def fn(kind=kind):
                with sdpa_kernel([kind]):
                    return F.scaled_dot_product_attention(q, k, v)
        else:
            reason = attn_mod.unavailable_reason(name, q)
            if reason is not None:
                entry["skipped"] = reason
                C.log(f"attention kernel {name}: skipped ({reason})")
                continue
            # the backend's kernel alone (without the seam's output rearrange) when the registry is reachable
            kernel = registry[name].fn if name in registry else None

            def fn(kernel=kernel, name=name):
                return kernel(q, k, v) if kernel is not None else attn_mod.attention(q, k, v, name)
        try:
            r = C.time_calls(fn, dev, warmup=1, iters=3)
            entry.update(ms=r["median_s"] * 1e3, tflops=flop / r["median_s"] / 1e12)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = _err(exc)
            run.error(f"kernel attention {name}", exc)
    return out


def _bench_dequant(dev, name: str, n: int, k: int) -> dict:
    import torch

    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    q4 = quantize_nvfp4(_randn(dev, n, k))
    r = C.time_calls(lambda: dequantize_nvfp4(q4.packed, q4.block_scale, q4.global_scale, torch.bfloat16),
                     dev, warmup=1, iters=3)
    return {"name": name, "n": n, "k": k, "ms": r["median_s"] * 1e3}


def bench_kernels(run: C.Run, config, wl: dict, args, preset) -> dict:
    """Kernel ceilings at the workload's shapes; every item guarded (an error is recorded, the rest runs)."""
    dev, iters, S = args.device, args.kernel_iters, wl["seq_len"]
    out: dict = {"matmul": [], "block_gemms": [], "attention": [], "nvfp4_dequant": []}
    n = preset.matmul_size
    try:
        out["matmul"].append(_bench_matmul(dev, n, iters))
    except Exception as exc:  # noqa: BLE001
        run.error(f"kernel matmul_{n}", exc)
    for name, m, nn_, k in C.block_gemm_shapes(config, S):
        try:
            out["block_gemms"].append(_bench_gemm(dev, name, m, nn_, k, iters))
        except Exception as exc:  # noqa: BLE001
            run.error(f"kernel gemm {name}", exc)
    C.free_memory(dev)
    try:
        out["attention"] = _bench_attention(run, dev, args.attention_list, config.num_attention_heads, S,
                                            config.attention_head_dim)
    except Exception as exc:  # noqa: BLE001
        run.error("kernel attention", exc)
    C.free_memory(dev)
    # NVFP4 -> bf16 dequantization of one block's four weights (x num_layers = the per-step W4A16 overhead)
    try:
        for name, _m, nn_, k in C.block_gemm_shapes(config, S):
            out["nvfp4_dequant"].append(_bench_dequant(dev, name, nn_, k))
        out["nvfp4_dequant_per_step_ms"] = sum(d["ms"] for d in out["nvfp4_dequant"]) * config.num_layers
    except Exception as exc:  # noqa: BLE001
        run.error("kernel nvfp4 dequant", exc)
    C.free_memory(dev)
    return out


# ---------------------------------------------------------------- the DiT step

def make_inputs(config, wl: dict, device, seed: int):
    """(video, audio, ref latent, text states, Conditioning) on `device`; latents fp32, text bf16."""
    import torch

    from h3direct.dit.model import Conditioning

    g = torch.Generator(device="cpu").manual_seed(seed)
    video = torch.randn(wl["video_latent"], generator=g).to(device)
    audio = torch.randn(wl["audio_latent"], generator=g).to(device)
    ref = torch.randn(wl["ref_latent"], generator=g).to(device)
    text = torch.randn(1, wl["text_len"], config.text_dim, generator=g).to(device=device, dtype=torch.bfloat16)
    _, _, _, h, w = wl["ref_latent"]
    cond = Conditioning(refs=[{"kind": "image", "latent_h": h, "latent_w": w, "latent": ref}], seed=seed)
    return video, audio, text, cond


def layout_seq_len(wl: dict, cond) -> int:
    from h3direct.dit.sequence import build_layout

    _, _, t, h, w = wl["video_latent"]
    return build_layout(wl["text_len"], t, h + h % 2, w + w % 2, wl["audio_latent"][-1], refs=cond.refs).seq_len


def run_config(run: C.Run, model, context, cond, video, audio, backend: str, args, flops: dict) -> dict:
    import torch

    from h3direct.dit.denoiser import Denoiser, audio_scale_of
    from h3direct.dit.options import Options

    dev = args.device
    options = Options.from_flat({"attention": backend, "mlp_chunks": args.mlp_chunks, **args.options})
    den = Denoiser(model, context, cond, audio_scale=audio_scale_of(model), options=options)
    sigma = torch.tensor([args.sigma], dtype=torch.float32, device=dev)
    last = {}

    def step():
        last["out"] = den(video, audio, sigma)

    C.reset_peak(dev)
    with torch.inference_mode():
        r = C.time_calls(step, dev, warmup=1, iters=args.steps)
    x0_v, x0_a = last.pop("out")
    digest = hashlib.sha256()  # the last step's output bits: runs that must agree bitwise compare these
    for x in (x0_v, x0_a):
        digest.update(x.detach().contiguous().view(torch.uint8 if x.element_size() == 1 else torch.int16
                                                   if x.element_size() == 2 else torch.int32).cpu().numpy().tobytes())
    finite = bool(torch.isfinite(x0_v).all() and torch.isfinite(x0_a).all())
    t = r["median_s"]
    res = {
        "status": "ok", "warmup_s": r["warmup_s"], "step_s": r["times_s"], "step_s_median": t,
        "timed_wall_s": r["wall_s"], "peak_gib": C.peak_gib(dev), "seq_len": den._layout.seq_len
        if getattr(den, "_layout", None) is not None else None,
        "tflops": flops["total_tflop"] / t, "finite": finite,
        "x0_video_rms": float(x0_v.float().pow(2).mean().sqrt()), "x0_sha256": digest.hexdigest(),
    }
    if C.is_cuda(dev):
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / C.GIB
    ref = run.data["reference"]
    res["vs_comfyui_speedup"] = ref["comfyui_s_per_step"] / t if ref["comfyui_s_per_step"] else None
    res["vs_floor_ratio"] = t / ref["floor_s_per_step"] if ref["floor_s_per_step"] else None
    if args.profile:
        res["profile"] = profile_step(step, dev, args.profile)
    return res


# first match wins, on the lower-cased kernel name
CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "sm90_xmma_fprop", "sage", "int8_attn", "sol_",
                   "prep_q", "prep_k", "prep_reduce_kv", "prep_pooled", "vquant_transpose")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "ampere_", "cublas")),
    ("8-bit quant", ("quant_rows", "nvfp4_e4m3")),  # W8A8: activation quantization, NVFP4 -> e4m3 (stream)
    ("dequant", ("dequant", "nvfp4")),
    ("norm/rope", ("rms", "norm", "rope")),
    ("copy/cat", ("copy", "cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "silu", "mul", "add", "triton", "swiglu")),
)


def category(name: str) -> str:
    n = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in n for k in keys)), "other")


def profile_step(step, dev, top: int) -> dict:
    """One more step under torch.profiler: the GPU's kernels only (an operator's row repeats the device time of the
    kernels it launched), the top `top` by time and their sum per `CATEGORIES`, in ms; printed too."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if C.is_cuda(dev) else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        step()
        C.sync(dev)
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    by_cat: dict[str, float] = {}
    for e in events:
        by_cat[category(e.key)] = by_cat.get(category(e.key), 0.0) + e.self_device_time_total / 1e3
    kernels = [{"ms": e.self_device_time_total / 1e3, "calls": e.count, "category": category(e.key), "name": e.key}
               for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]]
    total = sum(by_cat.values())
    C.print_table(f"profile: top {top} kernels, GPU total {total:.1f} ms", ["ms", "calls", "category", "kernel"],
                  [[k["ms"], k["calls"], k["category"], k["name"][:100]] for k in kernels])
    C.print_table("profile: by category (ms per step)", ["category", "ms"],
                  sorted(([c, ms] for c, ms in by_cat.items()), key=lambda r: -r[1]))
    return {"gpu_ms": total, "by_category": by_cat, "top": kernels}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from h3direct.config import H3Config
    from h3direct.dit import attention as attn_mod

    preset = C.resolve_common(args)
    args.text_len = args.text_len or preset.text_len
    args.nvfp4_mode = args.nvfp4_mode or preset.nvfp4_mode
    args.attention_list = [a for a in args.attention.split(",") if a]
    weights_list = [w for w in args.weights.split(",") if w]
    for w in weights_list:
        if w not in ("bf16", "nvfp4"):
            raise SystemExit(f"--weights: unknown format {w!r} (bf16, nvfp4)")
    run = C.Run("bench_dit", args)
    dev = args.device
    config = H3Config.from_name(preset.dit_config)
    wl = C.workload(args.width, args.height, args.frames, args.text_len)
    flops = C.step_flops(config, wl["seq_len"])
    run.data.update(env=C.env_info(dev), config=config.comfy_dict(), workload=wl, flops_per_step=flops,
                    reference=C.reference(C.env_info(dev).get("gpu")), kernels={}, builds=[], configs=[])
    C.log(f"workload {wl['width']}x{wl['height']}x{wl['frames']} (frame count {wl['frame_count']}): video latent "
          f"{wl['video_latent']}, audio latent {wl['audio_latent']}, ref latent {wl['ref_latent']}, "
          f"rows {wl['rows']} -> S = {wl['seq_len']:,}")
    C.log(f"per step: block linears {flops['block_linears_tflop']:.1f} TFLOP + attention "
          f"{flops['attention_tflop']:.1f} TFLOP = {flops['total_tflop']:.1f} TFLOP")

    if args.dry_run:
        from h3direct.dit.sequence import build_layout

        _, _, t, h, w = wl["video_latent"]
        refs = [{"kind": "image", "latent_h": wl["ref_latent"][3], "latent_w": wl["ref_latent"][4]}]
        wl["seq_len_layout"] = build_layout(wl["text_len"], t, h + h % 2, w + w % 2, wl["audio_latent"][-1],
                                            refs=refs).seq_len
        C.log(f"S from h3direct's packed layout: {wl['seq_len_layout']:,}")
        run.save()
        return 0

    with run.phase("inputs"):
        video, audio, text, cond = make_inputs(config, wl, dev, args.seed)
        s_layout = layout_seq_len(wl, cond)
        wl["seq_len_layout"] = s_layout
        same = "matches" if s_layout == wl["seq_len"] else "DIFFERS"
        C.log(f"S from h3direct's packed layout: {s_layout:,} ({same})")
    run.save()

    if not args.no_kernels and run.over_budget():
        run.skip("kernels", f"budget {run.budget:.0f} s (elapsed {run.elapsed():.0f} s)")
    elif not args.no_kernels:
        with run.phase("kernels"):
            try:
                run.data["kernels"] = bench_kernels(run, config, wl, args, preset)
            except Exception as exc:  # noqa: BLE001
                run.error("kernels", exc)
        run.save()

    from benchmarks.synthetic_gpu import build_dit

    est_config = None  # measured cost of one config, for the budget check
    for weights in weights_list:
        if run.over_budget(est_config or 0.0):
            for b in args.attention_list:
                run.data["configs"].append({"weights": weights, "attention": b, "status": "skipped",
                                            "reason": "budget"})
            run.skip(f"weights {weights}", f"budget {run.budget:.0f} s (elapsed {run.elapsed():.0f} s)")
            continue
        model = None
        try:
            C.free_memory(dev)
            with run.phase(f"build {weights}"):
                model, info = build_dit(config, weights, dev, compute_dtype=torch.bfloat16,
                                        nvfp4_mode=args.nvfp4_mode, seed=args.seed, fp8_linear=args.fp8_linear)
            info["resident_gib"] = C.allocated_gib(dev)
            run.data["builds"].append(info)
            C.log(f"built {weights} ({info['builder']}): {info['build_s']:.1f} s, weights "
                  f"{info['model_gib']:.2f} GiB, allocated {C.fmt(info['resident_gib'], '.2f')} GiB")
            with run.phase(f"text refine {weights}"), torch.inference_mode():
                context = model.preprocess_text(text)
                C.sync(dev)
            for backend in args.attention_list:
                entry = {"weights": weights, "attention": backend, "resident_gib": info["resident_gib"],
                         "build_s": info["build_s"], "fp8_linear": args.fp8_linear}
                from h3direct.counts import counting

                reason = attn_mod.unavailable_reason(backend, context)  # compute dtype, like q/k/v
                if reason is not None:
                    entry.update(status="skipped", reason=reason)
                    run.data["configs"].append(entry)
                    run.skip(f"{weights}/{backend}", reason)
                    continue
                if run.over_budget(est_config or 0.0):
                    entry.update(status="skipped", reason="budget")
                    run.data["configs"].append(entry)
                    run.skip(f"{weights}/{backend}", f"budget {run.budget:.0f} s (elapsed {run.elapsed():.0f} s)")
                    continue
                try:
                    with run.phase(f"step {weights}/{backend}") as ph, counting() as calls:
                        entry.update(run_config(run, model, context, cond, video, audio, backend, args, flops))
                    est_config = ph.seconds
                    if args.fp8_linear != "off":  # how the FP8 GEMMs ran (scaled_mm vs emulated, with the reason)
                        entry["fp8_linear_calls"] = dict(calls.fp8_linear)
                        C.log(f"fp8 linear ({args.fp8_linear}) calls: {entry['fp8_linear_calls']}")
                    C.log(f"{weights}/{backend}: {entry['step_s_median']:.3f} s/step "
                          f"(warm-up {entry['warmup_s']:.1f} s), {entry['tflops']:.0f} TFLOP/s, "
                          f"peak {C.fmt(entry['peak_gib'], '.2f')} GiB, finite={entry['finite']}")
                except Exception as exc:  # noqa: BLE001
                    entry.update(status="error", error=_err(exc))
                    run.error(f"{weights}/{backend}", exc)
                    C.free_memory(dev)
                run.data["configs"].append(entry)
                run.save()
            del context
        except Exception as exc:  # noqa: BLE001
            run.error(f"weights {weights}", exc)
            run.data["configs"].append({"weights": weights, "attention": "*", "status": "error",
                                        "error": f"{type(exc).__name__}: {exc}"})
        finally:
            del model
            C.free_memory(dev)
        run.save()

    run.save()
    report(run)
    return 0


def report(run: C.Run) -> None:
    d = run.data
    k = d.get("kernels") or {}
    rows = [[m["name"], f"{m['m']}x{m['n']}x{m['k']}", m["ms"], m["tflops"], ""]
            for m in k.get("matmul", []) + k.get("block_gemms", [])]
    for a in k.get("attention", []):
        rows.append([f"attn {a['backend']}", "x".join(map(str, a["shape"])), a.get("ms"), a.get("tflops"),
                     (a.get("skipped") or a.get("error") or "")[:70]])
    if "nvfp4_dequant_per_step_ms" in k:
        rows.append(["nvfp4->bf16 dequant", f"{len(k['nvfp4_dequant'])} weights x {d['config']['num_layers']} layers",
                     k["nvfp4_dequant_per_step_ms"], None, "ms per step (W4A16 overhead)"])
    if rows:
        C.print_table("kernels (ms per call)", ["kernel", "shape", "ms", "TFLOP/s", "note"], rows)
    ph = d.get("phases", {})
    C.print_table("phases (wall s)", ["phase", "s"], [[n, s] for n, s in ph.items()])
    rows = []
    for c in d.get("configs", []):
        if c.get("status") == "ok":
            rows.append([c["weights"], c["attention"], c["step_s_median"], c["tflops"], c["vs_comfyui_speedup"],
                         c["vs_floor_ratio"], c["peak_gib"], c["resident_gib"], c["warmup_s"],
                         "ok" if c["finite"] else "NONFINITE"])
        else:
            rows.append([c["weights"], c["attention"], None, None, None, None, None, None, None,
                         f"{c.get('status')}: {(c.get('reason') or c.get('error') or '')[:40]}"])
    wl, fl = d["workload"], d["flops_per_step"]
    ref = d["reference"]
    C.print_table(f"DiT step, S={wl['seq_len']:,} ({fl['total_tflop']:.1f} TFLOP/step); ComfyUI "
                  f"{C.fmt(ref['comfyui_s_per_step'])} s/step, floor {C.fmt(ref['floor_s_per_step'])} s "
                  f"(the contract: {ref['source']})",
                  ["weights", "attention", "s/step", "TFLOP/s", "x ComfyUI", "/ floor", "peak GiB", "resident GiB",
                   "warm-up s", "status"], rows)
    if run.out_path:
        print(f"JSON: {run.out_path}")


if __name__ == "__main__":
    raise SystemExit(main())
