"""An approximate mode against its own history: its measured quality, recorded per case beside the traces with
pytest-regressions, and every later run held to the drift rule (budgets.py, mode "drift").

What a mode measures (`CaseResult.measured`, name -> `Quantity`), each a rel-L2 error with the rounding scale the
drift rule needs:

- `out.<output>`: a free-running DiT step's outputs (x0) against ComfyUI's fp32 twin; scale: ComfyUI's own
  low-precision error there (1 low-precision path);
- `x0.<stream>`: the same step's x0 against h3direct's exact path on the same device and dtype (2 paths);
- `frames`, `waveform`: a short generation decoded, against the exact path's (`e2e_frames.py`; 2 paths; scale:
  the exact path's own error against its fp32 run).

A baseline is one `.npz` per (device, case, mode): `<trace folder>/baselines/<cpu|cuda>/<case>/<mode>.npz`, or
with `--baselines DIR`, `DIR/<cpu|cuda>/<trace folder>/<case>/<mode>.npz`; traces inside the checkout (its
fixtures) keep theirs in h3direct's cache folder, laid out as under `--baselines` (`default_root()`: never in the
checkout). It is written by pytest-regressions' `ndarrays_regression` the first time the mode runs there (that test
fails once, "baseline created: PATH"), and again under `--force-regen` after an intended change. A later run
compares with it under the drift rule; the report shows baseline and now side by side. Baselines are the machine's
own, like the traces beside them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h3direct.traces.quality import Quantity
from parity_tests.budgets import BudgetTable, Measured, verdict
from parity_tests.results import CaseResult, LayerResult

FOLDER = "baselines"


def slug(label: str) -> str:
    """A mode's label as a file name: `sol_attn (sol_tau=2.5) + fp8_linear (stream)` -> `sol_attn_sol_tau=2.5_...`."""
    return re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9.=+-]", "_", label)).strip("_")


@dataclass(frozen=True)
class Store:
    """Where one run's baselines of one case live."""

    root: Path  # `baselines/` beside the case's traces, or --baselines
    device: str  # cpu | cuda
    case: str  # the case's file stem (beside its traces), or its folder/stem (under --baselines)

    @property
    def folder(self) -> Path:
        return self.root / self.device / self.case

    def path(self, label: str) -> Path:
        return self.folder / f"{slug(label)}.npz"

    def load(self, label: str) -> dict[str, float] | None:
        return read_baseline(self.path(label))

    def modes(self) -> dict[str, dict[str, float]]:
        """Every mode baselined for this case on this device: {label: values}."""
        out = {}
        for p in sorted(self.folder.glob("*.npz")) if self.folder.is_dir() else []:
            values = read_baseline(p)
            if values is not None:
                out[str(values.pop("mode", p.stem))] = values
        return out


def default_root() -> Path:
    """Where baselines go for traces inside the checkout (its fixtures): h3direct's cache folder, never the checkout."""
    from h3direct.app.paths import cache_root

    return cache_root() / FOLDER


def store_for(case_dir: Path, case_stem: str, device: str, root: str | Path | None = None) -> Store:
    """The baselines of one case: under `root` (--baselines) when given, else beside the case's traces, or, for
    traces inside the checkout, under `default_root()`."""
    import torch

    from parity_tests.discovery import ROOT

    kind = torch.device(device).type
    inside = Path(case_dir).resolve().is_relative_to(ROOT.resolve())
    if root or inside:
        return Store(Path(root) if root else default_root(), kind, f"{case_dir.name}/{case_stem}")
    return Store(case_dir / FOLDER, kind, case_stem)


def read_baseline(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with np.load(path) as z:
        return {k: (str(z[k]) if z[k].dtype.kind == "U" else float(z[k])) for k in z.files}


def data(label: str, measured: dict[str, Quantity]) -> dict[str, np.ndarray]:
    """What a baseline file holds: the mode's label and each quantity's err, scale and paths."""
    out = {"mode": np.array(label)}
    for name, q in measured.items():
        out[f"{name}.err"] = np.array(q.err, dtype=np.float64)
        out[f"{name}.scale"] = np.array(q.scale, dtype=np.float64)
        out[f"{name}.paths"] = np.array(q.paths, dtype=np.float64)
    return out


def judge(result: CaseResult, store: Store, budgets: BudgetTable, *, regen: bool = False) -> None:
    """Part "drift": one row per measured quantity against the recorded baseline of this mode (none recorded: a
    note, and `record` writes it). regen: the baseline is about to be rewritten, rows are reported, not judged."""
    if not result.measured:
        return
    base = store.load(result.approx)
    if base is None:
        result.notes.append(f"no baseline of {result.approx} for this case on {store.device} yet: this run "
                            f"records it ({store.path(result.approx)}); the next run is held to it")
        return
    b = budgets.lookup(mode="drift", kind="*", compute="*", weights="*", attention="*", twin="*")
    for name, q in result.measured.items():
        before = base.get(f"{name}.err")
        if before is None:
            result.notes.append(f"the baseline has no {name}: rerun with --force-regen to record it")
            continue
        v = verdict(b, Measured(q.err, baseline=before, scale=q.scale, paths=q.paths))
        growth = q.err / before if before > 0 else math.inf
        info = f"baseline {before:.4e} → now {q.err:.4e} (×{growth:.3f}; {store.path(result.approx).name})"
        passed, text = (True, f"regenerating: {v.text}") if regen else (v.passed, v.text)
        replay = _replay(result, store.path(result.approx), f"drift.{name}", b, v.limit)
        result.layers.append(LayerResult(f"drift.{name}", "drift", "free", q.err, _db(q.err),
                                         _no_worst(), passed, text, b.provenance, replay,
                                         (q.err, before), v.error, v.limit, "drift", info))


def _replay(result: CaseResult, baseline: Path, name: str, b, limit: float) -> str:
    """The command that re-measures one drift row against the baseline it was held to (`result.drift_request`: the
    mode's run, a ReplayRequest in drift mode or e2e_frames' FramesReplay)."""
    from parity_tests.results import command

    request = result.drift_request
    if request is None:
        return f"not replayable: this run of {result.approx} names no replay of its measured quantities"
    return command(dataclasses.replace(request, baseline=baseline), name, b, limit)


def record(result: CaseResult, store: Store, ndarrays_regression, *, regen: bool = False) -> str | None:
    """Write the mode's baseline where none is (or rewrite it under --force-regen) with pytest-regressions; returns
    one line saying so ("baseline created: PATH"), None when nothing was written. pytest-regressions' own failure on
    a file it wrote is that line's news, not an error."""
    import pytest

    if not result.measured:
        return None
    path = store.path(result.approx)
    existed = path.is_file()
    if existed and not regen:
        return None
    try:
        ndarrays_regression.check(data(result.approx, result.measured), fullpath=path)
    except pytest.fail.Exception:
        if not path.is_file():
            raise
    else:
        if existed:
            return None  # regenerated to the same values
    return f"baseline {'rewritten' if existed else 'created'}: {path} ({result.approx}, {result.case.id})"


class History:
    """One case's baselines in a pytest run: the store its options name, and whether this run rewrites them."""

    def __init__(self, config, case_dir: Path, case_stem: str, device: str, budgets: BudgetTable):
        from parity_tests.plugin import baselines_dir

        self.store = store_for(case_dir, case_stem, device, baselines_dir(config))
        self.regen = bool(config.getoption("force_regen", False) or config.getoption("regen_all", False))
        self.budgets = budgets

    def judge(self, result: CaseResult) -> None:
        """The drift rows, and the ladder's rows of the modes baselined beside this case."""
        judge(result, self.store, self.budgets, regen=self.regen)
        if not result.ladder:
            return
        comfy = result.ladder["comfy"]
        margins = [r.limit / r.error for r in result.layers if r.part == "drift" and r.error > 0]
        for row in result.ladder["rows"]:
            if row.get("this"):
                row["baseline"] = min(margins, default=None)
        for label, values in self.store.modes().items():
            if label == result.approx:
                continue
            x = {n: values[f"out.{n}.err"] / r for n, r in comfy.items() if f"out.{n}.err" in values and r > 0}
            result.ladder["rows"].append({"mode": f"{label} (its baseline)", "x": x})

    def record(self, result: CaseResult, ndarrays_regression) -> str | None:
        return record(result, self.store, ndarrays_regression, regen=self.regen)


def _db(err: float) -> float:
    return math.inf if err == 0 else -20.0 * math.log10(err)


def _no_worst():
    from h3direct.traces import metrics

    return metrics.MaxAbs(math.nan, (), math.nan, math.nan)
