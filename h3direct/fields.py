"""Typed fields declared once: each request or option field carries its help, its choices and its rule, and the
command line, the HTTP schema, the environment variables read at startup and the validation are all made from that
one declaration (`field(default, help, choices=..., rule=..., expect=...)`).

Validation is `check(obj)`, called by the dataclass's own `__post_init__`: a value of the wrong type, outside its
choices or against its rule is a `RequestError` naming the field. `parse_env` turns an environment variable's text
into a field's type with one boolean rule for every switch (1/0, true/false, yes/no, on/off).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from h3direct.errors import RequestError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Spec:
    help: str
    choices: tuple | None = None
    rule: Callable[[Any], bool] | None = None
    expect: str = ""  # what the rule asks for, in words ("a positive number")
    env: bool = False  # an environment variable (H3_<PREFIX>_<NAME>) sets its default at the edge
    per_request: bool = True  # False: fixed when the models load (a server flag, not a request field)
    kind: Any = None  # the value type when the default does not show it (None defaults): bool, int, float, str,
    # or "file" / "files" (a file / a list of files named by the request)
    fails_as: str = "value"  # the RequestError kind when the rule fails ("type": a malformed value, HTTP 422)
    bare: Any = None  # the value of its flag given without one (`--fp8-linear` = stream)


def field(default, help: str, *, choices=None, rule=None, expect: str = "", env: bool = False,
          per_request: bool = True, kind=None, fails_as: str = "value", bare=None):
    """A dataclass field with its `Spec` (help, choices, rule)."""
    spec = Spec(help, tuple(choices) if choices is not None else None, rule, expect, env, per_request, kind,
                fails_as, bare)
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"spec": spec})
    return dataclasses.field(default=default, metadata={"spec": spec})


def spec_of(f: dataclasses.Field) -> Spec | None:
    return f.metadata.get("spec")


def kind_of(default, spec: Spec | None = None):
    """The value type a field takes: its spec's `kind`, else its default's type (bool, int, float or str)."""
    if spec is not None and spec.kind is not None:
        return spec.kind
    return next(t for t in (bool, int, float, str) if isinstance(default, t))


def positive(v) -> bool:
    return math.isfinite(v) and v > 0


WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def problem(spec: Spec, want, value) -> tuple[str, str] | None:
    """(kind, what is wrong) of a scalar `value` for a field of type `want` with `spec`, or None when it is fine:
    kind 'type' or 'choice' (HTTP 422) or 'value' (HTTP 400); the words follow the value ("is not ...")."""
    ok = (isinstance(value, bool) if want is bool else
          isinstance(value, int) and not isinstance(value, bool) if want is int else
          isinstance(value, int | float) and not isinstance(value, bool) if want is float else isinstance(value, want))
    if not ok:
        return "type", f"must be {WORDS[want]}"
    if want is float and not math.isfinite(value):
        return "value", "is not a finite number"
    if spec.choices is not None and value not in spec.choices:
        return "choice", f"is not supported; use one of {', '.join(map(str, spec.choices))}"
    if spec.rule is not None and not spec.rule(value):
        return spec.fails_as, f"must be {spec.expect}"
    return None


def shown(value, limit: int = 60) -> str:
    """A value as a message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def check(obj, prefix: str = "") -> None:
    """RequestError for the first scalar field of dataclass `obj` whose value breaks its spec (named prefix + field;
    a None value of a field whose default is None passes)."""
    for f in dataclasses.fields(obj):
        spec = spec_of(f)
        if spec is None:
            continue
        want = kind_of(f.default, spec)
        value = getattr(obj, f.name)
        if want in ("file", "files") or (value is None and f.default is None):
            continue
        bad = problem(spec, want, value)
        if bad is not None:
            raise RequestError(prefix + f.name, f" {shown(value)} {bad[1]}", kind=bad[0])


def parse_env(name: str, raw: str, want: type, spec: Spec):
    """The value of environment variable `name` for a field of type `want`; a bad one is one line naming it."""
    from h3direct.errors import ConfigError

    text = raw.strip()
    try:
        if want is bool:
            if text.lower() not in TRUE + FALSE:
                raise ValueError
            value = text.lower() in TRUE
        else:
            value = want(text)
    except ValueError:
        words = {**WORDS, bool: "1/0, true/false, yes/no or on/off"}
        raise ConfigError(f"{name}={raw!r}: must be {words[want]}") from None
    bad = problem(spec, want, value)
    if bad is not None:
        raise ConfigError(f"{name}={raw!r}: {bad[1]}")
    return value
