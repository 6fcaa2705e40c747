"""`oracle replay --mode free`: a free-running comparison of the gate re-run as the gate ran it, and where its drift
starts.

h3direct (`--direct`): the whole denoiser evaluation from the trace's inputs file with the request's options
(attention backend and its options, 8-bit block linears, h3direct's dtype), traced by the step the gate's free run
takes (`h3direct.traces.evaluate.traced_step`); the named tensor is judged under the rule the gate printed, so the
replay shows the error and verdict of the gate's row. On the way it names where the drift starts:

- free-running: the first recorded tensor of that same run that is out of the rule;
- teacher-forced (an exact path: an approximate mode's layers are not held to the exact rule, its kernel rows are):
  every layer up to the named one, fed its recorded inputs, under the same rule, and the first out of it. None out
  of it while the free run is: each layer is within its rule and their errors add up on the way.

ComfyUI (`--comfy-root`): its own step re-run from the inputs file and compared with its recording.
"""

from __future__ import annotations

from h3direct.errors import H3Error
from oracle.replay_report import comfy_side, find_checkpoint, judge, ratio_refs, report
from oracle.replay_sites import DerivedInputs, find_inputs, replay_comfy_step, tensor_names


def free_step(r, compute: str) -> dict:
    """{recorded name: tensor} of one traced denoiser evaluation from the trace's inputs file, as the gate's free
    run computes it (`r`: the `oracle.replay.Replay` at work)."""
    from h3direct.dit.loader import load_dit
    from h3direct.traces.evaluate import traced_step
    from h3direct.traces.inputs import load_inputs

    req, trace = r.req, r.trace
    inputs = find_inputs(trace)
    if inputs is None:
        raise H3Error("no inputs file pairs with this trace: a free-running replay starts from it", path=trace.path)
    k = req.options.kernels
    model = load_dit(find_checkpoint(trace, req.checkpoint), compute_dtype=compute,
                     nvfp4_mode=trace.manifest.get("nvfp4_mode", "w4a16"), device=req.device,
                     fp8_linear=k.fp8_linear, fp8_linear_layers=k.fp8_linear_layers,
                     fp8_linear_format=k.fp8_linear_format, fp8_linear_rotate=k.fp8_linear_rotate)
    return traced_step(model, load_inputs(inputs), backend=req.options.attention, device=req.device)


def run(r) -> tuple[dict[str, bool | None], str]:
    from h3direct.traces.pairing import compute_of

    req, trace = r.req, r.trace
    dtype = compute_of(trace.manifest)
    compute = req.compute or dtype
    names = tensor_names(trace, req.layer)
    order = trace.names_in_order()
    upto = order[:max(order.index(n) for n in names) + 1]  # execution order, up to the named tensor
    refs = None
    if req.rule.ratio is not None:
        refs = ratio_refs(upto, trace, twin=r.twin, against=r.against)
        if not refs:
            raise H3Error("the ratio rule of a free-running row compares with ComfyUI's fp32 recording of the case: "
                          "pass --twin (the gate's printed command has it)")
    results: dict[str, bool | None] = {}
    if r.comfy_root:
        ran = comfy_side(r, lambda: replay_comfy_step(trace, comfy_root=r.comfy_root, checkpoint=req.checkpoint))
        if ran is not None:
            ok, lines = report("comfy", [(n, ran[n]) for n in names if n in ran], trace, req.rule, refs)
            print("\n".join(lines))
            results["comfy"] = ok
    else:
        print(r.not_run())
    if req.direct:
        ours = free_step(r, compute)
        missing = [n for n in names if n not in ours]
        if missing:
            raise H3Error(f"h3direct's free run records no {missing[0]}", path=trace.path)
        ok, lines = report("h3direct free", [(n, ours[n]) for n in names], trace, req.rule, refs)
        print("\n".join(lines))
        results["h3direct"] = ok
        if ok is False:  # out of the rule: where the drift starts
            print("where the drift starts:")
            print("  " + _first_free(upto, ours, trace, req.rule, refs))
            print("  " + (_first_teacher(upto, r) if _exact(req) else
                          "teacher-forced: not re-run (an approximate mode's layers are held to their kernel rows, "
                          "not to the exact rule)"))
    label = f"free-running, {compute}" + (f" vs {dtype} trace" if compute != dtype else "")
    return results, label


def _exact(req) -> bool:
    from h3direct.dit.attention import is_exact

    return is_exact(req.options.attention) and req.options.kernels.fp8_linear == "off"


def _first_free(upto: list[str], ours: dict, trace, rule, refs: dict | None) -> str:
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


def _first_teacher(upto: list[str], r) -> str:
    """The first layer up to the named one whose teacher-forced re-run is out of the rule, as one line."""
    import torch

    from h3direct.traces.pairing import compute_of

    req, trace, rule = r.req, r.trace, r.req.rule
    dtype = compute_of(trace.manifest)
    low = req.compute is not None and req.compute != dtype
    derived = DerivedInputs(trace, checkpoint=req.checkpoint, attention=req.options.attention, device=req.device,
                            compute=req.compute, dtypes_from=r.twin)
    ref32 = None
    if rule.ratio is not None and not low and dtype != "fp32":  # each layer's fp32 evaluation on the same inputs
        ref32 = DerivedInputs(trace, checkpoint=req.checkpoint, widen=True, device=req.device)
    runnable = [derived.sites[n] for n in upto if n in derived.sites
                and all(x in derived.view for x in derived.sites[n].needs)]
    for site in runnable:
        with torch.no_grad():
            got = site.run()
            if ref32 is not None:
                refs = ratio_refs([site.name], trace, local={site.name: ref32.site(site.name).run()})
            else:
                refs = ratio_refs([site.name], trace, twin=r.twin) if rule.ratio is not None else None
        ok, line = judge("teacher", site.name, got, trace, rule, refs)
        if ok is False:
            return f"teacher-forced, first layer out of the rule: {line.removeprefix('[teacher] ')}"
    return (f"teacher-forced: all {len(runnable)} layers up to it within the rule, each fed ComfyUI's recorded "
            f"inputs: the drift enters through what the free run computes for itself, or adds up over the layers")
