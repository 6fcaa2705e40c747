"""`oracle replay --mode free`: a free-running comparison of the gate re-run as the gate ran it, and where its drift
starts.

h3direct (`--direct`): the whole denoiser evaluation from the trace's inputs file, with the gate's options (attention
backend and its options, 8-bit block linears, h3direct's dtype), traced; the named tensor is compared with the
recording under the rule the gate printed, so the replay shows the error and verdict of the gate's row. On the way
it names where the drift starts:

- free-running: the first recorded tensor of that same run that is out of the rule;
- teacher-forced (an exact path: an approximate mode's layers are not held to the exact rule): every layer up to the
  named one, fed its recorded inputs, under the same rule, and the first out of it. None out of it while the free run
  is: each layer is within its rule and their errors add up on the way.

ComfyUI (`--comfy-root`): its own step re-run from the inputs file and compared with its recording.
"""

from __future__ import annotations

from h3direct.errors import H3Error
from oracle.replay_report import Rule, comfy_not_run, find_checkpoint, judge, ratio_refs, report
from oracle.replay_sites import DerivedInputs, find_inputs, replay_comfy_step, tensor_names


def free_step(trace, args, compute: str) -> dict:
    """{recorded name: tensor} of one traced denoiser evaluation from the trace's inputs file, as the gate's free
    run computes it."""
    import torch

    from h3direct.dit.loader import load_dit
    from h3direct.dit.tracing import Tracer
    from h3direct.traces.evaluate import one_step
    from h3direct.traces.inputs import load_inputs

    inputs = find_inputs(trace)
    if inputs is None:
        raise H3Error("no inputs file pairs with this trace: a free-running replay starts from it", path=trace.path)
    model = load_dit(find_checkpoint(trace, args.checkpoint), compute_dtype=compute,
                     nvfp4_mode=trace.manifest.get("nvfp4_mode", "w4a16"), device=args.device,
                     fp8_linear=args.fp8_linear, fp8_linear_layers=args.fp8_linear_layers,
                     fp8_linear_format=args.fp8_linear_format, fp8_linear_rotate=args.fp8_linear_rotate)
    with torch.no_grad(), Tracer(model) as tracer:
        out = one_step(model, load_inputs(inputs), backend=args.attention, device=args.device)
    return {**tracer.tensors, **out}


def run(args, trace, comfy_root: str | None, rule: Rule) -> tuple[dict[str, bool | None], str]:
    from h3direct.traces.pairing import compute_of

    dtype = compute_of(trace.manifest)
    compute = args.compute_dtype or dtype
    names = tensor_names(trace, args.layer)
    order = trace.names_in_order()
    upto = order[:max(order.index(n) for n in names) + 1]  # execution order, up to the named tensor
    refs = None
    if rule.ratio is not None:
        refs = ratio_refs(upto, trace, twin=args.twin, against=args.against)
        if not refs:
            raise H3Error("the ratio rule of a free-running row compares with ComfyUI's fp32 recording of the case: "
                          "pass --twin (the gate's printed command has it)")
    results: dict[str, bool | None] = {}
    if comfy_root:
        ran = replay_comfy_step(trace, comfy_root=comfy_root, checkpoint=args.checkpoint)
        ok, lines = report("comfy", [(n, ran[n]) for n in names if n in ran], trace, rule, refs)
        print("\n".join(lines))
        results["comfy"] = ok
    else:
        print(comfy_not_run(args))
    if args.direct:
        ours = free_step(trace, args, compute)
        missing = [n for n in names if n not in ours]
        if missing:
            raise H3Error(f"h3direct's free run records no {missing[0]}", path=trace.path)
        ok, lines = report("h3direct free", [(n, ours[n]) for n in names], trace, rule, refs)
        print("\n".join(lines))
        results["h3direct"] = ok
        if ok is False:  # out of the rule: where the drift starts
            print("where the drift starts:")
            print("  " + _first_free(upto, ours, trace, rule, refs))
            if _exact(args):
                print("  " + _first_teacher(upto, trace, args, rule))
    label = f"free-running, {compute}" + (f" vs {dtype} trace" if compute != dtype else "")
    return results, label


def _exact(args) -> bool:
    from h3direct.dit.attention import is_exact

    return is_exact(args.attention) and args.fp8_linear == "off"


def _first_free(upto: list[str], ours: dict, trace, rule: Rule, refs: dict | None) -> str:
    """The first recorded tensor of the free run out of the rule, as one line."""
    judged = 0
    for name in upto:
        if name not in ours or name.startswith("sampler.x_in."):
            continue
        ok, line = judge("free", name, ours[name], trace, rule, refs)
        judged += ok is not None
        if ok is False:
            return f"free run, first recorded tensor out of the rule: {line.removeprefix('[free] ')}"
    return f"free run: all {judged} recorded tensors up to it within the rule"


def _first_teacher(upto: list[str], trace, args, rule: Rule) -> str:
    """The first layer up to the named one whose teacher-forced re-run is out of the rule, as one line."""
    import torch

    from h3direct.traces.pairing import compute_of

    dtype = compute_of(trace.manifest)
    low = args.compute_dtype is not None and args.compute_dtype != dtype
    derived = DerivedInputs(trace, checkpoint=args.checkpoint, attention=args.attention, device=args.device,
                            compute=args.compute_dtype, dtypes_from=args.twin)
    ref32 = None
    if rule.ratio is not None and not low and dtype != "fp32":  # each layer's fp32 evaluation on the same inputs
        ref32 = DerivedInputs(trace, checkpoint=args.checkpoint, widen=True, device=args.device)
    runnable = [derived.sites[n] for n in upto if n in derived.sites
                and all(x in derived.view for x in derived.sites[n].needs)]
    for site in runnable:
        with torch.no_grad():
            got = site.run()
            if ref32 is not None:
                refs = ratio_refs([site.name], trace, local={site.name: ref32.site(site.name).run()})
            else:
                refs = ratio_refs([site.name], trace, twin=args.twin) if rule.ratio is not None else None
        ok, line = judge("teacher", site.name, got, trace, rule, refs)
        if ok is False:
            return f"teacher-forced, first layer out of the rule: {line.removeprefix('[teacher] ')}"
    return (f"teacher-forced: all {len(runnable)} layers up to it within the rule, each fed ComfyUI's recorded "
            f"inputs: the drift enters through what the free run computes for itself, or adds up over the layers")
