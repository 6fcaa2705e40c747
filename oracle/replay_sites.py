"""What `oracle replay` re-runs a DiT trace with: a recorded module's inputs (recorded, or derived from the recorded
outputs as the gate's teacher forcing derives them: `DerivedInputs`), its outputs, the trace's inputs file and
checkpoint, and the ComfyUI module or whole step re-run on them (`replay_comfy`, `replay_comfy_step`). Below the
command (`oracle.replay`) and its free-running mode (`oracle.replay_free`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error
from oracle.replay_report import find_checkpoint


def split_call(layer: str) -> tuple[str, str]:
    """'final_layer.norm#1' -> ('final_layer.norm', 'final_layer.norm#1')."""
    return re.sub(r"#\d+$", "", layer), layer


def _static(value: Any) -> Any:
    if isinstance(value, list):
        return [tuple(v) if isinstance(v, list) else v for v in value]
    return value


def _static_input(static: dict, layer: str, i: int) -> tuple[bool, Any]:
    name = f"{layer}.in.{i}"
    if name in static:
        return True, _static(static[name])
    m = re.match(r"^blocks\.\d+(.*)$", layer)  # blocks share the block-0 segment list
    alt = f"blocks.0{m.group(1)}.in.{i}" if m else None
    if alt and alt in static and not isinstance(static[alt], str):
        return True, _static(static[alt])
    return False, None


def _recorded(trace, name: str):
    """A fresh copy of a recorded tensor in the dtype its program produced (stored widened to float32)."""
    import torch

    t = trace.get(name).clone()
    dt = trace.produced_dtype(name)
    return t.to(getattr(torch, dt)) if dt and hasattr(torch, dt) else t


def recorded_inputs(trace, layer: str, derived=None) -> tuple[list[Any], dict[str, Any]]:
    """Positional inputs `<layer>.in.N` (tensors at their produced dtype, or manifest static values) + kwargs.

    `derived`: a `DerivedInputs` used when the trace holds no `<layer>.in.0` (a trace of outputs only): the module's
    inputs are then derived from the recorded outputs as the gate's teacher forcing does, a recorded static value
    winning over a derived one."""
    static = trace.manifest.get("static_inputs") or {}
    args: list[Any] = []
    derived_args = f"{layer}.in.0" not in trace and derived is not None
    if derived_args:
        for i, a in enumerate(derived.args(layer)):
            found, value = _static_input(static, layer, i)
            if found and not hasattr(a, "shape"):
                a = value
            if a is None:
                raise H3Error(f"{layer}: non-tensor input {i} is neither in the manifest's static_inputs nor "
                              f"derivable", path=trace.path)
            args.append(a)
    i = 0
    while not derived_args:
        name = f"{layer}.in.{i}"
        if name in trace:
            args.append(_recorded(trace, name))
        else:
            found, value = _static_input(static, layer, i)
            if not found:
                break
            args.append(value)
        i += 1
    if not args:
        raise H3Error(f"no recorded inputs '{layer}.in.N' in this trace and none derivable", path=trace.path)
    kwargs: dict[str, Any] = {}
    if re.match(r"^blocks\.\d+\.attn$", layer.split("#")[0]):
        block = layer.rsplit(".", 1)[0]
        table = next((n for n in (f"{block}.in.3", "blocks.0.in.3") if n in trace), None)
        if table is not None:
            kwargs["rope_freqs"] = _recorded(trace, table)
        elif derived is not None:
            kwargs["rope_freqs"] = derived.view("blocks.0.in.3")
        else:
            raise H3Error(f"{layer} needs the rope table '{block}.in.3', not in this trace", path=trace.path)
    return args, kwargs


class DerivedInputs:
    """Module inputs of a DiT trace derived from its recorded tensors by the gate's teacher-forced sites.

    widen: an fp32 model fed the recorded values in float32 (the fp32 evaluation of each layer on ComfyUI's inputs,
    which the ratio rule measures both sides against)."""

    def __init__(self, trace, *, checkpoint: str | None = None, attention="sdpa", device: str = "cpu",
                 widen: bool = False, compute: str | None = None, dtypes_from=None):
        """compute: h3direct's dtype where it is not the trace's (then `dtypes_from`, ComfyUI's own trace of the case
        in that dtype, gives each recorded tensor's dtype; `TraceView`)."""
        from h3direct.dit.loader import COMPUTE_DTYPES, load_dit
        from h3direct.dit.model import Conditioning
        from h3direct.traces.evaluate import conditioning_of
        from h3direct.traces.inputs import load_inputs
        from h3direct.traces.pairing import compute_of
        from h3direct.traces.replay import TraceView, sites

        ckpt = find_checkpoint(trace, checkpoint)
        inputs = find_inputs(trace)
        own = compute_of(trace.manifest)
        compute = "fp32" if widen else compute or own
        self.model = load_dit(ckpt, compute_dtype=compute, nvfp4_mode=trace.manifest.get("nvfp4_mode", "w4a16"),
                              device=device)
        inp = load_inputs(inputs) if inputs else None
        cond = conditioning_of(inp) if inp else Conditioning()
        other = compute != own and not widen
        self.view = TraceView(trace, device, dtypes_from=dtypes_from if other else None,
                              compute_dtype=COMPUTE_DTYPES[compute] if other else None, widen=widen)
        self.sites = {s.name: s for s in sites(self.model, trace, cond, inp["text_states"] if inp else None,
                                               backend=attention, device=device, view=self.view)}
        self.trace = trace

    def site(self, name: str):
        site = self.sites.get(name)
        if site is None:
            raise H3Error(f"h3direct has no teacher-forced site for {name!r}")
        missing = [n for n in site.needs if n not in self.view]
        if missing:
            raise H3Error(f"{name} needs {', '.join(missing[:3])}, neither recorded nor derivable from this trace",
                          path=self.trace.path)
        return site

    def args(self, module: str) -> list:
        """The positional inputs of ComfyUI's module `module`, derived (tensors, and the non-tensor runs)."""
        import torch

        name = next((n for n in (f"{module}.out", f"{module}.out.0") if n in self.sites), None)
        if name is None or self.sites[name].args is None:
            raise H3Error(f"cannot derive the inputs of {module!r} from this trace", path=self.trace.path)
        with torch.no_grad():
            return [a.clone() if isinstance(a, torch.Tensor) else a for a in self.site(name).args()]


def recorded_outputs(trace, layer: str) -> list[tuple[str, Any]]:
    if f"{layer}.out" in trace:
        return [(f"{layer}.out", trace.get(f"{layer}.out"))]
    outs, i = [], 0
    while f"{layer}.out.{i}" in trace:
        outs.append((f"{layer}.out.{i}", trace.get(f"{layer}.out.{i}")))
        i += 1
    if not outs:
        raise H3Error(f"no recorded output '{layer}.out' in this trace", path=trace.path)
    return outs


def find_inputs(trace) -> Path | None:
    """The inputs file of a trace, paired as the gate pairs it (`h3direct.traces.pairing.pair_inputs`), or None."""
    from h3direct.traces.pairing import pair_inputs, recorded_file

    ckpt = recorded_file(trace.path, trace.manifest, "checkpoint")
    return pair_inputs(trace.path.parent, trace.manifest, trace.path, ckpt if ckpt and ckpt.is_file() else None)[0]


def _attention_name(trace) -> str:
    fn = str(trace.manifest.get("attention", "attention_pytorch"))
    return {
        "attention_pytorch": "pytorch",
        "attention_sage": "sage",
        "attention_flash": "flash",
        "attention_split": "split",
        "attention_sub_quad": "sub_quad",
    }.get(fn, "pytorch")


def replay_comfy(trace, layer: str, *, comfy_root: str | None = None, checkpoint: str | None = None,
                 derived: DerivedInputs | None = None):
    """The ComfyUI module at `layer` called on the recorded (or derived) inputs; returns its output."""
    import torch

    from h3direct.traces.pairing import compute_of
    from oracle.comfy_env import open_comfy

    ckpt = find_checkpoint(trace, checkpoint)
    env = open_comfy(comfy_root, device="cpu", compute_dtype=compute_of(trace.manifest),
                     attention=_attention_name(trace))
    patcher = env.sd.load_diffusion_model(str(ckpt))
    env.model_management.load_models_gpu([patcher])
    path, _ = split_call(layer)
    try:
        module = patcher.model.diffusion_model.get_submodule(path)
    except AttributeError:
        raise H3Error(f"ComfyUI's model has no module {path!r}") from None
    if derived is None and f"{path}.in.0" not in trace and f"{layer}.in.0" not in trace:
        derived = DerivedInputs(trace, checkpoint=checkpoint)
    args, kwargs = recorded_inputs(trace, layer, derived)
    with torch.no_grad():
        return module(*args, **kwargs)


def replay_comfy_step(trace, *, comfy_root: str | None, checkpoint: str | None) -> dict:
    """The recorded denoiser evaluation re-run whole in ComfyUI from its inputs file: {tensor name: tensor}."""
    from h3direct.traces.inputs import load_inputs
    from h3direct.traces.pairing import compute_of
    from oracle.comfy_env import open_comfy
    from oracle.record import record_dit

    inputs = find_inputs(trace)
    if inputs is None:
        raise H3Error("no inputs file pairs with this trace: a whole-step replay needs it", path=trace.path)
    env = open_comfy(comfy_root, device="cpu", compute_dtype=compute_of(trace.manifest),
                     attention=_attention_name(trace))
    tensors, _ = record_dit(env, find_checkpoint(trace, checkpoint), load_inputs(inputs),
                            detail=str(trace.manifest.get("trace_detail", "full")))
    return tensors


def tensor_names(trace, layer: str) -> list[str]:
    """Recorded tensor(s) a --layer argument names: a recorded tensor's name (an output, an input `<module>.in.N`,
    an attention output `<...>.out_proj.in`, an explicit name), itself; else a module path, its outputs
    `<layer>.out` / `.out.N`. A module path is never a recorded name: no recorded name lacks its suffix."""
    if layer in trace:
        return [layer]
    return [name for name, _ in recorded_outputs(trace, layer)]


def module_of(name: str) -> str | None:
    """The ComfyUI module whose call produced a recorded tensor, None for in-module sites (rope_q, out_proj.in)."""
    m = re.match(r"^(.*?)\.out(\.\d+)?$", name)
    return m.group(1) if m else None


def replay_direct(trace, layer: str, *, checkpoint: str | None = None, attention="sdpa",
                  device: str = "cpu", derived: DerivedInputs | None = None) -> list[tuple[str, Any, str]]:
    """Re-run `layer` with h3direct from the recorded inputs: [(tensor name, output, site kind)].

    Uses the teacher-forced sites of `h3direct.traces.replay` (the parity gate's own): the h3direct layer is fed
    ComfyUI's recorded inputs, narrowed back to the dtype ComfyUI produced, or derived like the gate derives them.
    """
    import torch

    names = tensor_names(trace, layer)
    derived = derived or DerivedInputs(trace, checkpoint=checkpoint, attention=attention, device=device)
    out = []
    for name in names:
        site = derived.site(name)
        with torch.no_grad():
            out.append((name, site.run(), site.kind))
    return out


def as_list(out: Any) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]
