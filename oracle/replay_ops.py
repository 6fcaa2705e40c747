"""`oracle replay` on VAE and generation traces: the recorded operation re-run whole from its inputs, in ComfyUI
(`record-vae` / `record-generate`, same code paths) and/or h3direct (`trace-vae` / h3direct's sampler), and the
named tensor(s) compared with the recording (`replay_report.report`)."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from h3direct.errors import H3Error
from oracle.replay_report import comfy_side, find_checkpoint, ratio_refs, report


def _names(trace, layer: str) -> list[str]:
    """The recorded tensors `layer` names: itself, or every recorded tensor under that prefix."""
    if layer in trace:
        return [layer]
    names = [n for n in trace.names_in_order() if n.startswith(layer + ".") or n.startswith(layer + "#")]
    if not names:
        raise H3Error(f"no recorded tensor {layer!r} (or under it) in this trace", path=trace.path)
    return names


def _vae_ours(trace, files) -> dict:
    from h3direct.traces import trace_vae
    from h3direct.traces.format import load_trace

    w, config, inputs = files
    op = str(trace.manifest["kind"]).split("_")[1]
    with tempfile.TemporaryDirectory(prefix="h3_replay_vae_") as tmp:
        out = Path(tmp) / "ours.safetensors"
        with contextlib.redirect_stdout(io.StringIO()):
            trace_vae.run(weights=str(w), config=str(config), inputs=str(inputs),
                          dtype=str(trace.manifest.get("compute_dtype", "fp32")), only=op, out=str(out))
        got = load_trace(out)
        return {n: got.get(n) for n in got.names_in_order()}


def _vae_comfy(trace, files, comfy_root: str) -> dict:
    import json

    from h3direct.traces.format import load_vae_inputs
    from oracle.comfy_env import open_comfy
    from oracle.record_vae import constructor_args, load_comfy_vae, record_op

    w, config, inputs = files
    m = trace.manifest
    env = open_comfy(comfy_root, device="cpu", compute_dtype="fp32", attention="pytorch")
    vae, _ = load_comfy_vae(env, w, constructor_args(json.loads(Path(config).read_text())),
                            str(m.get("compute_dtype", "fp32")))
    kind = str(m["kind"])
    items, _ = record_op(env, vae, kind, load_vae_inputs(inputs)[kind],
                         first_call_only=m.get("calls_recorded") == "first")
    return dict(items)


def _generation_ours(trace, checkpoint: str | None, device: str, attention) -> dict:
    from h3direct.dit.loader import load_dit
    from h3direct.traces.evaluate import short_generation
    from h3direct.traces.inputs import load_inputs
    from h3direct.traces.pairing import compute_of

    m = trace.manifest
    model = load_dit(find_checkpoint(trace, checkpoint), compute_dtype=compute_of(m),
                     nvfp4_mode=m.get("nvfp4_mode", "w4a16"), device=device)
    return short_generation(model, load_inputs(_generation_inputs(trace)), m, backend=attention, device=device)


def _generation_inputs(trace) -> Path:
    from h3direct.traces.pairing import missing_file, recorded_file

    p = recorded_file(trace.path, trace.manifest, "inputs")
    if p is None or not p.is_file():
        raise H3Error(missing_file("the inputs file of the manifest", p or trace.path.parent / "?", trace.path,
                                   trace.manifest, "inputs"))
    return p


def _generation_comfy(trace, checkpoint: str | None, comfy_root: str) -> dict:
    from h3direct.traces.inputs import load_inputs
    from h3direct.traces.pairing import compute_of
    from oracle.comfy_env import open_comfy
    from oracle.record_generate import record_generation

    m = trace.manifest
    env = open_comfy(comfy_root, device="cpu", compute_dtype=compute_of(m), attention="pytorch")
    s = m.get("sampling", {})
    items, _ = record_generation(env, find_checkpoint(trace, checkpoint), load_inputs(_generation_inputs(trace)),
                                 steps=int(m["steps"]), sampler=str(m.get("sampler", "euler")),
                                 scheduler=str(m.get("scheduler", "simple")),
                                 shift_video=float(s.get("shift", 12.0)),
                                 shift_audio=float(s.get("audio_shift", 3.0) or 3.0), cache=m.get("cache"))
    return dict(items)


def run(kind: str, r) -> tuple[dict[str, bool | None], str]:
    """`r`: the `oracle.replay_report.Replay` at work, on a VAE or a generation trace."""
    req, trace = r.req, r.trace
    names = _names(trace, req.layer)
    results: dict[str, bool | None] = {}
    files = None
    if kind == "vae":
        from h3direct.traces.pairing import vae_files

        files, problem = vae_files(trace.path, trace.manifest)
        if problem:
            raise H3Error(problem)
    label = f"{kind} {trace.manifest.get('kind')}, {trace.manifest.get('compute_dtype') or 'fp32'}"
    runs = []
    if r.comfy_root:
        runs.append(("comfy", lambda: comfy_side(r, lambda: _vae_comfy(trace, files, r.comfy_root) if kind == "vae"
                                                 else _generation_comfy(trace, req.checkpoint, r.comfy_root))))
    else:
        print(r.not_run())
    if req.direct:
        runs.append(("h3direct", lambda: _vae_ours(trace, files) if kind == "vae"
                     else _generation_ours(trace, req.checkpoint, req.device, req.options.attention)))
    refs = ratio_refs(names, trace, twin=r.twin) if req.rule.ratio is not None else None
    for side, make in runs:
        got = make()
        if got is None:  # ComfyUI does not import here: said in one line
            continue
        missing = [n for n in names if n not in got]
        if missing:
            print(f"[{side}] did not produce {', '.join(missing[:3])}")
            results[side] = False
            continue
        ok, lines = report(side, [(n, got[n].detach().float().cpu()) for n in names], trace, req.rule, refs)
        print("\n".join(lines))
        results[side] = ok
    return results, label
