"""`python -m oracle replay`: re-run exactly one recorded layer from its recorded inputs (teacher forcing).

ComfyUI side (`--comfy-root R` or $H3_COMFY_ROOT): the checkpoint named in the manifest is loaded with
`comfy.sd.load_diffusion_model` under the manifest's compute dtype, and the module at the layer's path is called with
the recorded `<layer>.in.N` tensors (cast back to the dtype ComfyUI produced) and non-tensor inputs from the
manifest's `static_inputs`. A trace that records outputs only (the oracle-format contract: inputs are derived from
the previous layer) gets the module's inputs derived exactly as the gate's teacher forcing derives them
(`h3direct.traces.replay`: each site's `args`).
h3direct side (`--direct`): the parity gate's teacher-forced site for that tensor.
`--layer` takes a module path (`blocks.1`, `blocks.1.attn`, `blocks.1.mlp.fc2`) or a recorded tensor name as the
gate prints it (`blocks.1.mlp.fc2.out`, `blocks.1.attn.rope_q`).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="trace .safetensors (any trace the parity gate accepts)")
    parser.add_argument("--layer", required=True, help="module path, e.g. blocks.1.attn or blocks.0.mlp.fc2")
    parser.add_argument("--comfy-root", help="ComfyUI checkout (default: $H3_COMFY_ROOT)")
    parser.add_argument(
        "--checkpoint",
        help="checkpoint file (default: the manifest's, looked up beside the trace and in $H3_ORACLE_DIR)",
    )
    parser.add_argument("--direct", action="store_true", help="re-run the layer with h3direct")
    parser.add_argument("--no-comfy", action="store_true",
                        help="only h3direct (with --direct), even with a ComfyUI root")
    parser.add_argument("--budget", type=float, help="rel-L2 budget (default: parity_tests/budgets.toml)")


def split_call(layer: str) -> tuple[str, str]:
    """'final_layer.norm#1' -> ('final_layer.norm', 'final_layer.norm#1')."""
    return re.sub(r"#\d+$", "", layer), layer


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
    tensor inputs are then derived from the recorded outputs as the gate's teacher forcing does."""

    static = trace.manifest.get("static_inputs") or {}
    args: list[Any] = []
    derived_args = f"{layer}.in.0" not in trace and derived is not None
    if derived_args:
        for i, a in enumerate(derived.args(layer)):
            if a is None:
                found, value = _static_input(static, layer, i)
                if not found:
                    raise H3Error(f"{layer}: non-tensor input {i} is not in the manifest's static_inputs",
                                  path=trace.path)
                a = value
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
    """Module inputs of a trace derived from its recorded tensors by the gate's teacher-forced sites."""

    def __init__(self, trace, *, checkpoint: str | None = None, attention: str = "sdpa", device: str = "cpu"):
        from h3direct.dit.loader import load_dit
        from h3direct.dit.model import Conditioning
        from h3direct.traces.evaluate import conditioning_of
        from h3direct.traces.inputs import load_inputs
        from h3direct.traces.replay import TraceView, sites

        ckpt = find_checkpoint(trace, checkpoint)
        inputs = find_inputs(trace)
        compute = trace.manifest.get("compute_dtype_requested", "fp32")
        self.model = load_dit(ckpt, compute_dtype=compute, nvfp4_mode=trace.manifest.get("nvfp4_mode", "w4a16"),
                              device=device)
        inp = load_inputs(inputs) if inputs else None
        cond = conditioning_of(inp) if inp else Conditioning()
        self.view = TraceView(trace, device)
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
        """The positional inputs of ComfyUI's module `module` (None = a non-tensor argument)."""
        import torch

        name = next((n for n in (f"{module}.out", f"{module}.out.0") if n in self.sites), None)
        if name is None or self.sites[name].args is None:
            raise H3Error(f"cannot derive the inputs of {module!r} from this trace", path=self.trace.path)
        with torch.no_grad():
            return [a.clone() if isinstance(a, torch.Tensor) else a for a in self.site(name).args()]


def _static(value: Any) -> Any:
    if isinstance(value, list):
        return [tuple(v) if isinstance(v, list) else v for v in value]
    return value


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


def find_checkpoint(trace, explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise H3Error("checkpoint not found", path=p)
        return p
    name = trace.manifest.get("checkpoint")
    if not name:
        raise H3Error("manifest names no checkpoint: pass --checkpoint", path=trace.path)
    dirs = [trace.path.parent] + ([Path(os.environ["H3_ORACLE_DIR"])] if os.environ.get("H3_ORACLE_DIR") else [])
    for d in dirs:
        if (d / name).is_file():
            return d / name
    raise H3Error(
        f"checkpoint {name!r} of the manifest not found beside the trace or in $H3_ORACLE_DIR: pass --checkpoint",
        path=trace.path,
    )


def replay_comfy(trace, layer: str, *, comfy_root: str | None = None, checkpoint: str | None = None,
                 derived: DerivedInputs | None = None):
    """The ComfyUI module at `layer` called on the recorded (or derived) inputs; returns its output."""
    import torch

    from oracle.comfy_env import open_comfy

    ckpt = find_checkpoint(trace, checkpoint)
    dtype = trace.manifest.get("compute_dtype_requested", "fp32")
    env = open_comfy(comfy_root, device="cpu", compute_dtype=dtype, attention=_attention_name(trace))
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


def _attention_name(trace) -> str:
    fn = str(trace.manifest.get("attention", "attention_pytorch"))
    return {
        "attention_pytorch": "pytorch",
        "attention_sage": "sage",
        "attention_flash": "flash",
        "attention_split": "split",
        "attention_sub_quad": "sub_quad",
    }.get(fn, "pytorch")


def tensor_names(trace, layer: str) -> list[str]:
    """Recorded tensor(s) a --layer argument names: a tensor name itself, else `<layer>.out` / `.out.N`."""
    if layer in trace and not re.search(r"\.in(\.\d+)?$", layer):
        return [layer]
    return [name for name, _ in recorded_outputs(trace, layer)]


def module_of(name: str) -> str | None:
    """The ComfyUI module whose call produced a recorded tensor, None for in-module sites (rope_q, out_proj.in)."""
    m = re.match(r"^(.*?)\.out(\.\d+)?$", name)
    return m.group(1) if m else None


def replay_direct(trace, layer: str, *, checkpoint: str | None = None, attention: str = "sdpa",
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


def find_inputs(trace) -> Path | None:
    """The inputs file of a trace, paired as the gate pairs it (`discovery.pair_inputs`), or None."""
    from h3direct.traces.discovery import pair_inputs

    folder, m = trace.path.parent, trace.manifest
    ckpt = folder / Path(str(m["checkpoint"])).name if m.get("checkpoint") else None
    return pair_inputs(folder, m, trace.path, ckpt if ckpt and ckpt.is_file() else None)[0]


def budget_for(trace, kind: str, attention: str = "sdpa", budgets_path: str | None = None):
    from h3direct.traces.budgets import load_budgets
    from h3direct.traces.discovery import _compute, _weights_label

    table = load_budgets(budgets_path)
    weights = "bf16"
    try:
        weights = _weights_label(find_checkpoint(trace, None), trace.manifest)
    except H3Error:
        pass
    mode, kind = ("free", "output") if kind == "model" else ("teacher", kind)
    return table.lookup(mode=mode, kind=kind, compute=_compute(trace.manifest), weights=weights, attention=attention)


def _as_list(out: Any) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]


def report(label: str, outputs: list[tuple[str, Any]], trace, budget_of) -> tuple[bool, list[str]]:
    """outputs: [(recorded name, tensor)]; budget_of(name) -> Budget. One line per output."""
    import torch

    from h3direct.traces.budgets import verdict
    from h3direct.traces.metrics import compare

    ok, lines = True, []
    for name, g in outputs:
        ref = trace.get(name)
        if tuple(g.shape) != tuple(ref.shape):
            ok = False
            lines.append(f"[{label}] {name}: shape {tuple(g.shape)} vs recorded {tuple(ref.shape)}")
            continue
        c = compare(name, g, ref)
        b = budget_of(name)
        passed, rule = verdict(b, rel=c.rel_l2, sqnr=c.sqnr_db, identical=torch.equal(g.float().cpu(), ref.float()))
        ok &= passed
        lines.append(f"[{label}] {c.line()}  {'ok' if passed else 'OVER BUDGET'} ({rule})")
    return ok, lines


def run(args: argparse.Namespace) -> int:
    from h3direct.traces.format import load_trace

    trace = load_trace(args.trace)
    dtype = trace.manifest.get("compute_dtype_requested", "fp32")
    names = tensor_names(trace, args.layer)
    comfy_root = args.comfy_root or os.environ.get("H3_COMFY_ROOT")
    use_comfy = bool(comfy_root) and not args.no_comfy
    if not use_comfy and not args.direct:
        raise H3Error("nothing to replay: pass --comfy-root R (or set H3_COMFY_ROOT) and/or --direct")
    results: dict[str, bool] = {}
    kinds: dict[str, str] = {}
    module = module_of(names[0])
    derived = None  # h3direct's sites: needed for --direct, and for ComfyUI when the module's inputs are not recorded
    if args.direct or (use_comfy and module is not None and f"{module}.in.0" not in trace):
        derived = DerivedInputs(trace, checkpoint=args.checkpoint)
    direct = replay_direct(trace, args.layer, checkpoint=args.checkpoint, derived=derived) if args.direct else []
    for name, _, kind in direct:
        kinds[name] = kind

    def budget_of(name):
        if args.budget is not None:
            from h3direct.traces.budgets import Budget

            return Budget(match={}, rel_l2=args.budget, provenance="--budget")
        return budget_for(trace, kinds.get(name) or (derived.sites[name].kind if derived and name in derived.sites
                                                      else "*"))

    if use_comfy:
        if module is None:
            print(f"[comfy] {names[0]} is produced inside a ComfyUI module, not by one: replay its parent "
                  f"({names[0].rsplit('.', 1)[0]}) to re-run it in ComfyUI")
        else:
            out = _as_list(replay_comfy(trace, module, comfy_root=comfy_root, checkpoint=args.checkpoint,
                                        derived=derived))
            if len(out) != len(names):
                names_c = [n for n, _ in recorded_outputs(trace, module)]
            else:
                names_c = names
            ok, lines = report("comfy", list(zip(names_c, out, strict=False)), trace, budget_of)
            print("\n".join(lines))
            results["comfy"] = ok
    else:
        print("[comfy] not run: no --comfy-root (or $H3_COMFY_ROOT) given")
    if args.direct:
        ok, lines = report("h3direct", [(n, t) for n, t, _ in direct], trace, budget_of)
        print("\n".join(lines))
        results["h3direct"] = ok
    drifted = [k for k, v in results.items() if not v]
    print(f"{args.layer} ({dtype}): " + ("all within budget" if not drifted else f"drifted: {', '.join(drifted)}"))
    return 1 if drifted else 0
