"""`python -m oracle COMMAND`: record traces with a real ComfyUI, replay one layer, inspect traces.

Subcommand modules expose `add_arguments(parser)` and `run(args) -> int`; `H3Error` becomes one stderr line, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from h3direct.errors import H3Error

COMMANDS: dict[str, tuple[str, str]] = {
    "record": ("oracle.record", "run one traced ComfyUI denoiser evaluation from an inputs file"),
    "record-vae": (
        "oracle.record_vae",
        "trace ComfyUI's H3 video/audio VAE decode/encode on the cases of an inputs file",
    ),
    "record-generate": (
        "oracle.record_generate",
        "record a short ComfyUI H3 generation (per-step sampler latents, sigmas, final latents)",
    ),
    "diff": ("oracle.diff", "compare two traces key by key (rel-L2, max-abs, SQNR)"),
    "replay": ("oracle.replay", "re-run one recorded layer from its recorded inputs (ComfyUI and/or h3direct)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m oracle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:  # a subcommand not built yet
            if exc.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"oracle: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except H3Error as exc:
        print(f"oracle {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("oracle: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
