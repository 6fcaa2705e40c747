"""`python -m oracle replay`: re-run one recorded layer of any trace the gate takes, in ComfyUI and/or h3direct.

DiT traces (teacher forcing): ComfyUI's module at the layer's path (`--comfy-root R` or $H3_COMFY_ROOT), loaded with
`comfy.sd.load_diffusion_model` under the manifest's compute dtype, is called with the recorded `<layer>.in.N`
tensors (cast back to the dtype ComfyUI produced) and non-tensor inputs from the manifest's `static_inputs`. A
trace that records outputs only (the ../shared/oracle contract: inputs are derived from the previous layer) gets the
module's inputs -- its non-tensor ones too (a block's modulation runs, the final layer's stream segments) -- derived
exactly as the gate's teacher forcing derives them (`h3direct.traces.replay`: each site's `args`). Whole-step names
(`dit_inner.*`, `sampler.*`, ...) re-run the recorded step from its inputs file. h3direct (`--direct`): the gate's
teacher-forced site for that tensor; `--attention B` runs backend B there (with `--option NAME=VALUE` for its options,
as the gate took them), and at an attention site an approximate B is also compared with exact fp32 attention on the
recorded q/k/v (its kernel error, as the gate's part b).

VAE traces (`<case>.<module path>.out`, ...) and generation traces (`sampler.step{i}....`): the recorded operation
re-run whole from its inputs (`record-vae` / `record-generate` in ComfyUI; `trace-vae` / h3direct's sampler), and
the named tensor compared.

`--layer` takes a module path (`blocks.1`, `blocks.1.attn`, `blocks.1.mlp.fc2`) or a recorded tensor name as the
gate prints it (`blocks.1.mlp.fc2.out`, `blocks.1.attn.rope_q`). The rule is given as the gate prints it in its
failure line: `--budget REL` (rel-L2 against the recorded tensor), or `--ratio K [--floor F]` (a low-precision
trace: h3direct's error against the fp32 evaluation of the same layer on the same inputs at most K times ComfyUI's
own, plus F). Without a rule the comparisons are reported and the exit status says only whether everything ran.
"""

from __future__ import annotations

import argparse
import os

from h3direct.dit.options import FP8_LINEAR_FORMATS, FP8_LINEAR_MODES
from h3direct.errors import H3Error
from oracle.replay_report import Rule, comfy_not_run, ratio_refs, report
from oracle.replay_sites import (
    DerivedInputs,
    as_list,
    module_of,
    recorded_outputs,
    replay_comfy,
    replay_comfy_step,
    replay_direct,
    tensor_names,
)

WHOLE_STEP = ("dit_inner.", "dit_forward.", "sampler.", "sample_out.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="trace .safetensors (any trace the parity gate accepts)")
    parser.add_argument("--layer", required=True, help="module path or recorded tensor name, e.g. blocks.1.attn")
    parser.add_argument("--comfy-root", help="ComfyUI checkout (default: $H3_COMFY_ROOT)")
    parser.add_argument(
        "--checkpoint",
        help="checkpoint file (default: the manifest's, looked up beside the trace and in $H3_ORACLE_DIR)",
    )
    parser.add_argument("--direct", action="store_true", help="re-run the layer with h3direct")
    parser.add_argument("--mode", choices=("teacher", "free"), default="teacher",
                        help="teacher (default): the layer alone, fed its recorded inputs (the gate's teacher-forced "
                             "row); free: the whole step from the inputs file, as the gate's free-running row, with "
                             "the first layer out of its rule on the way (where the drift starts)")
    parser.add_argument("--compute-dtype", choices=("fp32", "bf16", "fp16"),
                        help="h3direct's dtype where the gate ran it in another than the trace's (default: the "
                             "trace's)")
    parser.add_argument("--twin", help="ComfyUI's other recording of the case for the ratio rule: the fp32 twin of a "
                                       "low-precision trace, or ComfyUI's low-precision trace of an fp32 case run in "
                                       "--compute-dtype")
    parser.add_argument("--against", help="with --ratio: the ComfyUI recording whose own error against fp32 scales "
                                          "the limit (default: ComfyUI's low-precision recording of the case; the "
                                          "class rule's is ComfyUI --use-sage-attention's)")
    parser.add_argument("--fp8-linear", choices=FP8_LINEAR_MODES, default="off",
                        help="h3direct's 8-bit block linears (free mode), as the gate's --fp8-linear")
    parser.add_argument("--fp8-linear-layers", help="with --fp8-linear: which linears of every block (comma list)")
    parser.add_argument("--fp8-linear-format", choices=FP8_LINEAR_FORMATS, default="e4m3",
                        help="with --fp8-linear: the 8-bit number format")
    parser.add_argument("--fp8-linear-rotate", default="none",
                        help="with --fp8-linear-format int8: which int8 linears rotate (none, or a comma list)")
    parser.add_argument("--no-comfy", action="store_true",
                        help="only h3direct (with --direct), even with a ComfyUI root")
    parser.add_argument("--attention", default="sdpa", help="h3direct's attention backend for --direct (default sdpa)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an option of the attention backends by its flat name (repeatable), e.g. sol_tau=2.0")
    parser.add_argument("--device", default="cpu", help="where h3direct runs for --direct (cpu or cuda)")
    parser.add_argument("--budget", type=float, help="rule: rel-L2 against the recorded tensor at most REL")
    parser.add_argument("--ratio", type=float, metavar="K",
                        help="rule (low-precision traces): h3direct's error against the layer's fp32 evaluation on "
                             "the same inputs at most K times ComfyUI's, plus --floor")
    parser.add_argument("--floor", type=float, default=0.0, help="the ratio rule's floor (default 0)")


def trace_kind(manifest: dict) -> str:
    kind = str(manifest.get("kind", ""))
    if kind.endswith(("_decode", "_encode")):
        return "vae"
    if kind == "generate":
        return "generate"
    return "dit"


def _kernel_lines(derived: DerivedInputs, names: list[str], attention, device: str) -> list[str]:
    """An approximate backend at attention sites: its error against exact fp32 attention on the recorded q/k/v."""
    import torch
    import torch.nn.functional as F

    from h3direct.dit.attention import attention as attend
    from h3direct.dit.attention import is_exact, sequence_hints
    from h3direct.dit.options import describe
    from h3direct.traces.metrics import rel_l2

    if is_exact(attention):
        return []
    lines = []
    for name in names:
        site = derived.sites.get(name)
        if site is None or site.operands is None:
            continue
        q, k, v, prefix = site.operands()
        with torch.no_grad(), sequence_hints(prefix):
            half = [x.to(device, torch.bfloat16) for x in (q, k, v)]
            ours = attend(*half, attention)[0].float().cpu()
            exact = F.scaled_dot_product_attention(*(x.float() for x in half))[0].transpose(0, 1).cpu()
        err = rel_l2(ours, exact.reshape(ours.shape))
        lines.append(f"[kernel {describe(attention)}] {name}: rel_l2 vs exact fp32 attention on the recorded "
                     f"q/k/v {err:.3e}")
    return lines


def run(args: argparse.Namespace) -> int:
    from h3direct.dit.options import Options, check_in_effect, parse_assignments
    from h3direct.traces.format import load_trace

    given = parse_assignments(args.option, only="attention")  # a bad one is one line, before anything loads
    options = Options.from_flat({"attention": args.attention, **given})
    check_in_effect(options, given, spell=lambda n: f"--option {n}")
    args.attention = options.attention
    check_fp8_flags(args)
    trace = load_trace(args.trace)
    args.twin = load_trace(args.twin) if args.twin else None
    args.against = load_trace(args.against) if args.against else None
    if args.against is not None and args.ratio is None:
        raise H3Error("--against scales the ratio rule's limit: give --ratio K too")
    comfy_root = args.comfy_root or os.environ.get("H3_COMFY_ROOT")
    use_comfy = bool(comfy_root) and not args.no_comfy
    if not use_comfy and not args.direct:
        raise H3Error("nothing to replay: pass --comfy-root R (or set H3_COMFY_ROOT) and/or --direct")
    rule = Rule(args.budget, args.ratio, args.floor)
    kind = trace_kind(trace.manifest)
    if kind == "dit" and args.mode == "free":
        from oracle import replay_free

        results, label = replay_free.run(args, trace, comfy_root if use_comfy else None, rule)
    elif kind == "dit":
        results, label = _run_dit(args, trace, comfy_root if use_comfy else None, rule)
    else:
        from oracle import replay_ops

        results, label = replay_ops.run(kind, args, trace, comfy_root if use_comfy else None, rule)
    judged = {k: v for k, v in results.items() if v is not None}
    drifted = [k for k, v in judged.items() if not v]
    verdict = ("no rule given (the gate's failure line prints --budget or --ratio)" if not judged else
               "all within budget" if not drifted else f"drifted: {', '.join(drifted)}")
    print(f"{args.layer} ({label}): {verdict}")
    return 1 if drifted else 0


def check_fp8_flags(args) -> None:
    """--fp8-linear and its companions as one line when they do not fit together, before anything loads."""
    from h3direct.dit.options import fp8_flags_problem

    problem = fp8_flags_problem(args.fp8_linear, args.fp8_linear_layers, args.fp8_linear_format,
                                args.fp8_linear_rotate)
    if problem is not None:
        raise H3Error(problem)
    if args.fp8_linear != "off" and args.mode != "free":
        raise H3Error("--fp8-linear replays a free run (--mode free): a teacher-forced layer runs the checkpoint's "
                      "own linears")


def _run_dit(args, trace, comfy_root: str | None, rule: Rule) -> tuple[dict[str, bool | None], str]:
    from h3direct.traces.pairing import compute_of

    dtype = compute_of(trace.manifest)
    low = args.compute_dtype is not None and args.compute_dtype != dtype  # h3direct in another dtype than the trace
    if low and args.twin is None:
        raise H3Error(f"--compute-dtype {args.compute_dtype} against a {dtype} trace needs --twin: ComfyUI's own "
                      f"{args.compute_dtype} recording of the case (its dtypes and the ratio rule's reference)")
    names = tensor_names(trace, args.layer)
    results: dict[str, bool | None] = {}
    module = module_of(names[0])
    whole = names[0].startswith(WHOLE_STEP)
    derived = None  # h3direct's sites: needed for --direct, and for ComfyUI when the module's inputs are not recorded
    if args.direct or (comfy_root and not whole and module is not None and f"{module}.in.0" not in trace):
        derived = DerivedInputs(trace, checkpoint=args.checkpoint, attention=args.attention, device=args.device,
                                compute=args.compute_dtype, dtypes_from=args.twin)
    refs = None
    if rule.ratio is not None and low:
        refs = ratio_refs(names, trace, twin=args.twin)
    elif rule.ratio is not None and dtype != "fp32":  # the fp32 evaluation of each layer on the recorded inputs
        ref32 = DerivedInputs(trace, checkpoint=args.checkpoint, widen=True, device=args.device)
        refs = ratio_refs(names, trace, local={n: t for n, t, _ in replay_direct(trace, args.layer, derived=ref32)})
    if comfy_root:
        if whole:
            ran = replay_comfy_step(trace, comfy_root=comfy_root, checkpoint=args.checkpoint)
            out = [(n, ran[n]) for n in names if n in ran]
        elif module is None:
            print(f"[comfy] {names[0]} is produced inside a ComfyUI module, not by one: replay its parent "
                  f"({names[0].rsplit('.', 1)[0]}) to re-run it in ComfyUI")
            out = None
        else:
            got = as_list(replay_comfy(trace, module, comfy_root=comfy_root, checkpoint=args.checkpoint,
                                       derived=derived))
            names_c = names if len(got) == len(names) else [n for n, _ in recorded_outputs(trace, module)]
            out = list(zip(names_c, got, strict=False))
        if out is not None:
            ok, lines = report("comfy", out, trace, rule, refs)
            print("\n".join(lines))
            results["comfy"] = ok
    else:
        print(comfy_not_run(args))
    if args.direct:
        direct = replay_direct(trace, args.layer, derived=derived)
        ok, lines = report("h3direct", [(n, t) for n, t, _ in direct], trace, rule, refs)
        print("\n".join(lines + _kernel_lines(derived, names, args.attention, args.device)))
        results["h3direct"] = ok
    return results, f"teacher-forced, {args.compute_dtype or dtype}" + (f" vs {dtype} trace" if low else "")
