"""Library errors and the CLI exit codes they map to (docs/cli.md).

Every expected failure is a `PgdiagError` carrying a spec code (``E201``), a one-line message that names
the file, sample and column where it can, and an optional hint. The CLI prints ``error[CODE] message`` plus
``hint: ...`` and exits with `exit_code`; nothing else in pgdiag turns errors into exit codes.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_GATE = 1
EXIT_USAGE = 2
EXIT_INVALID = 3
EXIT_INTERNAL = 101
EXIT_INTERRUPTED = 130


class PgdiagError(Exception):
    """An expected failure: a spec code, a one-line message and an optional hint."""

    exit_code: int = EXIT_USAGE

    def __init__(self, code: str, message: str, hint: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.hint = hint


class UsageError(PgdiagError):
    """Bad option, missing file, unsupported checkpoint, existing output (exit 2)."""

    exit_code = EXIT_USAGE


class InvalidInputError(PgdiagError):
    """Validation or alignment error in the input data (E1xx-E3xx), or nothing to compare (exit 3)."""

    exit_code = EXIT_INVALID
