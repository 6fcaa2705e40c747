"""Compare two traces key by key (e.g. a fresh `oracle record` against a shared trace)."""

from __future__ import annotations

from dataclasses import dataclass

from h3direct.traces.format import Trace
from h3direct.traces.metrics import Comparison, compare


@dataclass
class TraceDiff:
    rows: list[Comparison]
    only_in_reference: list[str]
    shape_mismatch: list[str]

    @property
    def worst(self) -> Comparison | None:
        return max(self.rows, key=lambda r: r.rel_l2, default=None)


def diff_traces(result: Trace, reference: Trace) -> TraceDiff:
    """Every name of `reference` (aliases resolved) compared with the same name in `result`."""
    rows, missing, bad_shape = [], [], []
    for name in reference.names_in_order():
        if name not in result:
            missing.append(name)
            continue
        got, ref = result.get(name), reference.get(name)
        if tuple(got.shape) != tuple(ref.shape):
            bad_shape.append(f"{name}: {tuple(got.shape)} vs {tuple(ref.shape)}")
            continue
        rows.append(compare(name, got, ref))
    return TraceDiff(rows, missing, bad_shape)
