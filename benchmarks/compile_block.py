"""torch.compile of a DiT block against the Triton fused kernels, at the contract's workload (issue 13: "try both").

    python3 benchmarks/compile_block.py [--attention fa3] [--modes default,max-autotune-no-cudagraphs] [--steps 3]

Variants, each 1 warm-up + N timed Denoiser steps on the same full-size NVFP4 model:
- eager:    H3_FUSED=0, op by op (ComfyUI's order);
- fused:    the Triton kernels of h3direct/dit/fused.py (the default on CUDA);
- compiled: H3_FUSED=0 and every block's forward through one `torch.compile(DiTBlock.forward, dynamic=False)` per mode.
The compiled variants report their warm-up (compile) time separately, the number of Dynamo frames compiled and the
graph breaks, and whether a later step compiled again (it must not).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402  (puts the repo root on sys.path)


def main(argv=None) -> int:
    import torch
    import torch._dynamo
    from bench_dit import make_inputs
    from synthetic_gpu import build_dit

    from h3direct.config import H3Config
    from h3direct.dit.blocks import DiTBlock
    from h3direct.dit.denoiser import Denoiser, audio_scale_of

    p = argparse.ArgumentParser()
    p.add_argument("--attention", default="fa3")
    p.add_argument("--modes", default="default,max-autotune-no-cudagraphs")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="full", choices=sorted(C.PRESETS), help="tiny: a CPU check of the script")
    args = p.parse_args(argv)
    pre = C.PRESETS[args.preset]
    dev = args.device
    config = H3Config.from_name(pre.dit_config)
    wl = C.workload(pre.width, pre.height, pre.frames, pre.text_len)
    model, _ = build_dit(config, "nvfp4", dev)
    video, audio, text, cond = make_inputs(config, wl, dev, 0)
    sigma = torch.tensor([0.8], device=dev)
    with torch.inference_mode():
        context = model.preprocess_text(text, backend=args.attention)
    original = DiTBlock.forward
    rows = []

    def run(name, fused: bool, mode: str | None):
        with C.env_options({"H3_FUSED": "1" if fused else "0"}):  # put back afterwards
            measure(name, mode)

    def measure(name, mode: str | None):
        if mode is not None:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = torch.compile(original, dynamic=False, mode=None if mode == "default" else mode)
            for b in model.blocks:
                b.forward = types.MethodType(compiled, b)
        den = Denoiser(model, context, cond, audio_scale=audio_scale_of(model), backend=args.attention)
        try:
            with torch.inference_mode():
                C.sync(dev)
                t = time.perf_counter()
                den(video, audio, sigma)
                C.sync(dev)
                warm = time.perf_counter() - t
                frames_after_warmup = _frames() if mode else None
                C.reset_peak(dev)
                r = C.time_calls(lambda: den(video, audio, sigma), dev, warmup=0, iters=args.steps)
            row = {"variant": name, "warmup_s": warm, "s_per_step": r["median_s"], "peak_gib": C.peak_gib(dev)}
            if mode:
                row.update(frames=frames_after_warmup, recompiled_later=_frames() != frames_after_warmup,
                           graph_breaks=sum(torch._dynamo.utils.counters["graph_break"].values()))
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
            row = {"variant": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        finally:
            for b in model.blocks:
                b.__dict__.pop("forward", None)
        rows.append(row)
        C.log(str(row))

    run("eager (H3_FUSED=0)", False, None)
    run("fused Triton", True, None)
    for mode in [m for m in args.modes.split(",") if m]:
        run(f"compiled block ({mode})", False, mode)
    print(f"\n{'variant':40s} {'s/step':>8s} {'warm-up s':>10s} {'peak GiB':>9s}  notes")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:40s} error: {r['error']}")
            continue
        notes = "" if "frames" not in r else (f"frames {r['frames']}, graph breaks {r['graph_breaks']}, "
                                              f"recompiled after warm-up: {r['recompiled_later']}")
        print(f"{r['variant']:40s} {r['s_per_step']:8.3f} {r['warmup_s']:10.1f} {r['peak_gib'] or 0:9.2f}  {notes}")
    return 0


def _frames() -> int:
    import torch._dynamo

    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


if __name__ == "__main__":
    raise SystemExit(main())
