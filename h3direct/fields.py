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


def field(default, help: str, *, choices=None, rule=None, expect: str = "", env: bool = False,
          per_request: bool = True):
    """A dataclass field with its `Spec` (help, choices, rule)."""
    spec = Spec(help, tuple(choices) if choices is not None else None, rule, expect, env, per_request)
    return dataclasses.field(default=default, metadata={"spec": spec})


def spec_of(f: dataclasses.Field) -> Spec | None:
    return f.metadata.get("spec")


def kind_of(default) -> type:
    """The value type a field takes, from its default: bool, int, float or str."""
    return next(t for t in (bool, int, float, str) if isinstance(default, t))


def positive(v) -> bool:
    return math.isfinite(v) and v > 0


def problem(spec: Spec, want: type, value) -> tuple[str, str] | None:
    """(kind, what is wrong) of `value` for a field of type `want` with `spec`, or None when it is fine."""
    ok = (isinstance(value, bool) if want is bool else
          isinstance(value, int) and not isinstance(value, bool) if want is int else
          isinstance(value, int | float) and not isinstance(value, bool) if want is float else isinstance(value, want))
    if not ok:
        return "choice", f"must be {'an integer' if want is int else 'a number' if want is float else want.__name__}"
    if want is float and not math.isfinite(value):
        return "value", "is not a finite number"
    if spec.choices is not None and value not in spec.choices:
        return "choice", f"is not one of {', '.join(map(str, spec.choices))}"
    if spec.rule is not None and not spec.rule(value):
        return "value", f"expected {spec.expect}"
    return None


def check(obj, prefix: str = "") -> None:
    """RequestError for the first field of dataclass `obj` whose value breaks its spec (its name: prefix + field)."""
    for f in dataclasses.fields(obj):
        spec = spec_of(f)
        if spec is None:
            continue
        value = getattr(obj, f.name)
        bad = problem(spec, kind_of(f.default), value)
        if bad is not None:
            raise RequestError(prefix + f.name, f" {value!r}: {bad[1]}", kind=bad[0])


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
        words = {bool: "1/0, true/false, yes/no or on/off", int: "an integer", float: "a number", str: "text"}
        raise ConfigError(f"{name}={raw!r}: expected {words[want]}") from None
    bad = problem(spec, want, value)
    if bad is not None:
        raise ConfigError(f"{name}={raw!r}: {bad[1]}")
    return value
