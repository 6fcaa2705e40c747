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


RUN_COMFY = ("record", "record-vae", "record-generate", "replay")  # the commands that run ComfyUI (--comfy-python)


def build_parser() -> argparse.ArgumentParser:
    from oracle import elsewhere

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
        if name in RUN_COMFY:
            elsewhere.add_argument(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"oracle: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        python = _comfy_python(args)
        if python is not None:
            return _in_comfy_environment(args, argv, python)
        return int(importlib.import_module(args._module).run(args) or 0)
    except H3Error as exc:
        print(f"oracle {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("oracle: interrupted", file=sys.stderr)
        return 130


def _comfy_python(args) -> str | None:
    """The other interpreter this command's ComfyUI side runs in (--comfy-python), or None: here."""
    import os

    from oracle import elsewhere

    if args.command not in RUN_COMFY:
        return None
    python = elsewhere.python_of(args)
    if python is None or args.command != "replay":
        return python
    uses_comfy = (args.comfy_root or os.environ.get("H3_COMFY_ROOT")) and not args.no_comfy
    from oracle.request import COMFY_MODES

    return python if uses_comfy and args.mode in COMFY_MODES else None


def _in_comfy_environment(args, argv: list[str], python: str) -> int:
    """Record in ComfyUI's environment; a replay runs its ComfyUI side there and its h3direct side (--direct) here."""
    from oracle import elsewhere

    if args.command != "replay":
        return elsewhere.run(python, argv)
    rc = elsewhere.run(python, [a for a in argv if a != "--direct"])
    if rc == 2 or not args.direct:
        return rc
    ours = int(importlib.import_module(args._module).run(_without_comfy(args)) or 0)
    return max(rc, ours)


def _without_comfy(args):
    args.no_comfy = args.comfy_elsewhere = True
    return args


if __name__ == "__main__":
    raise SystemExit(main())
