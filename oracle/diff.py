"""`python -m oracle diff RESULT REFERENCE`: per-key metrics of two traces; exit 1 when a key exceeds the budget."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result", help="trace to check (.safetensors)")
    parser.add_argument("reference", help="reference trace (.safetensors), e.g. a shared oracle trace")
    parser.add_argument("--budget", type=float, default=1e-6, help="max rel-L2 per key (default 1e-6)")
    parser.add_argument("--all", action="store_true", help="print every key, not only the worst ones")


def run(args: argparse.Namespace) -> int:
    from h3direct.traces.format import load_trace
    from oracle.compare import diff_traces

    d = diff_traces(load_trace(args.result), load_trace(args.reference))
    rows = d.rows if args.all else sorted(d.rows, key=lambda r: r.rel_l2, reverse=True)[:5]
    for r in rows:
        print(r.line())
    for name in d.only_in_reference:
        print(f"{name}: missing from result")
    for line in d.shape_mismatch:
        print(f"shape mismatch {line}")
    worst = d.worst
    over = [r for r in d.rows if not r.rel_l2 <= args.budget]
    print(
        f"{len(d.rows)} keys compared, worst rel_l2 {worst.rel_l2 if worst else 0:.3e} "
        f"({worst.name if worst else '-'}), "
        f"{len(over)} over budget {args.budget:g}, {len(d.only_in_reference)} missing"
    )
    return 1 if over or d.only_in_reference or d.shape_mismatch else 0
