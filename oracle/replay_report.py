"""What every `oracle replay` shares, below both the DiT replay (`oracle.replay`, the command) and the VAE and
generation replays (`oracle.replay_ops`): the request at work with its recordings (`Replay`), ComfyUI's side, the
report of re-run tensors against the recording under the request's rule, and the checkpoint a trace was recorded
with."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error
from oracle.comfy_env import ComfyUnavailable
from oracle.request import Figures, ReplayRequest, Rule, Verdict


@dataclass(frozen=True)
class Replay:
    """One request at work: the request, its recordings loaded, and ComfyUI's side as this process runs it."""

    req: ReplayRequest
    trace: object
    twin: object | None
    against: object | None
    comfy_root: str | None  # None: ComfyUI is not run in this process
    elsewhere: bool = False  # ComfyUI's side ran in its own environment (--comfy-python) before this

    def not_run(self) -> str:
        return comfy_not_run(self.req, self.elsewhere)


def comfy_side(r: Replay, fn):
    """ComfyUI's side of a replay, or None (one line said why) where ComfyUI does not import in this Python and
    h3direct's side runs anyway: the command still re-runs its row."""
    try:
        return fn()
    except ComfyUnavailable as exc:
        if not r.req.direct:
            raise
        print(f"[comfy] not run: {exc}")
        return None


def comfy_not_run(req, elsewhere: bool = False) -> str:
    """The line that says why this process re-ran nothing in ComfyUI (`req`: the ReplayRequest; `elsewhere`: its
    ComfyUI side ran in ComfyUI's own environment)."""
    if elsewhere:
        return "[comfy] ran in ComfyUI's own environment (--comfy-python): its lines are above"
    if req.no_comfy:
        return "[comfy] not run: --no-comfy"
    return "[comfy] not run: no --comfy-root (or $H3_COMFY_ROOT) given"


def find_checkpoint(trace, explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise H3Error("checkpoint not found", path=p)
        return p
    from h3direct.traces.pairing import recorded_file

    name = trace.manifest.get("checkpoint")
    if not name:
        raise H3Error("manifest names no checkpoint: pass --checkpoint", path=trace.path)
    found = recorded_file(trace.path, trace.manifest, "checkpoint")
    if found.is_file():
        return found
    oracle_dir = os.environ.get("H3_ORACLE_DIR")
    if oracle_dir and (Path(oracle_dir) / Path(name).name).is_file():
        return Path(oracle_dir) / Path(name).name
    recorded = trace.manifest.get("checkpoint_path")
    raise H3Error(f"checkpoint {name!r} of the manifest not found beside the trace"
                  + (f", at {recorded} (where it was recorded from)" if recorded else "")
                  + " or in $H3_ORACLE_DIR: pass --checkpoint", path=trace.path)


def ratio_refs(names: list[str], trace, *, twin=None, against=None, local: dict | None = None) -> dict:
    """{name: (fp32 reference, ComfyUI's tensor)}: what the ratio rule measures h3direct and ComfyUI against.

    Teacher-forced on a low-precision trace (`local`: h3direct's fp32 evaluation of each layer on the same recorded
    inputs): (that evaluation, the trace's tensor). Otherwise the fp32 reference is the fp32 one of `trace` and `twin`
    (ComfyUI's other recording of the case) and ComfyUI's tensor is the other one, or `against`'s (the recording
    whose own error scales the limit: ComfyUI --use-sage-attention for the class rule)."""
    from h3direct.traces.pairing import compute_of

    if local is not None:
        return {n: (local[n], trace.get(n)) for n in names if n in local}
    low = twin if compute_of(trace.manifest) == "fp32" else trace
    fp32 = trace if low is twin else twin
    comfy = against or low
    if fp32 is None or comfy is None:
        return {}
    return {n: (fp32.get(n), comfy.get(n)) for n in names if n in fp32 and n in comfy}


def judge(label: str, name: str, got, trace, rule: Rule, refs: dict | None = None) -> tuple[bool | None, str]:
    """One re-run tensor against the recording: (verdict, its line). Bitwise equal passes with or without a rule;
    None: not judged (no rule given)."""
    import torch

    from h3direct.traces.metrics import compare, rel_l2

    ref = trace.get(name)
    if tuple(got.shape) != tuple(ref.shape):
        return False, f"[{label}] {name}: shape {tuple(got.shape)} vs recorded {tuple(ref.shape)}"
    got = got.detach().float().cpu()
    c = compare(name, got, ref)
    errs = None
    if refs and name in refs:
        fp32, comfy = refs[name]
        errs = (rel_l2(got, fp32), rel_l2(comfy, fp32))
    extra = f"  vs fp32: ours {errs[0]:.3e}, ComfyUI {errs[1]:.3e}" if errs else ""
    v = rule.judge(Figures(c.rel_l2, identical=torch.equal(got, ref.float()), errs=errs, cos=c.cosine))
    return v.passed, f"[{label}] {c.line()}{extra}" + verdict_text(v)


def verdict_text(v: Verdict) -> str:
    """How a judged line ends: ok or OVER BUDGET with the rule's figure and limit; nothing without a rule."""
    if v.passed is None:
        return ""
    return f"  {'ok' if v.passed else 'OVER BUDGET'} ({v.text})"


def report(label: str, outputs: list[tuple[str, Any]], trace, rule: Rule,
           refs: dict | None = None) -> tuple[bool | None, list[str]]:
    """outputs: [(recorded name, tensor)]; refs: `ratio_refs` for the ratio rule. One line per output; the verdict:
    False when one output fails (or has another shape), None when one is not judged (no rule given, not bitwise
    equal), else True."""
    verdicts, lines = [], []
    for name, g in outputs:
        ok, line = judge(label, name, g, trace, rule, refs)
        verdicts.append(ok)
        lines.append(line)
    if False in verdicts:
        return False, lines
    if None in verdicts or not verdicts and not rule.given:
        return None, lines
    return True, lines
