"""`h3direct choose-tiers`: the tiers chosen again from a frontier's measurements, with its plot and report.

    h3direct choose-tiers --frontier frontier.json --out DIR [--install]

The frontier's measurements (`frontier.json` as `python -m benchmarks.frontier` writes it: every candidate's speed and
per-case quality, ComfyUI's) are chosen from by the tiers of `app.tiers.TIERS` (`app.frontier.choice`); DIR gets
frontier.json, tiers.json, frontier.png and report.html; `--install` copies the tiers file to where `--tier` looks
by default. Nothing is measured: the same measurements give the same tiers.
"""

from __future__ import annotations

import json
from pathlib import Path

from h3direct.errors import ConfigError


def add_arguments(p) -> None:
    p.add_argument("--frontier", required=True, type=Path, help="a frontier.json (python -m benchmarks.frontier)")
    p.add_argument("--out", required=True, type=Path, help="where frontier.json, tiers.json, the plot and report go")
    p.add_argument("--install", action="store_true", help="also copy tiers.json to the runtime's default tiers file")


def run(args) -> int:
    from h3direct.app.frontier import choice, report
    from h3direct.app.tiers import install

    frontier = measurements(args.frontier)
    frontier, tiers = choice.choose_all(frontier)
    paths = report.write(frontier, tiers, args.out)
    if args.install:
        print(f"installed: {install(paths['tiers'])}")
    print(", ".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def measurements(path: Path) -> dict:
    """The frontier's measurements in `path`, with what the choice reads (`choice.choose_all`): a one-line
    ConfigError for a file that is not JSON or lacks any of it."""
    try:
        measured = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"--frontier {path}: not a frontier's measurements (not JSON: {exc})") from None
    cases = measured.get("made", {}).get("cases") if isinstance(measured, dict) else None
    missing = ["made.cases (a list)"] if not isinstance(cases, list) else []
    for key in ("machine", "candidates", "quality"):
        if not isinstance(measured, dict) or not isinstance(measured.get(key), dict):
            missing.append(f"{key} (an object)")
    if not missing:
        missing = [f"quality.{c}" for c in cases if c not in measured["quality"]]
    if missing:
        raise ConfigError(f"--frontier {path}: not a frontier's measurements (no {', '.join(missing)})")
    return measured
