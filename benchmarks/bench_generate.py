"""One Ref2VA 960x544x124 generation end to end with synthetic weights and few steps (default 2).

Stages (each timed with device synchronisation, peak memory reset per stage):
reference image encode (resize + video VAE encode, through `h3direct.sampling.conditioning.ref2va`) -> text states
(random [1, 256, text_dim] like a `--text-embeds` file; no text encoder on the GPU) -> token refiner ->
initial noise -> sampler (`h3direct.sampling.sampler.sample` + `Denoiser`, Euler, cfg 1) -> video decode (fp16, tiled)
-> audio decode (fp32). Building the synthetic models is timed separately and is not part of end-to-end.
Two drivers: `pipeline` (default: `H3Pipeline(...).generate` on the built models, what a user runs) and `pieces`
(the same calls driven here, stage by stage). The DiT stays resident during the decodes (as a warm server;
`--free-dit` frees it, pieces driver only).

    python -m benchmarks.bench_generate --preset full --device cuda --steps 2
    python -m benchmarks.bench_generate --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import time

from benchmarks import _common as C

# stages summed into end_to_end_s, per driver (pipeline stage names are mapped onto these)
E2E_STAGES = {
    "pieces": ("ref_encode", "text_states", "text_refine", "noise", "sampling", "video_decode", "audio_decode"),
    "pipeline": ("text_states", "ref_encode", "text_embeds", "text_refine", "sampling", "video_decode",
                 "audio_decode"),
}
PIPELINE_STAGES = {"conditioning": "ref_encode", "text_encode": "text_embeds", "text_preprocess": "text_refine",
                   "sample": "sampling", "decode_video": "video_decode", "decode_audio": "audio_decode"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_arguments(ap, default_budget=120.0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--weights", choices=("nvfp4", "bf16"), default="nvfp4")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--text-len", type=int, default=None, help="text tokens (default 256; tiny 8)")
    ap.add_argument("--text-embeds", default=None, help="a --text-embeds safetensors file instead of random states")
    ap.add_argument("--sampler", default="euler")
    ap.add_argument("--scheduler", default="simple")
    ap.add_argument("--vae-dtype", choices=("fp16", "fp32"), default="fp16")
    ap.add_argument("--driver", choices=("pipeline", "pieces"), default="pipeline",
                    help="pipeline: h3direct.app.pipeline.H3Pipeline.generate on the built models (what users run); "
                         "pieces: conditioning/sampler/VAE calls driven here")
    ap.add_argument("--free-dit", action="store_true", help="pieces driver: free the DiT before the decodes")
    return ap.parse_args(argv)


class Stages:
    """Per-stage wall time (synchronised) and peak memory."""

    def __init__(self, run: C.Run, device):
        self.run, self.device = run, device
        self.data = run.data.setdefault("stages", {})

    def __call__(self, name: str):
        return _Stage(self, name)


class _Stage:
    def __init__(self, owner: Stages, name: str):
        self.o, self.name = owner, name

    def __enter__(self):
        C.reset_peak(self.o.device)
        self.t = time.perf_counter()
        C.log(f"-- {self.name} ...")
        return self

    def __exit__(self, exc_type, exc, tb):
        C.sync(self.o.device)
        dt = time.perf_counter() - self.t
        entry = {"s": dt, "peak_gib": C.peak_gib(self.o.device), "allocated_gib": C.allocated_gib(self.o.device),
                 "status": "ok" if exc is None else "error"}
        if exc is not None:
            entry["error"] = f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.o.data[self.name] = entry
        self.o.run.data["phases"][self.name] = dt
        C.log(f"   {self.name}: {dt:.2f} s, peak {C.fmt(entry['peak_gib'], '.2f')} GiB "
              f"(elapsed {self.o.run.elapsed():.1f} s)")
        return False


def _encoders(video_vae, audio_vae, vae_dtype: str):
    from h3direct.vae import encode_audio, encode_video

    return (lambda px: encode_video(video_vae, px, vae_dtype)), (lambda wave: encode_audio(audio_vae, wave))


def reference_conditioning(wl: dict, video_vae, audio_vae, vae_dtype: str, seed: int):
    """Ref2VA with one random reference image at the target canvas -> h3direct.sampling.conditioning.H3Conditioning."""

    from h3direct.sampling.conditioning import ref2va

    img = C.reference_image(wl, seed)
    enc_v, enc_a = _encoders(video_vae, audio_vae, vae_dtype)
    try:
        import PIL  # noqa: F401  (ref2va resizes with Pillow's Lanczos)
    except ImportError:
        from h3direct.sampling.conditioning import RefBlock, t2va

        C.log("Pillow missing: the reference image (already at the canvas size) is encoded without resizing")
        cond = t2va(wl["width"], wl["height"], wl["frames"])
        cond.task = "ref2va"
        cond.refs.append(RefBlock("image", latent=enc_v(img), latent_h=wl["height"] // 16,
                                  latent_w=wl["width"] // 16))
        return cond
    return ref2va(wl["width"], wl["height"], wl["frames"], enc_v, enc_a, images=[img])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.synthetic_gpu import build_audio_vae, build_dit, build_video_vae
    from h3direct.config import H3Config
    from h3direct.dit.attention import check_backend

    preset = C.resolve_common(args)
    args.text_len = args.text_len or preset.text_len
    dev = args.device
    run = C.Run("bench_generate", args)
    config = H3Config.from_name(preset.dit_config)
    wl = C.workload(args.width, args.height, args.frames, args.text_len)
    flops = C.step_flops(config, wl["seq_len"])
    driver = args.driver
    run.data.update(env=C.env_info(dev), config=config.comfy_dict(), workload=wl, flops_per_step=flops,
                    reference=C.reference(C.env_info(dev).get("gpu")), builds={}, driver=driver, outputs={})
    C.log(f"Ref2VA {wl['width']}x{wl['height']}x{wl['frames']}, {args.steps} steps, {args.weights} weights, "
          f"attention {args.attention}, S = {wl['seq_len']:,}, driver {driver}")
    if C.is_cuda(dev) and wl["seq_len"] > 10000:
        C.log("expected on one H200 (rough): VAE builds ~5-15 s, DiT build ~10-30 s, ref encode ~2 s, "
              f"sampling ~{args.steps * 3 + 3} s, video decode ~5-30 s, audio decode ~1-5 s")
    stage = Stages(run, dev)
    models: dict = {}
    try:
        check_backend(args.attention, torch.empty(0, device=dev, dtype=torch.bfloat16))
        with run.phase("build VAEs"):
            vdtype = torch.float16 if args.vae_dtype == "fp16" else torch.float32
            models["video_vae"], run.data["builds"]["video_vae"] = build_video_vae(preset.vae_preset, dev, vdtype,
                                                                                   args.seed)
            models["audio_vae"], run.data["builds"]["audio_vae"] = build_audio_vae(preset.vae_preset, dev, args.seed)
        with run.phase("build DiT"):
            models["dit"], run.data["builds"]["dit"] = build_dit(config, args.weights, dev,
                                                                 compute_dtype=torch.bfloat16,
                                                                 nvfp4_mode=preset.nvfp4_mode, seed=args.seed)
        run.data["builds"]["dit"]["resident_gib"] = C.allocated_gib(dev)
        run.save()

        with stage("text_states"):
            text, tags = _text_states(args, config)
        if text.shape[1] != wl["text_len"]:
            wl = C.workload(args.width, args.height, args.frames, text.shape[1])
            run.data["workload"] = wl
        if run.over_budget(args.steps * (5.0 if C.is_cuda(dev) else 0.0)):
            raise TimeoutError(f"budget {run.budget:.0f} s spent before generating")
        if driver == "pipeline":
            _drive_pipeline(run, args, wl, models, text, tags)
        else:
            _drive_pieces(run, args, wl, models, text, tags, stage)
    except Exception as exc:  # noqa: BLE001
        run.error("generate", exc)
    finally:
        models.clear()
        C.free_memory(dev)

    st = run.data["stages"]
    names = E2E_STAGES[driver]
    done = [s for s in names if st.get(s, {}).get("status") == "ok"]
    run.data["e2e_stages"] = list(names)
    run.data["end_to_end_s"] = sum(st[s]["s"] for s in done)
    run.data["end_to_end_complete"] = len(done) == len(names)
    peaks = [st[s]["peak_gib"] for s in done if st[s].get("peak_gib") is not None]
    run.data["peak_gib"] = max(peaks) if peaks else None
    run.save()
    report(run)
    return 0


def _text_states(args, config):
    """([1, L, text_dim] float32 CPU states, [L] int64 tags): random like a --text-embeds file, or that file."""
    import torch

    if args.text_embeds:
        from h3direct.text.load import load_text_embeds

        tc = load_text_embeds(args.text_embeds)
        return tc.states, tc.tags
    g = torch.Generator(device="cpu").manual_seed(args.seed + 4)
    return torch.randn(1, args.text_len, config.text_dim, generator=g), torch.ones(args.text_len, dtype=torch.long)


def _drive_pipeline(run: C.Run, args, wl: dict, models: dict, text, tags) -> None:
    """H3Pipeline.generate on the synthetic models; its per-stage timings mapped onto this benchmark's stages."""
    import torch

    from h3direct.app.pipeline import H3Pipeline
    from h3direct.app.request import GenerateRequest
    from h3direct.dit.options import Options
    from h3direct.text.presentation import TextConditioning

    dev = args.device
    pipe = H3Pipeline(models["dit"], models["video_vae"], models["audio_vae"], device=dev,
                      vae_dtype=torch.float16 if args.vae_dtype == "fp16" else torch.float32)
    img = C.reference_image(wl, args.seed)

    def on_step(ev) -> None:
        C.log(f"   step {ev.index + 1}/{ev.total} sigma {ev.sigma:.4f}: {ev.seconds:.2f} s")

    C.log("-- H3Pipeline.generate ...")
    t0 = time.perf_counter()
    request = GenerateRequest(text_embeds=TextConditioning(text, tags), width=wl["width"], height=wl["height"],
                              frames=wl["frames"], steps=args.steps, seed=args.seed, ref_images=[img],
                              sampler=args.sampler, scheduler=args.scheduler)
    res = pipe.generate(request, Options.with_backend(args.attention), callback=on_step)
    C.sync(dev)
    run.data["phases"]["H3Pipeline.generate"] = time.perf_counter() - t0
    mem = getattr(res, "memory", {}) or {}
    for key, seconds in res.timings.items():
        name = PIPELINE_STAGES.get(key, key)
        peak = mem.get(key)
        run.data["stages"][name] = {"s": float(seconds), "status": "ok", "allocated_gib": None,
                                    "peak_gib": peak / C.GIB if (peak is not None and C.is_cuda(dev)) else None,
                                    "pipeline_stage": key}
        C.log(f"   {name} ({key}): {float(seconds):.2f} s")
    run.data["step_s"] = [float(s) for s in res.step_seconds]
    run.data["sigmas"] = [float(s) for s in res.sigmas]
    o = run.data["outputs"]
    o["latent_video"], o["latent_audio"] = list(res.video_latent.shape), list(res.audio_latent.shape)
    o["latent_finite"] = bool(torch.isfinite(res.video_latent).all() and torch.isfinite(res.audio_latent).all())
    if res.frames is not None:
        o["pixels"] = [1, *res.frames.shape]
        o["pixels_finite"] = True  # uint8
    if res.audio is not None:
        import numpy as np

        o["waveform"] = [1, *res.audio.shape]
        o["waveform_finite"] = bool(np.isfinite(res.audio).all())
    run.data["peak_note"] = "pipeline driver: peak_gib per stage is the peak since generate() started"


def _drive_pieces(run: C.Run, args, wl: dict, models: dict, text, tags, stage: Stages) -> None:
    import torch

    from h3direct.dit.denoiser import Denoiser, audio_scale_of
    from h3direct.dit.model import Conditioning
    from h3direct.dit.options import Options
    from h3direct.sampling.noise import initial_noise
    from h3direct.sampling.sampler import sample
    from h3direct.sampling.schedules import sigmas_for
    from h3direct.vae import decode_audio, decode_video

    dev = args.device
    model = models["dit"]
    with stage("ref_encode"):
        h3cond = reference_conditioning(wl, models["video_vae"], models["audio_vae"], args.vae_dtype, args.seed)
    refs = h3cond.comfy_fields().get("minimax_refs", [])
    run.data["outputs"]["ref_latent"] = list(refs[0]["latent"].shape) if refs else None
    with stage("text_refine"), torch.inference_mode():
        context = model.preprocess_text(text.to(device=dev, dtype=torch.bfloat16),
                                        options=Options.with_backend(args.attention))
    with stage("noise"):
        noise = initial_noise(args.seed, h3cond.video_shape, h3cond.audio_shape)
        noise_v, noise_a = noise.video.to(dev), noise.audio.to(dev)
        zeros_v, zeros_a = torch.zeros_like(noise_v), torch.zeros_like(noise_a)
    sigmas = sigmas_for(args.steps, args.scheduler, shift=model.config.sigma_shift_video)
    run.data["sigmas"] = [float(s) for s in sigmas]
    sigmas = sigmas.to(dev)  # the sampler indexes sigmas into [1, 1, ...] shapes: keep them with x
    cond = Conditioning(text_token_tags=tags, refs=refs, seed=args.seed)
    den = Denoiser(model, context, cond, audio_scale=audio_scale_of(model), options=Options.with_backend(args.attention))
    marks = [time.perf_counter()]

    def on_step(info):
        C.sync(dev)
        marks.append(time.perf_counter())
        C.log(f"   step {info.index + 1}/{info.total} sigma {info.sigma:.4f}: {marks[-1] - marks[-2]:.2f} s")

    with stage("sampling"), torch.inference_mode():
        marks[0] = time.perf_counter()
        out = sample(den, noise_v, noise_a, sigmas, latent_video=zeros_v, latent_audio=zeros_a,
                     sampler=args.sampler, audio_scale=audio_scale_of(model), callback=on_step)
    run.data["step_s"] = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    run.data["seq_len_layout"] = den._layout.seq_len if getattr(den, "_layout", None) is not None else None
    o = run.data["outputs"]
    o["latent_video"], o["latent_audio"] = list(out.video.shape), list(out.audio.shape)
    o["latent_finite"] = bool(torch.isfinite(out.video).all() and torch.isfinite(out.audio).all())
    del den, context
    if args.free_dit:
        models.pop("dit", None)
        del model
        C.free_memory(dev)
    run.save()
    if run.over_budget():
        raise TimeoutError(f"budget {run.budget:.0f} s spent before the decodes")
    with stage("video_decode"):
        px = decode_video(models["video_vae"], out.video, args.vae_dtype)
    o["pixels"] = list(px.shape)
    o["pixels_finite"] = bool(torch.isfinite(px).all())
    del px
    C.free_memory(dev)
    with stage("audio_decode"):
        wave = decode_audio(models["audio_vae"], out.audio)
    o["waveform"] = list(wave.shape)
    o["waveform_finite"] = bool(torch.isfinite(wave).all())


def report(run: C.Run) -> None:
    d = run.data
    rows = [[f"build {k}", v.get("build_s"), None, v.get("model_gib"), ""] for k, v in d.get("builds", {}).items()]
    for name in d.get("e2e_stages", E2E_STAGES["pieces"]):
        s = d["stages"].get(name)
        if s is None:
            rows.append([name, None, None, None, "not run"])
        else:
            rows.append([name, s["s"], s["peak_gib"], s["allocated_gib"], s["status"] + (f": {s['error'][:50]}"
                                                                                         if "error" in s else "")])
    rows.append(["end to end (no builds)", d.get("end_to_end_s"), d.get("peak_gib"), None,
                 "complete" if d.get("end_to_end_complete") else "INCOMPLETE"])
    steps = ", ".join(f"{s:.2f}" for s in d.get("step_s", []))
    C.print_table(f"generate {d['workload']['width']}x{d['workload']['height']}x{d['workload']['frames']} "
                  f"(driver {d.get('driver')}), steps [{steps}] s",
                  ["stage", "s", "peak GiB", "allocated (builds: weights) GiB", "status"],
                  rows)
    if run.out_path:
        print(f"JSON: {run.out_path}")


if __name__ == "__main__":
    raise SystemExit(main())
