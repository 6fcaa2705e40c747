"""Call counts that belong to the call that produced them: a scoped collector, never a process-wide table.

    with counting() as calls:
        ... one generation (or one gate case, one benchmark path) ...
    calls.attention   # {"sol_attn": {"kernel": n, "fallback to sage2: short": m}}
    calls.fp8_linear  # {"scaled_mm": n} or {"emulated (cpu)": n}

`count_attention` / `count_fp8_linear` add to the innermost open collector of the calling context (a thread, or an
asyncio task); with none open they count nothing. A nested collector takes its calls for itself (the outer one does
not see them): a one-off call inside a run is not that run's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class CallCounts:
    attention: dict[str, Counter] = field(default_factory=dict)  # backend -> {how it ran: calls}
    fp8_linear: Counter = field(default_factory=Counter)  # GEMM path -> calls

    def add(self, counted: dict) -> None:
        """Add another collector's `as_dict()` to this one (a service summing its finished jobs)."""
        for backend, ways in counted.get("attention", {}).items():
            self.attention.setdefault(backend, Counter()).update(ways)
        self.fp8_linear.update(counted.get("fp8_linear", {}))

    def as_dict(self) -> dict:
        """{"attention": {...}, "fp8_linear": {...}}, only what was counted."""
        out = {}
        attention = {b: dict(c) for b, c in self.attention.items() if c}
        if attention:
            out["attention"] = attention
        if self.fp8_linear:
            out["fp8_linear"] = dict(self.fp8_linear)
        return out


_CURRENT: contextvars.ContextVar[CallCounts | None] = contextvars.ContextVar("h3_call_counts", default=None)


@contextlib.contextmanager
def counting() -> Iterator[CallCounts]:
    counts = CallCounts()
    token = _CURRENT.set(counts)
    try:
        yield counts
    finally:
        _CURRENT.reset(token)


def count_attention(backend: str, what: str) -> None:
    counts = _CURRENT.get()
    if counts is not None:
        counts.attention.setdefault(backend, Counter())[what] += 1


def count_fp8_linear(path: str) -> None:
    counts = _CURRENT.get()
    if counts is not None:
        counts.fp8_linear[path] += 1
