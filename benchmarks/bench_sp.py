"""Ulysses sequence parallelism (`h3direct.dit.parallel`): DiT s/step on 1 and N GPUs, scaling efficiency,
all-to-all time and bytes per step, full-size synthetic weights (`synthetic_gpu.build_dit`), Ref2VA geometry.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_sp            # H200 x2: S = 20,050 and 38,974
    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_sp --preset tiny --device cpu   # gloo check

Per geometry: N-rank steps first (every rank in lockstep), then one step with the collectives synchronized to
time the all-to-alls (`CommStats.timed`), then the same step on rank 0 alone (the model detached from the
group; the other ranks wait at a barrier), and the rel-L2 of the sharded x0 against the single-GPU one.
Bytes are what leaves one rank (as many arrive): the input of the link model in results/LOG.md.
Rank 0 writes the JSON (`--out`, or $OUT/bench_sp.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import _common as C

GEOMETRIES = {"full": "960x544x124,1344x768x124", "tiny": "64x64x22,96x64x22"}
ROCE_GBPS = 200.0  # two DGX Sparks, ConnectX-7 RoCE


def a2a_bytes_per_layer(config, seq_len: int, world: int, itemsize: int = 2) -> dict:
    """Bytes that leave one rank per DiT block (as many arrive): the q|k|v swap and the output swap."""
    rows = -(-seq_len // world)
    inner = config.num_attention_heads * config.attention_head_dim
    qkv = 3 * rows * inner * itemsize * (world - 1) // world
    out = rows * inner * itemsize * (world - 1) // world
    return {"qkv": qkv, "out": out, "total": qkv + out}


def projection(config, seq_len: int, world: int, link_gbps: float, link_efficiency: float,
               tflops: list[float]) -> dict:
    """All-to-all seconds per step over a link of `link_gbps` (per direction) and, for a few effective
    single-device TFLOP/s, s/step on 1 and `world` devices (compute split evenly, no overlap with the a2a)."""
    per_layer = a2a_bytes_per_layer(config, seq_len, world)
    gather = -(-seq_len // world) * world * config.hidden_size * 2 * (world - 1) // world
    step_bytes = per_layer["total"] * config.num_layers + gather
    a2a_s = step_bytes / (link_gbps / 8 * 1e9 * link_efficiency)
    flop = C.step_flops(config, seq_len)["total_tflop"]
    rows = []
    for tf in tflops:
        t1 = flop / tf
        tn = t1 / world + a2a_s
        rows.append({"tflops": tf, "s_per_step_x1": t1, f"s_per_step_x{world}": tn, "efficiency": t1 / (world * tn)})
    return {"seq_len": seq_len, "world": world, "bytes_per_layer": per_layer, "bytes_per_step": step_bytes,
            "link_gbps": link_gbps, "link_efficiency": link_efficiency, "a2a_s_per_step": a2a_s,
            "tflop_per_step": flop, "rows": rows}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_arguments(ap, default_budget=420.0)
    ap.add_argument("--geometries", default=None, help="comma list of WxHxF (default: preset's)")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "nvfp4"))
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after 1 warm-up)")
    ap.add_argument("--text-len", type=int, default=None, help="text tokens (default 256; tiny 8)")
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--no-single", action="store_true", help="skip the 1-GPU reference steps")
    ap.add_argument("--project", action="store_true", help="print the two-DGX-Spark projection (200 Gb/s RoCE) "
                    "from the analytic message sizes and exit; builds nothing")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from benchmarks.bench_dit import make_inputs
    from benchmarks.synthetic_gpu import build_dit
    from h3direct.config import H3Config
    from h3direct.dit import parallel
    from h3direct.dit.denoiser import Denoiser, audio_scale_of
    from h3direct.dit.options import Options
    from h3direct.traces.metrics import rel_l2

    preset = C.resolve_common(args)
    args.text_len = args.text_len or preset.text_len
    config = H3Config.from_name(preset.dit_config)
    if args.project:
        for geo in (args.geometries or GEOMETRIES[args.preset]).split(","):
            w, h, f = (int(x) for x in geo.lower().split("x"))
            p = projection(config, C.workload(w, h, f, args.text_len)["seq_len"], 2, ROCE_GBPS, 0.85,
                           [40.0, 60.0, 100.0])
            print(json.dumps({"geometry": geo, **p}))
        return 0
    sp = parallel.init_from_env(None, args.device)
    world, rank = (sp.world, sp.rank) if sp else (1, 0)
    dev = sp.device if sp else torch.device(args.device)
    if C.is_cuda(dev):
        torch.cuda.set_device(dev)
    if rank != 0:  # rank 0 reports; the others only take part
        args.out = os.devnull
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    run = C.Run("bench_sp", args)
    run.data.update(env=C.env_info(dev), world_size=world, config=config.comfy_dict(), results=[])
    with run.phase("build"):
        model, info = build_dit(config, args.weights, dev, seed=args.seed,
                                compute_dtype=torch.bfloat16 if C.is_cuda(dev) else torch.float32)
    run.data["build"] = info
    run.save()

    def barrier():
        if sp is not None:
            dist.barrier()

    for geo in (args.geometries or GEOMETRIES[args.preset]).split(","):
        w, h, f = (int(x) for x in geo.lower().split("x"))
        wl = C.workload(w, h, f, args.text_len)
        if run.over_budget():
            run.skip(geo, f"budget {run.budget:.0f} s spent")
            continue
        res = {"geometry": geo, "seq_len": wl["seq_len"], "world_size": world}
        with torch.inference_mode():
            video, audio, text, cond = make_inputs(config, wl, dev, args.seed)
            context = model.preprocess_text(text, options=Options.with_backend(args.attention))
            den = Denoiser(model, context, cond, audio_scale_of(model), options=Options.with_backend(args.attention))
            sigma = torch.tensor([args.sigma], dtype=torch.float32, device=dev)
            last = {}

            def step(den=den, video=video, audio=audio, sigma=sigma, last=last):
                last["x0"] = den(video, audio, sigma)

            if sp is not None:
                with run.phase(f"{geo} x{world}"):
                    C.reset_peak(dev)
                    t = C.time_calls(step, dev, warmup=1, iters=args.steps)
                res.update(sp_step_s=t["times_s"], sp_s_per_step=t["median_s"], sp_peak_gib=C.peak_gib(dev))
                x0_sp = tuple(x.float().cpu() for x in last["x0"])
                sp.stats.reset()
                sp.stats.timed = True
                with run.phase(f"{geo} x{world} a2a-timed"):
                    step()
                    C.sync(dev)
                sp.stats.timed = False
                st = sp.stats
                res.update(a2a_calls_per_step=st.a2a_calls, a2a_s_per_step=st.a2a_seconds,
                           a2a_bytes_per_step=st.a2a_bytes, gather_bytes_per_step=st.gather_bytes,
                           a2a_bytes_per_layer=st.a2a_bytes / config.num_layers,
                           roce_a2a_s_per_step=st.a2a_bytes / (ROCE_GBPS / 8 * 1e9))
                barrier()
            if rank == 0 and not args.no_single and not run.over_budget():
                model.parallel = None
                try:
                    with run.phase(f"{geo} x1"):
                        C.reset_peak(dev)
                        t1 = C.time_calls(step, dev, warmup=1, iters=args.steps)
                finally:
                    model.parallel = sp
                res.update(single_step_s=t1["times_s"], single_s_per_step=t1["median_s"],
                           single_peak_gib=C.peak_gib(dev))
                if sp is not None:
                    x0 = tuple(x.float().cpu() for x in last["x0"])
                    res["sp_vs_single_rel_l2"] = {"video": rel_l2(x0_sp[0], x0[0]), "audio": rel_l2(x0_sp[1], x0[1])}
                    res["speedup"] = res["single_s_per_step"] / res["sp_s_per_step"]
                    res["scaling_efficiency"] = res["speedup"] / world
            barrier()
        run.data["results"].append(res)
        run.save()
        del video, audio, text, context, den, last
        C.free_memory(dev)

    if rank == 0:
        rows = [[r["geometry"], r["seq_len"], r.get("single_s_per_step"), r.get("sp_s_per_step"), r.get("speedup"),
                 r.get("scaling_efficiency"), r.get("a2a_s_per_step"),
                 None if "a2a_bytes_per_step" not in r else r["a2a_bytes_per_step"] / 1e9, r.get("roce_a2a_s_per_step")]
                for r in run.data["results"]]
        C.print_table(f"Ulysses x{world} ({args.weights}, {args.attention}, {dev})",
                      ["geometry", "S", "s/step x1", f"s/step x{world}", "speedup", "efficiency", "a2a s/step",
                       "a2a GB/step/rank", "a2a s @200Gb/s"], rows)
    run.save()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
