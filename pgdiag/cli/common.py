"""Shared pieces of every pgdiag command: options, the stderr console, errors to exit codes, the JSON object.

Every command is parse -> one library call -> render. `execute` runs the body, turns a `PgdiagError` into
``error[CODE] message`` plus a ``hint:`` line and its exit code (docs/cli.md), prints the
`--json` object on stdout, and never shows a traceback for an expected failure (``PGDIAG_TRACEBACK=1``
shows it for internal errors). Tables, progress and diagnostics go to stderr so stdout stays clean for ``jq``.
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
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from pgdiag.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, PgdiagError, UsageError, one_line
from pgdiag.report.report import _jsonable

RESULT_SCHEMA = "pgdiag.result/v1"

# Help panels.
INPUTS = "Inputs"
STREAMS = "Streams"
ALIGNMENT = "Alignment"
METRICS = "Metrics"
MODEL = "Model"
PERFORMANCE = "Performance"
THRESHOLDS = "Thresholds"
OUTPUT = "Output"
SAFETY = "Safety"


class KeyStyle(StrEnum):
    pgdiag = "pgdiag"
    fast_llm = "fast-llm"
    verl = "verl"
    trl = "trl"
    liger = "liger"
    miles = "miles"
    pipelinerl = "pipelinerl"


RunArg = Annotated[
    str,
    typer.Argument(help="A run directory, a directory of Parquet files, a .parquet file, or a quoted glob."),
]
StepsOpt = Annotated[
    str | None,
    typer.Option(
        "--steps", help="Steps to read: N, A-B (inclusive), comma lists, or 'last'.", rich_help_panel=INPUTS
    ),
]
RunNameOpt = Annotated[
    str | None, typer.Option("--run", help="Keep only rows of this run label.", rich_help_panel=INPUTS)
]
LabelOpt = Annotated[
    str | None,
    typer.Option("--label", help="Override the run label shown in reports.", rich_help_panel=INPUTS),
]
AttachOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--attach", help="Attach a recompute output directory (repeatable).", rich_help_panel=INPUTS
    ),
]
IgnoreOpt = Annotated[
    list[str] | None,
    typer.Option("--ignore", help="Silence a check code, e.g. W217 (repeatable).", rich_help_panel=ALIGNMENT),
]
StrictOpt = Annotated[
    bool, typer.Option("--strict/--no-strict", help="Warnings exit 1.", rich_help_panel=ALIGNMENT)
]
MaxExamplesOpt = Annotated[
    int,
    typer.Option(
        "--max-examples", min=1, help="Locations listed per check message.", rich_help_panel=ALIGNMENT
    ),
]
FailOnOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-on",
        help="Gate: exit 1 when EXPR holds, e.g. 'policy/clip_frac_binding>0.2'.",
        rich_help_panel=THRESHOLDS,
    ),
]
WarnOnOpt = Annotated[
    list[str] | None,
    typer.Option("--warn-on", help="Gate: print a warning when EXPR holds.", rich_help_panel=THRESHOLDS),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="Threshold set: recommended, nemo, verl, slime, deterministic, exact.",
        rich_help_panel=THRESHOLDS,
    ),
]
ExitZeroOpt = Annotated[
    bool,
    typer.Option("--exit-zero", help="Exit 0 when a gate fails (2 and 3 stay).", rich_help_panel=THRESHOLDS),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the result object as JSON on stdout.", rich_help_panel=OUTPUT)
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", help="Write the report: a directory or a .parquet file name.", rich_help_panel=OUTPUT
    ),
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace existing output files.", rich_help_panel=OUTPUT)
]
ToTensorboardOpt = Annotated[
    Path | None,
    typer.Option(
        "--to-tensorboard",
        help="Write the per-step scalars as TensorBoard events in this directory.",
        rich_help_panel=OUTPUT,
    ),
]
ToWandbOpt = Annotated[
    str | None,
    typer.Option(
        "--to-wandb",
        metavar="PROJECT",
        help="Log the per-step scalars as a W&B run of this project (offline unless WANDB_MODE is set).",
        rich_help_panel=OUTPUT,
    ),
]
WandbDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--wandb-dir",
        help="Where --to-wandb writes its wandb/ folder [default: beside the --out report, else here].",
        rich_help_panel=OUTPUT,
    ),
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="No tables or progress on stderr.", rich_help_panel=OUTPUT)
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="More detail on stderr.", rich_help_panel=OUTPUT)
]


def wandb_directory(wandb_dir: Path | None, out: Path | None) -> Path:
    """The folder that gets `wandb/`: --wandb-dir, else the folder of the --out report, else the current one."""
    if wandb_dir is not None:
        return wandb_dir
    if out is not None:
        return out.parent if out.suffix == ".parquet" else out
    return Path.cwd()


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


def make_console(*, quiet: bool = False, width: int | None = None) -> Console:
    """The stderr console; honours NO_COLOR / FORCE_COLOR / COLUMNS / TERMINAL_WIDTH through rich.

    Emoji codes are off (a label such as ``run_a:new:`` stays text); user strings are printed escaped or with
    markup off. `width` fixes the width (tests).

    Off a terminal (CI logs, pipes) rich would wrap tables at 80 columns and truncate metric names; there the
    width is 160 unless COLUMNS or TERMINAL_WIDTH says otherwise.
    """
    sized = os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH")
    if width is None and not sys.stderr.isatty() and not sized:
        width = 160
    return LineConsole(stderr=True, quiet=quiet, highlight=False, emoji=False, width=width)


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


def execute(command: str, body: Callable[[Console], dict[str, Any]], *, json_out: bool, quiet: bool) -> None:
    """Run a command body and exit with its code.

    `body(console)` returns the result object (from `result_object`) with ``exit_code`` set; expected failures
    are raised as `PgdiagError` and become ``error[CODE]`` lines; Ctrl-C exits 130; anything else is an internal
    error (exit 101) whose traceback is printed only with ``PGDIAG_TRACEBACK=1``.
    """
    console = make_console(quiet=quiet)
    start = time.perf_counter()
    try:
        result = body(console)
    except PgdiagError as error:
        print_error(make_console(), error)
        result = result_object(
            command,
            status="error",
            exit_code=error.exit_code,
            error={"code": error.code, "message": error.message, "hint": error.hint},
        )
    except KeyboardInterrupt:
        make_console().print("interrupted", markup=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (MemoryError, OSError) as error:
        expected = environment_error(command, error)
        if expected is None:
            raise
        print_error(make_console(), expected)
        result = result_object(
            command,
            status="error",
            exit_code=expected.exit_code,
            error={"code": expected.code, "message": expected.message, "hint": expected.hint},
        )
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


def list_option(values: list[Any] | None) -> tuple[Any, ...]:
    """A repeatable option's values as a tuple (Typer gives None when absent)."""
    return tuple(values or ())


def gate_settings(
    fail_on: list[str] | None, warn_on: list[str] | None, profile: str | None, strict: bool, exit_zero: bool
) -> Any:
    """The `report.gates.GateSettings` of the gate options every reporting command shares."""
    from pgdiag.report.gates import GateSettings

    return GateSettings(
        fail_on=tuple(list_option(fail_on)),
        warn_on=tuple(list_option(warn_on)),
        profile=profile,
        strict=strict,
        exit_zero=exit_zero,
    )


def check_settings(ignore: list[str] | None, max_examples: int) -> Any:
    """The `data.validate.CheckSettings` of `--ignore` and `--max-examples`."""
    from pgdiag.data.validate import CheckSettings

    return CheckSettings(ignore=tuple(list_option(ignore)), max_examples=max_examples)


def check_report_outputs(
    kind: str, out: Path | None, plot: Path | None, *, overwrite: bool, html: Path | None = None
) -> None:
    """Refuse an existing `kind` report (`--out`), figure (`--plot`) or page (`--html`) before any work: E502
    unless `overwrite`, or a file standing where a directory must be (a directory where the page must be)."""
    from pgdiag.data.writing import check_destination
    from pgdiag.report.report import report_files

    if out is not None:
        planned = report_files(out, kind, worst=False)
        check_destination(planned.report.parent, [planned.report, planned.json], overwrite=overwrite)
    if plot is not None:
        check_destination(plot.parent, [plot], overwrite=overwrite, hint="--plot takes a file name")
    if html is not None:
        from pgdiag.report.html import check_html_path

        check_html_path(html, overwrite=overwrite)


def write_report_outputs(
    console: Console,
    report: Any,
    result: dict[str, Any],
    *,
    out: Path | None,
    plot: Path | None,
    draw: Callable[[Any], Any],
    overwrite: bool,
    html: Path | None = None,
    verdict: Any = None,
) -> None:
    """Write `draw(report)` to `plot`, the one-file page of `report` with `verdict` on top to `html`, and
    `report` to `out` (each when given; the report last, so its JSON lists every file), listing them in
    `result["files"]`."""
    if plot is not None:
        from pgdiag.report.plots import save_figure

        path = save_figure(draw(report), plot)
        result.setdefault("files", {})["plots"] = [str(path)]
        console.print(f"plot written to {path}", markup=False)
    if html is not None:
        from pgdiag.report.html import verdict_arguments, write_html
        from pgdiag.report.plots import build_figures

        page_verdict = verdict_arguments(verdict or {})  # its findings also mark the plots and tables
        page = write_html(
            report,
            html,
            overwrite=overwrite,
            plot_set=build_figures(report, marks=page_verdict["marks"]),
            argv=result.get("argv"),
            **page_verdict,
        )
        result.setdefault("files", {})["html"] = str(page)
        console.print(f"html written to {page}", markup=False)
    if out is not None:
        files = report.write(out, overwrite=overwrite, result=result)
        result["files"] = {"report": str(files.report), "json": str(files.json), **result.get("files", {})}
        console.print(f"report written to {files.report}", markup=False)
