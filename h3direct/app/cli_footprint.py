"""`h3direct footprint`: the bytes of weights the hot runtime holds on its device once loaded (text encoder, DiT,
video and audio VAEs), per weight format; exact, from the shapes (`app/footprint.py`); no activations.

    h3direct footprint [--preset full-curve] [--weights bf16|nvfp4] [--json]
"""

from __future__ import annotations

import argparse
import json

from h3direct.app.cli_flags import HelpFormatter

WEIGHTS = ("bf16", "nvfp4")  # = h3direct.app.footprint.WEIGHTS (imported when the command runs, not to list flags)
HELD = "held as on CUDA: DiT compute bf16, video VAE fp16, audio VAE fp32, text encoder as stored"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from h3direct.config import PRESETS

    parser.formatter_class = HelpFormatter
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full-curve",
                        help="the DiT's preset, with the text encoder and VAEs of its size (full*: Qwen3-VL-32B and "
                             "the released VAEs; tiny*, small*: the bundled tiny ones)")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="the DiT's and the text encoder's weight format (default: each, a column each)")
    parser.add_argument("--json", action="store_true", help="one JSON object (bytes) instead of the table")


def run(args: argparse.Namespace) -> int:
    from h3direct.app.footprint import COMPONENTS, of_preset

    formats = [args.weights] if args.weights else list(WEIGHTS)
    table = {w: of_preset(args.preset, w) for w in formats}
    for held in table.values():
        held["total"] = sum(held.values())
    if args.json:
        print(json.dumps({"preset": args.preset, "held": HELD, "bytes": table}))
        return 0
    print(f"weights held by the hot runtime, preset {args.preset} (GiB; exact, from the shapes; {HELD}; "
          "activations not included)")
    print(f"| component | {' | '.join(formats)} |")
    print(f"|---|{'---:|' * len(formats)}")
    for c in (*COMPONENTS, "total"):
        print(f"| {c} | {' | '.join(f'{table[w][c] / 2**30:.2f}' for w in formats)} |")
    return 0
