"""`h3direct` command line: one subcommand per module, each with `add_arguments(parser)` and `run`.

The command line's edge is `h3direct/app/cli*.py`: `cli_generate`, `cli_serve`, `cli_trace`, `cli_decode`,
`cli_footprint` and `cli_tiers` turn their flags (and the `H3_*` environment, read once: `app/env.py`) into typed
objects; the other commands' modules take their flags as keyword arguments (`run(**flags)`), so no argparse
Namespace leaves this package.
Subcommands are imported lazily so `h3direct inspect` never pays for importing the model code.
User errors (`H3Error`) become one line on stderr and a non-zero exit (a `RequestError` names the field as its
flag); everything else is a bug. Before a command runs, the files its flags name are checked (`FILE_CHECKS`):
outputs writable with the right extension, inputs readable (safetensors inputs: their header parses), so a typo
costs no compute. SIGTERM is handled as Ctrl-C: cleanup code runs and no temporary file is left behind (`serve`
has its own).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from h3direct.errors import H3Error, RequestError, flag_name

# command -> [(dest, flag, what)]: "out:.ext" an output file, "dir" an output folder (made if missing), "in" an
# input file, "safetensors" an input whose header must parse. Checked here, before the command's module runs
# anything heavy.
FILE_CHECKS: dict[str, list[tuple[str, str, str]]] = {
    "inspect": [("out", "--out", "dir")],
    "make-checkpoint": [("out", "--output", "out:.safetensors")],
    "decode-latent": [("latent", "LATENT", "safetensors"), ("out", "--output", "out:.mp4")],
    "trace": [("checkpoint", "--checkpoint", "in"), ("inputs", "--inputs", "safetensors"),
              ("out", "--out", "out:.safetensors")],
    "trace-vae": [("weights", "--weights", "safetensors"), ("inputs", "--inputs", "safetensors"),
                  ("config", "--config", "in"), ("out", "--out", "out:.safetensors")],
    "choose-tiers": [("frontier", "--frontier", "in"), ("out", "--out", "dir")],
}

# name -> (module, one-line help); the app's modules (`h3direct.app.cli_*`) take the parsed flags, the others
# keyword arguments
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("h3direct.checkpoint.inspect", "validate a checkpoint header; report its H3 layout and config"),
    "make-checkpoint": ("h3direct.checkpoint.synthetic", "write a seeded synthetic checkpoint in ComfyUI's format"),
    "trace": ("h3direct.app.cli_trace", "one denoiser evaluation from an inputs file, traced per layer"),
    "trace-vae": ("h3direct.traces.trace_vae", "run every VAE case of an inputs file and record a trace"),
    "decode-latent": ("h3direct.app.cli_decode", "decode a video (+ audio) latent file to an mp4"),
    "generate": ("h3direct.app.cli_generate", "generate a clip with stereo audio from a prompt and references"),
    "serve": ("h3direct.app.cli_serve", "serve generations over HTTP with the models kept loaded"),
    "footprint": ("h3direct.app.cli_footprint", "the bytes of weights the hot runtime holds, per weight format"),
    "choose-tiers": ("h3direct.app.cli_tiers", "choose the tiers again from a frontier's measurements"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump): `h3direct CMD: error: … (see h3direct CMD --help)`."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that subcommand's module is imported (fast start)."""
    from h3direct import __version__

    parser = _Parser(prog="h3direct", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"h3direct {__version__}")
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed as one line
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"h3direct: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    previous = None
    try:
        _check_files(args)
        if args.command != "serve":
            previous = _sigterm_as_interrupt()
        module = importlib.import_module(args._module)
        if args._module.startswith("h3direct.app.cli_"):
            return int(module.run(args) or 0)
        flags = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
        return int(module.run(**flags) or 0)
    except RequestError as exc:
        print(f"h3direct {args.command}: error: {exc.render(flag_name)}", file=sys.stderr)
        return exc.exit_code
    except H3Error as exc:
        print(f"h3direct {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("h3direct: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)


def _check_files(args: argparse.Namespace) -> None:
    from h3direct.app.paths import check_input, check_output, check_output_dir

    for dest, flag, what in FILE_CHECKS.get(args.command, []):
        value = getattr(args, dest, None)
        if value is None:
            continue
        if what.startswith("out:"):
            check_output(value, flag, what[4:])
            continue
        if what == "dir":
            check_output_dir(value, flag)
            continue
        check_input(value, flag)
        if what == "safetensors":
            from h3direct.checkpoint.safetensors_header import read_header

            try:
                read_header(value, check=True)
            except H3Error as e:
                raise RequestError(flag, f": not a readable safetensors file "
                                   f"({str(e).removeprefix(str(value) + ': ')})", path=value) from None


def _sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread, so `finally`/`except BaseException` cleanups (temp files)
    run; returns the previous handler (None outside the main thread)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    raise SystemExit(main())
