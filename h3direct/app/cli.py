"""`h3direct` command line: one subcommand per module, each with `add_arguments(parser)` and `run(args) -> int`.

Subcommands are imported lazily so `h3direct inspect` never pays for importing the model code.
User errors (`H3Error`) become one line on stderr and a non-zero exit; everything else is a bug.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from h3direct.errors import H3Error

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("h3direct.checkpoint.inspect", "validate a checkpoint header; report its H3 layout and config"),
    "make-checkpoint": ("h3direct.checkpoint.synthetic", "write a seeded synthetic checkpoint in ComfyUI's format"),
    "trace": ("h3direct.traces.trace_dit", "one denoiser evaluation from an inputs file, traced per layer"),
    "trace-vae": ("h3direct.traces.trace_vae", "run every VAE case of an inputs file and record a trace"),
    "decode-latent": ("h3direct.vae.decode_latent", "decode a video (+ audio) latent file to an mp4"),
    "generate": ("h3direct.app.generate", "generate a clip with stereo audio from a prompt and references"),
    "serve": ("h3direct.app.serve", "serve generations over HTTP with the models kept loaded"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump): `h3direct CMD: error: … (see h3direct CMD --help)`."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that subcommand's module is imported (fast start)."""
    parser = _Parser(prog="h3direct", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if only is not None and name != only:
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:  # a subcommand whose module is not built yet
            if exc.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"h3direct: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except H3Error as exc:
        print(f"h3direct {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("h3direct: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
