"""VAE speed/memory at the PERFORMANCE.md workload: full-size video decode (fp16, tiled with the defaults) of the
960x544x124 latent [1, 24, 37, 34, 60], audio decode (fp32) of the matching [1, 32, 2, 207] latent, and the
video encode of one reference image at the target canvas. Synthetic weights built on the device.

Each part: a small warm-up call (kernel/library initialisation), then `--repeats` timed full-size calls
(wall clock with device synchronisation), peak memory (max_memory_allocated, reset per part).

    python -m benchmarks.bench_vae --preset full --device cuda
    python -m benchmarks.bench_vae --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import _common as C

PARTS = ("video_decode", "video_encode_image", "audio_decode")
VIDEO_PARTS = ("video_decode", "video_encode_image")  # share one video VAE


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_arguments(ap, default_budget=75.0)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--vae-dtype", choices=("fp16", "fp32"), default="fp16", help="video VAE dtype (default fp16)")
    ap.add_argument("--tile-size", type=int, default=None, help="spatial tile px (default: the config's, 256)")
    ap.add_argument("--repeats", type=int, default=1, help="timed full-size calls per part")
    return ap.parse_args(argv)


def timed(fn, device, repeats: int, warm_fn=None) -> dict:
    """warm_fn() once (untimed unless given), then fn() `repeats` times; wall seconds with sync."""
    t0 = time.perf_counter()
    if warm_fn is not None:
        warm_fn()
    C.sync(device)
    warm = time.perf_counter() - t0
    C.reset_peak(device)
    times, out = [], None
    for _ in range(repeats):
        out = None
        s = time.perf_counter()
        out = fn()
        C.sync(device)
        times.append(time.perf_counter() - s)
    return {"warmup_s": warm, "times_s": times, "median_s": statistics.median(times), "peak_gib": C.peak_gib(device),
            "out": out}


def bench_video_decode(run, args, vae, info, wl) -> dict:
    import torch

    from h3direct.vae import decode_video

    dev = args.device
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    z = torch.randn(wl["video_latent"], generator=g).to(dev)
    small = z[:, :, :2, :4, :4].contiguous()  # warm-up: one chunk, one tile
    with run.phase("video decode"):
        r = timed(lambda: decode_video(vae, z, args.vae_dtype, tile_size=args.tile_size), dev, args.repeats,
                  warm_fn=lambda: decode_video(vae, small, args.vae_dtype, tile_size=args.tile_size))
    px = r.pop("out")
    res = {**info, **r, "latent": list(z.shape), "pixels": list(px.shape),
           "finite": bool(torch.isfinite(px).all()), "pixel_mean": float(px.mean()),
           "frames_per_s": px.shape[1] / r["median_s"]}
    del px
    C.free_memory(dev)
    return res


def bench_audio_decode(run, args, preset, wl) -> dict:
    import torch

    from benchmarks.synthetic_gpu import build_audio_vae
    from h3direct.vae import decode_audio

    dev = args.device
    with run.phase("build audio VAE"):
        vae, info = build_audio_vae(preset.vae_preset, dev, seed=args.seed)
    info["resident_gib"] = C.allocated_gib(dev)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    z = torch.randn(wl["audio_latent"], generator=g).to(dev)
    with run.phase("audio decode"):
        r = timed(lambda: decode_audio(vae, z), dev, args.repeats, warm_fn=lambda: decode_audio(vae, z[..., :8]))
    wave = r.pop("out")
    return {**info, **r, "latent": list(z.shape), "waveform": list(wave.shape),
            "finite": bool(torch.isfinite(wave).all()), "seconds_of_audio": wave.shape[1] / 32000.0}


def bench_video_encode_image(run, args, vae, info, wl) -> dict:
    import torch

    from h3direct.vae import encode_video

    dev = args.device
    g = torch.Generator(device="cpu").manual_seed(args.seed + 2)
    img = torch.rand(1, wl["height"], wl["width"], 3, generator=g)
    with run.phase("video encode (1 image)"):
        r = timed(lambda: encode_video(vae, img, args.vae_dtype, tile_size=args.tile_size), dev, args.repeats,
                  warm_fn=lambda: encode_video(vae, img[:, :64, :64], args.vae_dtype, tile_size=args.tile_size))
    lat = r.pop("out")
    res = {**info, **r, "pixels": list(img.shape), "latent": list(lat.shape),
           "finite": bool(torch.isfinite(lat).all())}
    C.free_memory(dev)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    preset = C.resolve_common(args)
    run = C.Run("bench_vae", args)
    wl = C.workload(args.width, args.height, args.frames, preset.text_len)
    run.data.update(env=C.env_info(args.device), workload=wl, vae_preset=preset.vae_preset)
    C.log(f"video latent {wl['video_latent']} -> {wl['frame_count']} frames {wl['width']}x{wl['height']}, "
          f"audio latent {wl['audio_latent']}; video VAE {args.vae_dtype}, tile {args.tile_size or 'default'}")
    if C.is_cuda(args.device) and preset.vae_preset == "full":
        C.log("expected on one H200 (rough): video VAE build ~5-15 s (2.6 B params), decode ~5-30 s; "
              "audio VAE build ~2 s, decode ~1-5 s; image encode ~1-3 s")
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:
        if p not in PARTS:
            raise SystemExit(f"--parts: unknown part {p!r}; known: {', '.join(PARTS)}")
    video_parts = [p for p in VIDEO_PARTS if p in parts]
    if video_parts:
        vae = None
        try:
            import torch

            from benchmarks.synthetic_gpu import build_video_vae

            dtype = torch.float16 if args.vae_dtype == "fp16" else torch.float32
            with run.phase("build video VAE"):
                vae, info = build_video_vae(preset.vae_preset, args.device, dtype, seed=args.seed)
            info["resident_gib"] = C.allocated_gib(args.device)
            fns = {"video_decode": bench_video_decode, "video_encode_image": bench_video_encode_image}
            for part in video_parts:
                _run_part(run, part, lambda fn=fns[part]: fn(run, args, vae, info, wl), args.device)
        except Exception as exc:  # noqa: BLE001
            run.error("video VAE", exc)
            for part in video_parts:
                run.data.setdefault(part, {"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        finally:
            del vae
            C.free_memory(args.device)
    if "audio_decode" in parts:
        _run_part(run, "audio_decode", lambda: bench_audio_decode(run, args, preset, wl), args.device)
        C.free_memory(args.device)
    run.save()
    report(run)
    return 0


def _run_part(run: C.Run, part: str, fn, device) -> None:
    if run.over_budget():
        run.skip(part, f"budget {run.budget:.0f} s (elapsed {run.elapsed():.0f} s)")
        run.data[part] = {"status": "skipped", "reason": "budget"}
        return
    try:
        run.data[part] = {"status": "ok", **fn()}
    except Exception as exc:  # noqa: BLE001
        run.data[part] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        run.error(part, exc)
        C.free_memory(device)
    run.save()


def report(run: C.Run) -> None:
    d = run.data
    rows = []
    for part in PARTS:
        r = d.get(part)
        if r is None:
            continue
        if r.get("status") == "ok":
            shape = r.get("latent") if part != "video_encode_image" else r.get("pixels")
            rows.append([part, "x".join(map(str, shape)), r.get("dtype"), r["build_s"], r["warmup_s"], r["median_s"],
                         r["peak_gib"], r["model_gib"], "ok" if r["finite"] else "NONFINITE"])
        else:
            rows.append([part, None, None, None, None, None, None, None,
                         f"{r.get('status')}: {(r.get('reason') or r.get('error') or '')[:50]}"])
    C.print_table("phases (wall s)", ["phase", "s"], [[n, s] for n, s in d.get("phases", {}).items()])
    C.print_table("VAE (synthetic weights)", ["part", "input", "dtype", "build s", "warm-up s", "time s", "peak GiB",
                                              "weights GiB", "status"], rows)
    if run.out_path:
        print(f"JSON: {run.out_path}")


if __name__ == "__main__":
    raise SystemExit(main())
