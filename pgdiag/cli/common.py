"""Shared pieces of every pgdiag command: the consoles, errors to exit codes, the JSON object.

Every command is parse -> settings -> one library call -> outcome -> render (its options: `cli.options`; its
files: `cli.outputs`). `execute` runs the body, turns a `PgdiagError` into ``error[CODE] message`` plus a
``hint:`` line and its exit code (docs/cli.md), prints the `--json` object on stdout, and never shows a traceback
for an expected failure (``PGDIAG_TRACEBACK=1`` shows it for internal errors). Results (tables, the verdict) go to
stdout, progress and diagnostics (check findings, errors, files written) to stderr; under `--json` stdout holds
only the JSON and the tables go to stderr.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from pgdiag.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, PgdiagError, UsageError, one_line
from pgdiag.report.report import _jsonable

RESULT_SCHEMA = "pgdiag.result/v1"


@dataclass(frozen=True)
class Screen:
    """Where a command prints: results (its tables and the verdict) on stdout, or on stderr under `--json` so
    stdout holds only the JSON; notes (check findings, progress, the files written) on stderr."""

    results: Console
    notes: Console


def _plain_flags(params: list[click.Parameter]) -> list[click.Parameter]:
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""  # a flag takes no value: no `<bool>` in --help
    return params


class Command(TyperCommand):
    """A Typer command whose flags show no value placeholder in `--help`."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return _plain_flags(super().get_params(ctx))


class Group(TyperGroup):
    """The Typer group of `pgdiag`, with the same plain flags as `Command`."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return _plain_flags(super().get_params(ctx))


def help_text(doc: str | None) -> str:
    """A docstring as `--help` text: paragraphs kept, the line breaks inside a paragraph joined."""
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


class LineConsole(Console):
    """A rich console that never wraps a line of text off a terminal.

    A finding, a verdict, an error or a hint is one line whatever its length when the stream is a pipe or a
    file (``| tail -1`` reads the verdict, ``grep`` a finding): `print` of text (``str`` or `Text`) soft-wraps
    there, so the terminal, not rich, folds it. Tables and other renderables keep the console width.
    """

    def print(self, *objects: Any, soft_wrap: bool | None = None, **options: Any) -> None:
        if soft_wrap is None and not self.is_terminal and all(isinstance(o, (str, Text)) for o in objects):
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **options)


def make_console(*, quiet: bool = False, width: int | None = None, stdout: bool = False) -> Console:
    """The stderr console (stdout with `stdout`); honours NO_COLOR / FORCE_COLOR / COLUMNS / TERMINAL_WIDTH
    through rich.

    Emoji codes are off (a label such as ``run_a:new:`` stays text); user strings are printed escaped or with
    markup off. `width` fixes the width (tests).

    Off a terminal (CI logs, pipes) rich would wrap tables at 80 columns and truncate metric names; there the
    width is 160 unless COLUMNS or TERMINAL_WIDTH says otherwise.
    """
    sized = os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH")
    stream = sys.stdout if stdout else sys.stderr
    if width is None and not stream.isatty() and not sized:
        width = 160
    return LineConsole(stderr=not stdout, quiet=quiet, highlight=False, emoji=False, width=width)


@contextmanager
def step_progress(console: Console, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A transient bar of the steps read, `progress(steps_done, n_steps)`, on a terminal only (None in pipes,
    CI logs and under -q, where a bar would only add lines)."""
    if not console.is_terminal or console.quiet:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn(what),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} steps"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        tasks: list[Any] = []  # made at the first call, when the number of steps is known

        def update(done: int, total: int) -> None:
            if not tasks:
                tasks.append(bar.add_task(what, total=total))
            bar.update(tasks[0], completed=done, total=total)

        yield update


def result_object(command: str, **fields: Any) -> dict[str, Any]:
    """A `pgdiag.result/v1` object with every top-level key present."""
    from pgdiag import __version__

    base: dict[str, Any] = {
        "schema": RESULT_SCHEMA,
        "pgdiag": __version__,
        "command": command,
        "argv": sys.argv[1:],
        "status": "ok",
        "exit_code": EXIT_OK,
        "inputs": {},
        "pairs": [],
        "summary": {},
        "gates": [],
        "checks": [],
        "files": {},
        "timing_s": None,
        "error": None,
    }
    base.update(fields)
    return base


def print_error(console: Console, error: PgdiagError) -> None:
    console.print(f"[bold red]error{escape(f'[{error.code}]')}[/] ", end="", markup=True)
    console.print(one_line(error.message), markup=False, soft_wrap=True)
    if error.hint:
        console.print(f"hint: {one_line(error.hint)}", markup=False, soft_wrap=True)


def environment_error(command: str, error: BaseException) -> PgdiagError | None:
    """The clean error of a failure of the machine rather than of pgdiag: out of memory (E518, also numpy's and
    pyarrow's kinds of `MemoryError`) or a file-system error on a named path (E517); None for anything else.

    A path the command checks before its work gets a precise E516/E517 earlier (`pgdiag.data.paths`); this
    catches what happens mid-command (a disk that fills, a folder whose permissions change, memory that runs out).
    """
    if isinstance(error, MemoryError):
        return UsageError(
            "E518",
            f"out of memory while running pgdiag {command} ({type(error).__name__}: {one_line(str(error)) or 'no detail'})",
            "read fewer steps with --steps (or one run at a time), or use a machine with more memory",
        )
    if isinstance(error, OSError) and error.errno is not None and error.filename is not None:
        import errno as errnos

        hint = {
            errnos.ENOSPC: "free space on that disk, or write elsewhere",
            errnos.EROFS: "write to another folder",
            errnos.EACCES: "fix its permissions, or choose another path",
        }.get(error.errno, "check the path")
        return UsageError("E517", f"{error.filename}: {error.strerror or error}", hint)
    return None


def _failed(command: str, error: PgdiagError) -> dict[str, Any]:
    """The ``error[CODE]`` line and ``hint:`` on stderr, and the result object of a command that failed with it."""
    print_error(make_console(), error)
    return result_object(
        command,
        status="error",
        exit_code=error.exit_code,
        error={"code": error.code, "message": error.message, "hint": error.hint},
    )


def execute(command: str, body: Callable[[Screen], dict[str, Any]], *, json_out: bool, quiet: bool) -> None:
    """Run a command body and exit with its code.

    `body(screen)` returns the result object (from `result_object`) with ``exit_code`` set; expected failures
    are raised as `PgdiagError` and become ``error[CODE]`` lines; Ctrl-C exits 130; anything else is an internal
    error (exit 101) whose traceback is printed only with ``PGDIAG_TRACEBACK=1``.
    """
    screen = Screen(results=make_console(quiet=quiet, stdout=not json_out), notes=make_console(quiet=quiet))
    start = time.perf_counter()
    try:
        result = body(screen)
    except PgdiagError as error:
        result = _failed(command, error)
    except KeyboardInterrupt:
        make_console().print("interrupted", markup=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (MemoryError, OSError) as error:
        expected = environment_error(command, error)
        if expected is None:
            raise
        result = _failed(command, expected)
    except Exception as error:  # an internal error: a bug
        err_console = make_console()
        if os.environ.get("PGDIAG_TRACEBACK") == "1":
            err_console.print(traceback.format_exc(), markup=False)
        err_console.print(
            f"internal error: {type(error).__name__}: {one_line(str(error))} (please report it with PGDIAG_TRACEBACK=1)",
            markup=False,
            soft_wrap=True,
        )
        result = result_object(
            command,
            status="error",
            exit_code=EXIT_INTERNAL,
            error={"code": "INTERNAL", "message": f"{type(error).__name__}: {error}", "hint": None},
        )
    result["timing_s"] = round(time.perf_counter() - start, 4)
    if json_out:
        sys.stdout.write(json.dumps(_jsonable(result)) + "\n")
        sys.stdout.flush()
    raise typer.Exit(int(result["exit_code"]))
