"""`python -m oracle replay`: re-run one comparison of the gate, as the gate ran it (`oracle.request`: the request, its
flags and its rule), in ComfyUI and/or h3direct.

DiT traces, by mode:

- `teacher`: ComfyUI's module at the layer's path (`--comfy-root R` or $H3_COMFY_ROOT), loaded with
  `comfy.sd.load_diffusion_model` under the manifest's compute dtype, called with the recorded `<layer>.in.N`
  tensors (cast back to the dtype ComfyUI produced) and non-tensor inputs from the manifest's `static_inputs`; a
  trace that records outputs only (the ../shared/oracle contract) gets the module's inputs derived exactly as the
  gate's teacher forcing derives them (`h3direct.traces.replay`: each site's `args`). h3direct (`--direct`): the
  gate's teacher-forced site for that tensor. Whole-step names (`dit_inner.*`, `sampler.*`, ...) re-run the
  recorded step from its inputs file in ComfyUI.
- `free` (`oracle.replay_free`): the whole step from the inputs file, the named tensor judged, and where the drift
  starts;
- `kernel`: an approximate kernel at one site on its recorded operands (`h3direct.traces.kernels`), against exact
  arithmetic or the reference implementation `--reference` names; ComfyUI has no part in it;
- `drift`: a quantity an approximate mode measured (`h3direct.traces.quality`) against its `--baseline`.

VAE traces (`<case>.<module path>.out`, ...) and generation traces (`sampler.step{i}....`): the recorded operation
re-run whole from its inputs (`record-vae` / `record-generate` in ComfyUI; `trace-vae` / h3direct's sampler), and
the named tensor compared (`oracle.replay_ops`).

`--layer` takes a recorded tensor name as the gate prints it (`blocks.1.in.0`, `blocks.1.mlp.fc2.out`,
`blocks.1.attn.rope_q`, `drift.x0.video`), or a module path (`blocks.1`, `blocks.1.attn`): its outputs. Without a
rule the comparisons are reported and the exit status says only whether everything ran; with one, 1 when a judged
tensor is out of it.
"""

from __future__ import annotations

import argparse
import os

from h3direct.errors import H3Error
from oracle import request as R
from oracle.replay_report import Replay, comfy_side, ratio_refs, report, verdict_text
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
    R.add_arguments(parser)


def trace_kind(manifest: dict) -> str:
    kind = str(manifest.get("kind", ""))
    if kind.endswith(("_decode", "_encode")):
        return "vae"
    if kind == "generate":
        return "generate"
    return "dit"


def run(args: argparse.Namespace) -> int:
    from h3direct.traces.format import load_trace

    req = R.ReplayRequest.from_args(args)  # a bad option or rule is one line, before anything loads
    trace = load_trace(req.trace)
    comfy_root = None if req.no_comfy else (req.comfy_root or os.environ.get("H3_COMFY_ROOT") or None)
    if comfy_root is None and not req.direct:
        if req.mode not in R.COMFY_MODES:
            raise H3Error(f"nothing to replay: a {req.mode} row is h3direct's side alone (pass --direct)")
        raise H3Error("nothing to replay: pass --comfy-root R (or set H3_COMFY_ROOT) and/or --direct")
    kind = trace_kind(trace.manifest)
    if kind != "dit" and req.mode != "teacher":
        raise H3Error(f"--mode {req.mode} re-runs a DiT trace's comparison; a {kind} trace re-runs its recorded "
                      f"operation whole (no --mode)")
    run_ = Replay(req, trace, load_trace(req.twin) if req.twin else None,
                  load_trace(req.against) if req.against else None, comfy_root,
                  elsewhere=getattr(args, "comfy_elsewhere", False))
    if kind != "dit":
        from oracle import replay_ops

        results, label = replay_ops.run(kind, run_)
    elif req.mode == "free":
        from oracle import replay_free

        results, label = replay_free.run(run_)
    elif req.mode == "kernel":
        results, label = _run_kernel(run_)
    elif req.mode == "drift":
        results, label = _run_drift(run_)
    else:
        results, label = _run_teacher(run_)
    judged = {k: v for k, v in results.items() if v is not None}
    drifted = [k for k, v in judged.items() if not v]
    verdict = ("no rule given (the gate's failure line prints its rule)" if not judged else
               "all within budget" if not drifted else f"drifted: {', '.join(drifted)}")
    print(f"{req.layer} ({label}): {verdict}")
    return 1 if drifted else 0


def _run_teacher(r: Replay) -> tuple[dict[str, bool | None], str]:
    from h3direct.traces.pairing import compute_of

    req, trace = r.req, r.trace
    dtype = compute_of(trace.manifest)
    low = req.compute is not None and req.compute != dtype  # h3direct in another dtype than the trace
    if low and r.twin is None:
        raise H3Error(f"--compute-dtype {req.compute} against a {dtype} trace needs --twin: ComfyUI's own "
                      f"{req.compute} recording of the case (its dtypes and the ratio rule's reference)")
    if req.rule.ratio is not None and dtype == "fp32" and not low:
        raise H3Error("--ratio judges a low-precision layer against its own fp32 evaluation; this trace is fp32: its "
                      "rule is the fp32 rule (--budget), or give --compute-dtype and --twin")
    names = tensor_names(trace, req.layer)
    results: dict[str, bool | None] = {}
    module = module_of(names[0])
    whole = names[0].startswith(WHOLE_STEP)
    derived = None  # h3direct's sites: needed for --direct, and for ComfyUI when the module's inputs are not recorded
    if req.direct or (r.comfy_root and not whole and module is not None and f"{module}.in.0" not in trace):
        derived = DerivedInputs(trace, checkpoint=req.checkpoint, attention=req.options.attention, device=req.device,
                                compute=req.compute, dtypes_from=r.twin)
    refs = None
    if req.rule.ratio is not None and low:
        refs = ratio_refs(names, trace, twin=r.twin)
    elif req.rule.ratio is not None and dtype != "fp32":  # the fp32 evaluation of each layer on the recorded inputs
        ref32 = DerivedInputs(trace, checkpoint=req.checkpoint, widen=True, device=req.device)
        refs = ratio_refs(names, trace, local={n: t for n, t, _ in replay_direct(trace, req.layer, derived=ref32)})
    if r.comfy_root:
        out = None
        if whole:
            ran = comfy_side(r, lambda: replay_comfy_step(trace, comfy_root=r.comfy_root, checkpoint=req.checkpoint))
            out = None if ran is None else [(n, ran[n]) for n in names if n in ran]
        elif module is None:
            print(f"[comfy] {names[0]} is produced inside a ComfyUI module or between two, not by one: replay the "
                  f"module that produces it (its output) to re-run it in ComfyUI")
        else:
            got = comfy_side(r, lambda: as_list(replay_comfy(trace, module, comfy_root=r.comfy_root,
                                                              checkpoint=req.checkpoint, derived=derived)))
            if got is not None:
                names_c = names if len(got) == len(names) else [n for n, _ in recorded_outputs(trace, module)]
                out = list(zip(names_c, got, strict=False))
        if out is not None:
            ok, lines = report("comfy", out, trace, req.rule, refs)
            print("\n".join(lines))
            results["comfy"] = ok
    else:
        print(r.not_run())
    if req.direct:
        direct = replay_direct(trace, req.layer, derived=derived)
        ok, lines = report("h3direct", [(n, t) for n, t, _ in direct], trace, req.rule, refs)
        print("\n".join(lines))
        results["h3direct"] = ok
    return results, f"teacher-forced, {req.compute or dtype}" + (f" vs {dtype} trace" if low else "")


def _no_comfy_part(r: Replay, what: str) -> None:
    if r.comfy_root:
        print(f"[comfy] not run: {what}; ComfyUI has no part in it")
    if not r.req.direct:
        raise H3Error(f"{what}: h3direct's side alone (pass --direct)")


def _run_kernel(r: Replay) -> tuple[dict[str, bool | None], str]:
    """An approximate kernel at one site: the attention backend on the site's recorded q/k/v, or an 8-bit block
    linear on its recorded input, judged as the gate's kernel row."""
    import torch

    from h3direct.dit.attention import is_exact
    from h3direct.dit.linear import FP8Linear
    from h3direct.traces import kernels as K
    from h3direct.traces.pairing import compute_of

    req = r.req
    _no_comfy_part(r, "a kernel row compares h3direct's kernel with exact arithmetic on the recorded operands")
    name = tensor_names(r.trace, req.layer)[0]
    derived = DerivedInputs(r.trace, checkpoint=req.checkpoint, device=req.device, compute=req.compute,
                            dtypes_from=r.twin)
    site = derived.site(name)
    with torch.no_grad():
        if site.operands is not None:
            attention = req.options.attention
            if is_exact(attention):
                raise H3Error(f"{name}: an attention kernel row replays an approximate --attention backend")
            call = K.attention_call(site, attention, req.device)
            m = K.measure_attention(call, req.reference, attention)
            ran = "" if call.ran == attention.backend else f", ran {call.ran}"
            what = f"{attention.backend}{ran} vs {req.reference}"
        else:
            if req.options.kernels.fp8_linear == "off":
                raise H3Error(f"{name}: a kernel row is an attention site or an 8-bit linear (--fp8-linear)")
            quantized = _load(req, r.trace, req.compute or compute_of(r.trace.manifest), fp8=True)
            module = quantized.get_submodule(name.removesuffix(".out"))
            if not isinstance(module, FP8Linear):
                raise H3Error(f"{name}: not one of the 8-bit linears of --fp8-linear-layers")
            m = K.measure_linear(site, derived.model.get_submodule(name.removesuffix(".out")), module)
            what = f"{module.fmt} W8A8 vs the exact fp32 product, rho {m.rho:.4e}"
    v = req.rule.judge(R.Figures(m.err, errs=m.errs, cos=m.cos))
    print(f"[h3direct kernel] {name}: rel_l2 {m.err:.3e}, cos {m.cos:.8f} ({what})"
          + (f"; {m.info}" if m.info else "") + verdict_text(v))
    return {"h3direct": v.passed}, f"kernel, {what}"


def _load(req: R.ReplayRequest, trace, compute: str, *, fp8: bool):
    """h3direct's DiT of the request's checkpoint in `compute`, with its 8-bit linears when `fp8`."""
    from h3direct.dit.loader import load_dit
    from oracle.replay_report import find_checkpoint

    k = req.options.kernels
    extra = dict(fp8_linear=k.fp8_linear, fp8_linear_layers=k.fp8_linear_layers, fp8_linear_format=k.fp8_linear_format,
                 fp8_linear_rotate=k.fp8_linear_rotate) if fp8 else {}
    return load_dit(find_checkpoint(trace, req.checkpoint), compute_dtype=compute,
                    nvfp4_mode=trace.manifest.get("nvfp4_mode", "w4a16"), device=req.device, **extra)


def _run_drift(r: Replay) -> tuple[dict[str, bool | None], str]:
    """One quantity of an approximate mode's free step re-measured (`h3direct.traces.quality`) and held to the drift
    rule against the baseline the gate held it to."""
    import numpy as np

    from h3direct.traces.evaluate import traced_step
    from h3direct.traces.inputs import load_inputs
    from h3direct.traces.pairing import compute_of
    from h3direct.traces.quality import exact_backend, quantities
    from oracle.replay_sites import find_inputs

    req = r.req
    _no_comfy_part(r, "a drift row holds h3direct's approximate mode to its own recorded baseline")
    quantity = req.layer.removeprefix("drift.")
    try:
        with np.load(req.baseline) as z:
            before = float(z[f"{quantity}.err"]) if f"{quantity}.err" in z.files else None
    except (OSError, ValueError) as exc:
        raise H3Error(f"--baseline: not a baseline file ({exc})", path=req.baseline) from None
    if before is None:
        raise H3Error(f"the baseline records no {quantity}", path=req.baseline)
    inputs_path = find_inputs(r.trace)
    if inputs_path is None:
        raise H3Error("no inputs file pairs with this trace: a drift row's run starts from it", path=r.trace.path)
    inputs = load_inputs(inputs_path)
    dtype = compute_of(r.trace.manifest)
    compute = req.compute or dtype
    exact = traced_step(_load(req, r.trace, compute, fp8=False), inputs,
                        backend=exact_backend(req.options.attention), device=req.device)
    ours = traced_step(_load(req, r.trace, compute, fp8=req.options.kernels.fp8_linear != "off"), inputs,
                       backend=req.options.attention, device=req.device)
    fp32, low = (r.trace, r.twin) if dtype == "fp32" else (r.twin, r.trace)
    found = quantities(ours, exact, fp32, low, compute != "fp32")
    if quantity not in found:
        raise H3Error(f"{quantity}: not a quantity this run measures (it measures {', '.join(found)}); out.* needs "
                      f"--twin, ComfyUI's other recording of the case")
    q = found[quantity]
    v = req.rule.judge(R.Figures(q.err, baseline=before, scale=q.scale, paths=q.paths))
    print(f"[h3direct drift] {req.layer}: now {q.err:.4e}, baseline {before:.4e} ({req.baseline.name})"
          + verdict_text(v))
    return {"h3direct": v.passed}, f"drift, {compute}"
