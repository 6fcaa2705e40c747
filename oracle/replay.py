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
import re
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error
from oracle.replay_report import Rule, find_checkpoint, report

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
                 widen: bool = False):
        from h3direct.dit.loader import load_dit
        from h3direct.dit.model import Conditioning
        from h3direct.traces.evaluate import conditioning_of
        from h3direct.traces.inputs import load_inputs
        from h3direct.traces.pairing import compute_of
        from h3direct.traces.replay import TraceView, sites

        ckpt = find_checkpoint(trace, checkpoint)
        inputs = find_inputs(trace)
        compute = "fp32" if widen else compute_of(trace.manifest)
        self.model = load_dit(ckpt, compute_dtype=compute, nvfp4_mode=trace.manifest.get("nvfp4_mode", "w4a16"),
                              device=device)
        inp = load_inputs(inputs) if inputs else None
        cond = conditioning_of(inp) if inp else Conditioning()
        self.view = TraceView(trace, device, widen=widen)
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
    from h3direct.traces.pairing import pair_inputs

    folder, m = trace.path.parent, trace.manifest
    ckpt = folder / Path(str(m["checkpoint"])).name if m.get("checkpoint") else None
    return pair_inputs(folder, m, trace.path, ckpt if ckpt and ckpt.is_file() else None)[0]


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
    """Recorded tensor(s) a --layer argument names: a tensor name itself, else `<layer>.out` / `.out.N`."""
    if layer in trace and not re.search(r"\.in(\.\d+)?$", layer):
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


def _as_list(out: Any) -> list:
    return list(out) if isinstance(out, list | tuple) else [out]


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
    from h3direct.dit.options import Options, parse_assignments
    from h3direct.traces.format import load_trace

    given = parse_assignments(args.option, only="attention")  # a bad one is one line, before anything loads
    args.attention = Options.from_flat({"attention": args.attention, **given}).attention
    trace = load_trace(args.trace)
    comfy_root = args.comfy_root or os.environ.get("H3_COMFY_ROOT")
    use_comfy = bool(comfy_root) and not args.no_comfy
    if not use_comfy and not args.direct:
        raise H3Error("nothing to replay: pass --comfy-root R (or set H3_COMFY_ROOT) and/or --direct")
    rule = Rule(args.budget, args.ratio, args.floor)
    kind = trace_kind(trace.manifest)
    if kind == "dit":
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


def _run_dit(args, trace, comfy_root: str | None, rule: Rule) -> tuple[dict[str, bool | None], str]:
    from h3direct.traces.pairing import compute_of

    dtype = compute_of(trace.manifest)
    names = tensor_names(trace, args.layer)
    results: dict[str, bool | None] = {}
    module = module_of(names[0])
    whole = names[0].startswith(WHOLE_STEP)
    derived = None  # h3direct's sites: needed for --direct, and for ComfyUI when the module's inputs are not recorded
    if args.direct or (comfy_root and not whole and module is not None and f"{module}.in.0" not in trace):
        derived = DerivedInputs(trace, checkpoint=args.checkpoint, attention=args.attention, device=args.device)
    local = None
    if rule.ratio is not None and dtype != "fp32":  # the fp32 evaluation of each layer on the recorded inputs
        ref32 = DerivedInputs(trace, checkpoint=args.checkpoint, widen=True, device=args.device)
        local = {n: t for n, t, _ in replay_direct(trace, args.layer, derived=ref32)}
    if comfy_root:
        if whole:
            ran = replay_comfy_step(trace, comfy_root=comfy_root, checkpoint=args.checkpoint)
            out = [(n, ran[n]) for n in names if n in ran]
        elif module is None:
            print(f"[comfy] {names[0]} is produced inside a ComfyUI module, not by one: replay its parent "
                  f"({names[0].rsplit('.', 1)[0]}) to re-run it in ComfyUI")
            out = None
        else:
            got = _as_list(replay_comfy(trace, module, comfy_root=comfy_root, checkpoint=args.checkpoint,
                                        derived=derived))
            names_c = names if len(got) == len(names) else [n for n, _ in recorded_outputs(trace, module)]
            out = list(zip(names_c, got, strict=False))
        if out is not None:
            ok, lines = report("comfy", out, trace, rule, local)
            print("\n".join(lines))
            results["comfy"] = ok
    else:
        print("[comfy] not run: no --comfy-root (or $H3_COMFY_ROOT) given")
    if args.direct:
        direct = replay_direct(trace, args.layer, derived=derived)
        ok, lines = report("h3direct", [(n, t) for n, t, _ in direct], trace, rule, local)
        print("\n".join(lines + _kernel_lines(derived, names, args.attention, args.device)))
        results["h3direct"] = ok
    return results, dtype
