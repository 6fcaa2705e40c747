"""`h3direct trace`: the command line's edge of `traces.trace_dit.trace` (one denoiser evaluation from an inputs
file, traced per layer). Its options (attention backend and its options, kernels) are the same flags as
`h3direct generate`'s, over the same `H3_*` variables read once here."""

from __future__ import annotations

import argparse

from h3direct.app.cli_flags import add_options, given, option_names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="H3 DiT safetensors (ComfyUI layout; bf16 or NVFP4)")
    p.add_argument("--inputs", required=True, help="self-describing inputs file (h3_inputs metadata)")
    p.add_argument("--compute-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--nvfp4-mode", default="auto", choices=["auto", "w4a4", "w4a16"],
                   help="NVFP4 compute: auto = as ComfyUI on this device (w4a4 on compute capability >= 10, "
                        "else w4a16: Hopper and older, and the CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="Ulysses sequence parallelism over N processes (default under torchrun: its whole world; "
                        "run as torchrun --nproc-per-node N ... trace); N must divide the attention heads")
    p.add_argument("--out", required=True, help="trace .safetensors (a .json manifest is written beside it)")
    add_options(p.add_argument_group("options (as `h3direct generate`)"))


def run(args: argparse.Namespace) -> int:
    from h3direct.app import env
    from h3direct.dit.options import Options, check_in_effect
    from h3direct.traces.trace_dit import trace

    options = Options.from_flat({**env.read_options(), **given(args, option_names())})
    check_in_effect(options, given(args, option_names()))  # a flag that this run's backend never reads: one line
    return trace(checkpoint=args.checkpoint, inputs=args.inputs, out=args.out, options=options,
                 compute_dtype=args.compute_dtype, nvfp4_mode=args.nvfp4_mode, device=args.device,
                 sequence_parallel=args.sequence_parallel)
