"""User-facing errors: one line that names the file/field/value and suggests a fix.

The CLI prints `h3direct: error: <message>` on stderr and exits with `exit_code` (2 by default).
Anything that is not an `H3Error` is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable


class H3Error(Exception):
    """A problem with the user's input (file, flag, request), reported as one line."""

    exit_code = 2

    def __init__(self, message: str, *, path=None):
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


class CheckpointError(H3Error):
    """A checkpoint file is malformed, truncated, or not what the command expects."""


class ConfigError(H3Error):
    """A configuration value is invalid."""


_NAME = re.compile(r"(?<![-\w])[a-z][a-z0-9_]*\*?")


def flag_name(name: str) -> str:
    """A field as the command line names it: `--ref-images` (a name that is already a flag stays)."""
    return name if name.startswith("-") else "--" + name.replace("_", "-")


class RequestError(H3Error):
    """One bad value of a request or of its options, as one line that names the field: `<field><detail>`.

    `field` is a field name (or several joined by ' × ' or '/'); how it is spelled is the reader's: field names for
    the HTTP API (`str(e)`), flags on the command line (`e.render(flag_name)`). `kind`: 'value' (a value out of range,
    a file that is not what it should be: HTTP 400), 'choice' (not one of the allowed names: HTTP 422) or 'conflict'
    (an output file that exists, or that another job will write: HTTP 409)."""

    def __init__(self, field: str, detail: str, *, kind: str = "value", path=None):
        self.field, self.detail, self.kind = field, detail, kind
        super().__init__(field + detail, path=path)  # as the request (and the HTTP API) names its fields

    def _text(self, spell: Callable[[str], str]) -> str:
        return _NAME.sub(lambda m: spell(m.group(0)), self.field) + self.detail

    def render(self, spell: Callable[[str], str]) -> str:
        text = self._text(spell)
        return f"{self.path}: {text}" if self.path else text


class BackendUnavailable(RequestError):
    """An attention backend (or other optional kernel) is unknown or cannot run here (field: the option that chose
    it, when there is one)."""

    def __init__(self, detail: str, *, field: str = "", kind: str = "value"):
        super().__init__(field, detail, kind=kind)
