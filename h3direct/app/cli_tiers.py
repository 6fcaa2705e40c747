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

    try:
        measured = json.loads(args.frontier.read_text())
        if not isinstance(measured, dict):
            raise ValueError("not a JSON object")
        frontier, tiers = choice.choose_all(measured)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--frontier {args.frontier}: not a frontier's measurements ({exc})") from None
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"--frontier {args.frontier}: not a frontier's measurements (no {exc})") from None
    paths = report.write(frontier, tiers, args.out)
    if args.install:
        print(f"installed: {install(paths['tiers'])}")
    print(", ".join(f"{k}: {v}" for k, v in paths.items()))
    return 0
