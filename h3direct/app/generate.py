"""One clip on a loaded pipeline, for the command line and the service alike: generate it, write the mp4 (H.264,
24 fps, AAC stereo; encoded while the video decodes) atomically with its provenance in the container's `comment`
tag, write its latents when asked (removed again if the mp4 then fails: a failed clip leaves no file under either
name), and make the one-line JSON summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from h3direct.app import provenance


def clip(pipe, request, options, *, callback=None, on_stage=None, ffmpeg_loglevel: str = "error"):
    """`pipe.generate(request, options)` with its mp4 (to `request.resolved.output`) encoded while the video decodes
    (`vae.mp4.Mp4Stream`: each decoded chunk of frames goes to the encoder thread, the audio is muxed after the
    decodes), then its latents (`save_latent`). Returns (Result, the mp4's path or None, write seconds: what the
    write took after the decodes). `Result.timings["write_busy"]`: the encoder thread's own seconds (mostly spent
    while the decoders ran)."""
    from h3direct.app.pipeline import FPS
    from h3direct.dit import parallel
    from h3direct.vae.mp4 import Mp4Stream

    options = pipe.effective(options)
    prov = provenance.provenance_of(request, options, pipe)
    tag = json.dumps(prov, separators=(",", ":"), ensure_ascii=False)
    meta = {"comment": tag, "encoder": f"h3direct {provenance.version()}"}
    out = request.resolved.output
    writer = parallel.is_writer()  # under torchrun every rank holds the same clip; rank 0 writes it
    stream = None
    if writer and out is not None:
        stream = Mp4Stream(out, FPS, sample_rate=pipe.audio_vae.cfg.sample_rate, loglevel=ffmpeg_loglevel,
                           metadata=meta)
    with stream if stream is not None else contextlib.nullcontext():
        res = pipe.generate(request, options, callback=callback, on_stage=on_stage,
                            on_frames=None if stream is None else stream.add)
        res.provenance = prov
        if on_stage is not None:
            on_stage("write")
        t = time.perf_counter()
        latents = request.resolved.save_latent if writer else None
        if latents is not None:
            save_latents(latents, res, tag)
        if stream is not None:
            try:
                out = stream.finish(res.audio)
            except BaseException:  # all or nothing: no latents under their name beside an mp4 that failed
                if latents is not None:
                    latents.unlink(missing_ok=True)
                raise
            res.timings["write_busy"] = round(stream.busy_s, 4)
    if on_stage is not None:
        on_stage("done")
    return res, out, time.perf_counter() - t


def save_latents(path, res, tag: str) -> None:
    """The clip's latents as `h3direct decode-latent` reads them (video_latent, audio_latent), written atomically;
    the provenance goes in the file's metadata."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        save_file({"video_latent": res.video_latent.contiguous(), "audio_latent": res.audio_latent.contiguous()},
                  str(tmp), metadata={"h3direct_provenance": tag})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def summary_of(request, options, res, out, pipe, sources: dict, timings: dict, load_memory: int) -> dict:
    """The one-line JSON summary of a generation (shared by the CLI and the HTTP service)."""
    import torch

    from h3direct.app.pipeline import peak_memory

    peak, kind = peak_memory(pipe.device)
    prov = res.provenance or provenance.provenance_of(request, options, pipe)
    summary = {
        "output": None if out is None else os.path.abspath(out), "task": res.task, "frames": res.frame_count,
        "fps": res.fps, "width": res.width, "height": res.height, "audio_samples": int(res.audio.shape[0]),
        "sample_rate": res.sample_rate, "seconds_of_video": round(res.frame_count / res.fps, 4),
        "steps": res.steps, "seed": request.seed, "sampler": request.sampler, "scheduler": request.scheduler,
        "cfg": request.cfg, "cache_mode": request.cache_mode, "reused_steps": res.reused_steps,
        "timings": timings, "peak_memory_bytes": peak, "peak_memory_kind": kind,
        "device": str(pipe.device), "compute_dtype": prov["settings"]["compute_dtype"],
        "vae_dtype": str(pipe.vae_dtype).replace("torch.", ""), "attention": options.attention.backend,
        "cpu_threads": torch.get_num_threads(), "models": sources,
        "provenance": prov,
    }
    if res.calls.get("attention"):  # backends that count their calls (sol_attn: kernel vs documented fallback)
        summary["attention_calls"] = res.calls["attention"]
    if options.kernels.fp8_linear != "off":  # opt-in approximate: its mode and how its GEMMs ran (with why)
        summary["fp8_linear"] = {"mode": options.kernels.fp8_linear, "calls": res.calls.get("fp8_linear", {})}
    if res.frame_count != request.frames:
        summary["frames_requested"] = request.frames
    if request.progress:
        summary["step_seconds"] = [round(s, 4) for s in res.step_seconds]
    if request.profile_memory:
        summary["memory"] = {"load": load_memory, **res.memory, "write": peak}
    return summary
