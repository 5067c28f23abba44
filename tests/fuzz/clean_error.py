"""The clean-error contract, shared by the defect tests and the fuzz suite.

A bad input ends in one line ``error[CODE] ...`` (plus an optional ``hint: ...`` line), the code's documented
exit code, no traceback, no ``internal error`` (exit 101 is reserved for bugs) and no file left behind.
"""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner, Result

from pgdiag.cli.app import build_app
from pgdiag.errors import Code

ERROR_LINE = re.compile(r"^error\[([EW]\d{3})\] \S.*$")


def run_cli(args: list[str]) -> Result:
    """`pgdiag ARGS` in process, stdout and stderr together in `result.output`.

    The console is 1,000 columns wide: check's verdict line (not an error line) wraps at the terminal width,
    and the temp paths of a test would wrap it at the default 160 columns."""
    return CliRunner().invoke(build_app(), [str(a) for a in args], env={"COLUMNS": "1000"})


def error_code(result: Result, *, check: bool = False) -> str:
    """The code of the one error line of a failed command; AssertionError when the contract is broken.

    `check`: the output of ``pgdiag check``, which lists every rule a file breaks (one line each) and a verdict.
    """
    output = result.output
    assert "Traceback" not in output, output
    assert "internal error" not in output, output
    assert result.exit_code in (2, 3), (result.exit_code, output)
    lines = [line for line in output.splitlines() if line.startswith("error[")]
    assert len(lines) == 1 or (check and lines), output
    assert all(ERROR_LINE.match(line) for line in lines), output
    match = ERROR_LINE.match(lines[0])
    following = [line for line in output.split(lines[0], 1)[1].strip().splitlines() if line not in lines]
    assert all(line.startswith(("hint: ", "check: ")) for line in following), output  # check adds its verdict
    code = match.group(1)
    assert Code(code).exit_code == result.exit_code, (code, result.exit_code)
    return code


def files_under(folder: Path) -> set[Path]:
    """Every file below `folder` (to assert that a refused command wrote nothing)."""
    return {p for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()
