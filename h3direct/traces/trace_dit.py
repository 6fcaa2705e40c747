"""`h3direct trace`: one denoiser evaluation from an inputs file, recorded under the oracle's names."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="H3 DiT safetensors (ComfyUI layout; bf16 or NVFP4)")
    p.add_argument("--inputs", required=True, help="self-describing inputs file (h3_inputs metadata)")
    p.add_argument("--compute-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--attention", default="sdpa", help="attention backend (see h3direct.dit.attention)")
    p.add_argument("--nvfp4-mode", default="auto", choices=["auto", "w4a4", "w4a16"],
                   help="NVFP4 compute: auto = as ComfyUI on this device (w4a4 on compute capability >= 10, "
                        "else w4a16: Hopper and older, and the CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--mlp-chunks", type=int, default=1)
    p.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="Ulysses sequence parallelism over N processes (default under torchrun: its whole world; "
                        "run as torchrun --nproc-per-node N ... trace); N must divide the attention heads")
    p.add_argument("--out", required=True, help="trace .safetensors (a .json manifest is written beside it)")


def run(args) -> int:
    import torch

    from h3direct.dit import parallel
    from h3direct.errors import H3Error

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise H3Error(f"--device {args.device}: no CUDA device is available")
    sp = parallel.init_from_env(args.sequence_parallel, args.device)
    try:
        return _trace(args, sp)
    finally:
        parallel.shutdown()


def _trace(args, sp) -> int:
    import torch

    from h3direct.dit import parallel
    from h3direct.dit.attention import check_backend
    from h3direct.dit.linear import resolve_nvfp4_mode
    from h3direct.dit.loader import load_dit
    from h3direct.dit.tracing import Tracer
    from h3direct.traces.evaluate import one_step
    from h3direct.traces.format import save_trace
    from h3direct.traces.inputs import load_inputs

    device = str(sp.device) if sp is not None else args.device  # each rank on its own GPU (cuda:LOCAL_RANK)
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.compute_dtype]
    check_backend(args.attention, torch.empty(0, device=device, dtype=compute))
    inputs = load_inputs(args.inputs)
    model = load_dit(args.checkpoint, compute_dtype=args.compute_dtype, nvfp4_mode=args.nvfp4_mode,
                     device=device)
    with Tracer(model) as tracer:
        one_step(model, inputs, backend=args.attention, mlp_chunks=args.mlp_chunks, device=device)
    if not parallel.is_writer():
        return 0  # rank 0 holds the same gathered trace and writes it
    manifest = {
        "producer": "h3direct",
        "checkpoint": str(args.checkpoint),
        "inputs": str(args.inputs),
        "task": inputs.task,
        "variant": inputs.variant,
        "sigma": inputs.sigma,
        "seed": inputs.seed,
        "compute_dtype_requested": args.compute_dtype,
        "nvfp4_mode": resolve_nvfp4_mode(args.nvfp4_mode, args.device),
        "attention": args.attention,
        "device": args.device,
        **parallel.manifest_fields(),
        "config": model.config.comfy_dict(),
    }
    path = save_trace(args.out, tracer.tensors, manifest)
    print(json.dumps({"trace": str(path), "manifest": str(path.with_suffix(".json")),
                      "tensors": len(tracer.tensors)}), file=sys.stdout)
    return 0
