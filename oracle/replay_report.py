"""What every `oracle replay` shares, below both the DiT replay (`oracle.replay`, the command) and the VAE and
generation replays (`oracle.replay_ops`): the rule a re-run is judged by, the report of re-run tensors against the
recording, and the checkpoint a trace was recorded with."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3direct.errors import H3Error


@dataclass(frozen=True)
class Rule:
    budget: float | None = None
    ratio: float | None = None
    floor: float = 0.0

    def describe(self) -> str:
        if self.ratio is not None:
            return f"err vs fp32 ≤ {self.ratio:g}×ComfyUI's + {self.floor:g}"
        if self.budget is not None:
            return f"rel_l2 ≤ {self.budget:g}"
        return "no rule given"

    def judge(self, rel: float, local: tuple[float, float] | None) -> bool | None:
        """None: nothing to judge by."""
        if self.ratio is not None and local is not None:
            return local[0] <= self.ratio * local[1] + self.floor
        if self.budget is not None:
            return rel <= self.budget
        return None


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


def report(label: str, outputs: list[tuple[str, Any]], trace, rule: Rule,
           local: dict[str, Any] | None = None) -> tuple[bool | None, list[str]]:
    """outputs: [(recorded name, tensor)]; local: {name: fp32 evaluation on the same inputs} for the ratio rule.
    One line per output; the verdict: False when one output fails (or has another shape), None when one is not
    judged (no rule given, not bitwise equal), else True (bitwise equal passes with or without a rule)."""
    import torch

    from h3direct.traces.metrics import compare, rel_l2

    verdicts: list[bool | None] = []
    lines = []
    for name, g in outputs:
        ref = trace.get(name)
        if tuple(g.shape) != tuple(ref.shape):
            verdicts.append(False)
            lines.append(f"[{label}] {name}: shape {tuple(g.shape)} vs recorded {tuple(ref.shape)}")
            continue
        c = compare(name, g, ref)
        errs = None
        if local and name in local:
            errs = (rel_l2(g, local[name]), rel_l2(ref, local[name]))
        identical = torch.equal(g.float().cpu(), ref.float())
        passed = True if identical else rule.judge(c.rel_l2, errs)
        extra = f"  vs fp32: ours {errs[0]:.3e}, ComfyUI {errs[1]:.3e}" if errs else ""
        verdicts.append(passed)
        if passed is None:
            lines.append(f"[{label}] {c.line()}{extra}")
            continue
        lines.append(f"[{label}] {c.line()}{extra}  {'ok' if passed else 'OVER BUDGET'} ({rule.describe()})")
    if False in verdicts:
        return False, lines
    if None in verdicts or not verdicts and rule.budget is None and rule.ratio is None:
        return None, lines
    return True, lines
