"""User-facing errors: one line that names the file/field/value and suggests a fix.

The CLI prints `h3direct: error: <message>` on stderr and exits with `exit_code` (2 by default).
Anything that is not an `H3Error` is a bug and keeps its traceback.
"""


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


class BackendUnavailable(H3Error):
    """An attention backend (or other optional kernel) is unknown or cannot run here."""
