"""One pytest run of the gate as a whole: its report, the cases it ran and found, its judgement and the lines a person
reads at its end.

The plugin (`plugin.py`, loaded in every process of the run) calls in here: in a single process, or in each xdist
worker, the case tests add their results (`ParityRun.collector`, through conftest's `report` fixture) and the
collection what it found; a worker hands its part to the controller when it ends (`worker_part` / `merge`); the
process that ends the run writes the one report, judges the run (`finish`) and prints the summary (`summary`), so a
run under `-n`, started from any folder, reads the same as one without workers.

Each case test tags its pytest report with its case (`CASE_PROPERTY`), so the summary can say that the report and
pytest count the same cases.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

KINDS = ("dit", "vae", "generate")
CASE_PROPERTY = "h3_parity_case"  # a case test's user property: the case it gated


class ParityRun:
    def __init__(self):
        from parity_tests.report import ReportCollector

        self.collector = ReportCollector()
        self.ran: dict[str, set[str]] = defaultdict(set)
        # ({kind: (cases, traces) found}, roots): a low-precision trace and its fp32 twin are one case, two traces
        self.found: tuple[dict[str, tuple[int, int]], list[str]] | None = None
        self.problems: list[str] = []  # traces the gate could not pair with their files, one line each (red)
        self.unused: list[str] = []  # other files of the trace folders that no case uses, one line each
        self.baselines: list[str] = []  # "baseline created: PATH" lines of this run
        self.notes: list[str] = []  # what else the run's end says (the live gate's traces removed)
        self.nothing_compared: str | None = None
        self.report: Path | None = None


def of(config) -> ParityRun:
    """The run's gate state (made on first use)."""
    if not hasattr(config, "_h3_parity"):
        config._h3_parity = ParityRun()
    return config._h3_parity


def active(config) -> bool:
    return hasattr(config, "_h3_parity")


def worker_part(config) -> dict:
    """What an xdist worker hands the controller (plain values: they travel through execnet)."""
    run = of(config)
    return {"rows": run.collector.rows, "cases": run.collector.cases, "ran": {k: sorted(v) for k, v in run.ran.items()},
            "found": run.found, "problems": run.problems, "unused": run.unused, "baselines": run.baselines,
            "notes": run.notes}


def merge(config, part: dict) -> None:
    """A worker's part into the controller's run: every worker collects the same cases, so any worker's `found` and
    `problems` are the run's."""
    run = of(config)
    run.collector.merge(part["rows"], part["cases"])
    for kind, ids in part["ran"].items():
        run.ran[kind].update(ids)
    if part["found"] is not None:
        run.found = (dict(part["found"][0]), list(part["found"][1]))
    run.problems = run.problems or list(part["problems"])
    run.unused = run.unused or list(part["unused"])
    run.notes += [n for n in part["notes"] if n not in run.notes]
    run.baselines += [b for b in part["baselines"] if b not in run.baselines]


def finish(session, report_dir: Path, attention) -> None:
    """The process that ends the run: write the report, and fail a run whose approximate kernels were compared
    nowhere (`attention`: the run's AttentionOptions)."""
    import pytest

    run = of(session.config)
    if run.collector.cases:
        run.report = run.collector.write(report_dir)
    device = session.config.getoption("--device")
    line = kernel_compared_nowhere(attention, device, run.collector.cases) if run.collector.cases else None
    if line:
        run.nothing_compared = line
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def kernel_compared_nowhere(attention, device: str, cases: list[dict]) -> str | None:
    """One line when the run's approximate kernels never ran where the gate compared them: every call of the
    attention backend asked for (AttentionOptions) ran its documented fallback, or (on a GPU) every FP8 linear was
    emulated."""
    import torch

    from h3direct.dit.options import BACKEND_OPTIONS, describe
    from parity_tests.results import attention_key

    name = attention_key(attention)
    calls: dict[str, int] = defaultdict(int)
    for c in cases:
        for what, n in ((c.get("attention_calls") or {}).get(name) or {}).items():
            calls[what] += n
    fallback = {w: n for w, n in calls.items() if w.startswith("fallback to ")}
    if fallback and not calls.get("kernel"):
        ways = ", ".join(f"{w} ×{n}" for w, n in fallback.items())
        cls = BACKEND_OPTIONS.get(name)
        strict = (f"; --option {cls.PREFIX}_strict=on makes a fallback an error"
                  if cls is not None and "strict" in {f.name for f in dataclasses.fields(cls)} else "")
        return (f"parity gate: --attention {describe(attention)} ran its fallback in every call ({ways}): its kernel "
                f"was compared nowhere (cases must fit the kernel, e.g. sol_attn: head_dim 128, at least "
                f"sol_min_tokens tokens){strict}")
    fp8: dict[str, int] = defaultdict(int)
    for c in cases:
        for what, n in (c.get("fp8_linear_calls") or {}).items():
            fp8[what] += n
    if fp8 and all(w.startswith("emulated") for w in fp8) and torch.device(device).type == "cuda":
        ways = ", ".join(f"{w} ×{n}" for w, n in fp8.items())
        return f"parity gate: --fp8-linear: every FP8 linear was emulated on the GPU ({ways}): no FP8 GEMM compared"
    return None


def pytest_counts(terminalreporter) -> dict[str, int]:
    """How pytest ended the run's case tests: {passed, failed, skipped} (a test counts once, by its worst phase)."""
    worst: dict[str, str] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for outcome in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            if CASE_PROPERTY not in dict(getattr(rep, "user_properties", ()) or ()):
                continue
            o = "failed" if outcome == "error" else outcome
            if rank[o] >= rank[worst.get(rep.nodeid, "passed")]:
                worst[rep.nodeid] = o
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for o in worst.values():
        counts[o] += 1
    return counts


def summary(config, terminalreporter) -> list[tuple[str, dict]]:
    """The lines that end a gate run: the cases run of those found, the files the gate could not use, the baselines
    this run created, and where the report is with its counts beside pytest's."""
    run = of(config)
    lines: list[tuple[str, dict]] = []
    if run.found is not None:
        found, roots = run.found
        ran = ", ".join(f"{k} {len(run.ran[k])}/{found[k][0]}"
                        + (f" ({found[k][1]} traces)" if found[k][1] != found[k][0] else "") for k in KINDS)
        twins = any(found[k][1] != found[k][0] for k in KINDS)
        lines.append((f"parity cases run (of found): {ran}; roots: {', '.join(roots)}"
                      + ("; a low-precision recording and ComfyUI's fp32 twin of it are one case" if twins else ""),
                      {}))
    for p in run.problems + run.unused:
        lines.append((f"not gated: {p}", {"yellow": True}))
    if run.baselines:
        lines.append((f"{len(run.baselines)} baseline(s) created by this run (each named above): the next run holds "
                      f"its mode to them", {}))
    for n in run.notes:
        lines.append((n, {}))
    if run.nothing_compared:
        lines.append((f"FAILED: {run.nothing_compared}", {"red": True, "bold": True}))
    if getattr(config, "_h3_live_warning", None):
        lines.append((f"WARNING: {config._h3_live_warning}", {"yellow": True}))
    if run.report is not None:
        cases = run.collector.cases
        passed = sum(bool(c["passed"]) for c in cases)
        counts = pytest_counts(terminalreporter)
        agree = counts["passed"] == passed and counts["failed"] == len(cases) - passed
        n = len({c.get("recording") or c["case"] for c in cases})
        what = (f"{n} case{'s' if n != 1 else ''}, {len(cases)} gated row{'s' if len(cases) != 1 else ''} (a row: one "
                f"trace of a case, teacher-forced or free-running): {passed} passed, {len(cases) - passed} failed"
                + (", as pytest counts them" if agree else "")
                + (f"; {counts['skipped']} skipped" if counts["skipped"] else ""))
        lines.append((f"parity report: {run.report / 'report.html'} ({what})", {"bold": True}))
        if not agree:
            lines.append((f"WARNING: the report and pytest count the case tests differently (pytest: "
                          f"{counts['passed']} passed, {counts['failed']} failed)", {"yellow": True}))
    return lines
