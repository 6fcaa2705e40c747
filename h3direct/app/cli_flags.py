"""Command-line flags made from typed fields (`h3direct.fields`): one flag per field, `--` + its name with dashes,
its help, its choices shown (and checked by the field's own rule, not by argparse), no default of its own (None:
not given), so that the edge can tell a given flag from a default and layer flags over the environment, a clip's
provenance and the field defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from h3direct.fields import Spec, kind_of, spec_of

# FFmpeg's log level names (`vae.mp4.FFMPEG_LOGLEVELS` maps them onto PyAV's), here so that the flags need no torch
FFMPEG_LOGLEVELS = ("quiet", "panic", "fatal", "error", "warning", "info", "verbose", "debug")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default after its help, unless there is none to show (None, empty, a plain switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if "%(default)" in text or d is None or d is argparse.SUPPRESS or d is False or d == [] or d == "":
            return text
        return f"{text} (default: %(default)s)"


def add_flag(group, name: str, kind, default: Any, spec: Spec, *, aliases: tuple[str, ...] = (),
             env: str | None = None, metavar: str | None = None) -> None:
    """One flag for field `name`; its default is shown in the help (the flag's own default is None: not given)."""
    shown = default if default not in (None, (), "", []) and not (kind is bool and default is False) else None
    help_ = spec.help + (f" (env {env})" if env else "")
    if shown is not None:
        help_ += f" (default: {shown})"
    flags = ("--" + name.replace("_", "-"), *aliases)
    choices = "{" + ",".join(map(str, spec.choices)) + "}" if spec.choices else None
    if kind is bool:
        group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
    elif kind == "files":
        group.add_argument(*flags, dest=name, action="append", default=None, metavar=metavar or "FILE", help=help_)
    else:
        typ = {int: int, float: float}.get(kind, str)
        bare = {"nargs": "?", "const": spec.bare} if spec.bare is not None else {}  # `--fp8-linear` alone
        group.add_argument(*flags, dest=name, type=typ, default=None, help=help_, **bare,
                           metavar=choices or metavar or {"file": "FILE", int: "N", float: "X"}.get(kind, "TEXT"))


def add_fields(group, cls, names=None, *, aliases: dict | None = None, metavars: dict | None = None,
               env: bool = False) -> None:
    """Flags for the spec'd fields of dataclass `cls` (all, or `names`); `env`: name the H3_ variable of each
    env-backed field in its help."""
    for f in dataclasses.fields(cls):
        spec = spec_of(f)
        if spec is None or (names is not None and f.name not in names):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        add_flag(group, f.name, kind_of(default, spec), default, spec, aliases=(aliases or {}).get(f.name, ()),
                 metavar=(metavars or {}).get(f.name), env=f"H3_{f.name.upper()}" if env and spec.env else None)


def add_options(group) -> None:
    """Flags for the options of `dit.options.Options` under their flat names (`--sol-tau`, `--fused`, ...)."""
    from h3direct.dit.options import flat_options

    for o in flat_options():
        choices = o.spec.choices
        if o.flat == "attention":
            from h3direct.dit.options import BACKENDS

            choices = BACKENDS
        spec = dataclasses.replace(o.spec, choices=choices)
        add_flag(group, o.flat, o.kind, o.default, spec, env=o.env)


def given(args: argparse.Namespace, names) -> dict:
    """{name: value} of the flags among `names` that were given (not None)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def option_names() -> list[str]:
    from h3direct.dit.options import flat_options

    return [o.flat for o in flat_options()]


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if spec_of(f) is not None]
