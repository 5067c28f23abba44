"""`pgdiag report REPORT`: re-render a saved report (metrics, compare, whatif, drift) without recomputation.

Thin shell over `pgdiag.report.report.load_report` and `pgdiag.report.markdown`: the headline rows as a table on
stderr, `--markdown PATH` (a summary for a CI comment), `--pivot` (the wide table as CSV on stdout), and gates
(`--fail-on`, `--warn-on`, `--profile`) re-evaluated on the stored values. Example::

    pgdiag report /tmp/parity/compare.parquet --fail-on 'k3>1e-3' --markdown /tmp/comment.md
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pgdiag.cli.common import (
    OUTPUT,
    ExitZeroOpt,
    FailOnOpt,
    JsonOpt,
    OverwriteOpt,
    ProfileOpt,
    QuietOpt,
    WarnOnOpt,
    execute,
    list_option,
    result_object,
)


def register(app: typer.Typer) -> None:
    """Add the `report` command to `app`."""
    app.command("report")(report)


def report(
    source: Annotated[str, typer.Argument(help="A report .parquet file, or a directory holding one report.")],
    *,
    markdown: Annotated[
        Path | None,
        typer.Option("--markdown", help="Write a Markdown summary for a CI comment.", rich_help_panel=OUTPUT),
    ] = None,
    pivot: Annotated[
        bool,
        typer.Option(
            "--pivot",
            help="Print the wide table (one column per metric) as CSV on stdout.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    fail_on: FailOnOpt = None,
    warn_on: WarnOnOpt = None,
    profile: ProfileOpt = None,
    exit_zero: ExitZeroOpt = False,
    json_out: JsonOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Re-render a saved report without recomputing it; gates are re-evaluated on its stored values."""

    def body(console: Console) -> dict[str, Any]:
        from rich.table import Table

        from pgdiag.cli.render import format_value, render_gates
        from pgdiag.data.writing import atomic_write, check_destination
        from pgdiag.report.gates import GateSettings, outcome
        from pgdiag.report.markdown import headline_rows, report_markdown
        from pgdiag.report.report import load_report

        if markdown is not None:
            check_destination(
                markdown.parent, [markdown], overwrite=overwrite, hint="--markdown takes a file name"
            )
        loaded = load_report(source)
        gate_settings = GateSettings(
            fail_on=tuple(list_option(fail_on)), warn_on=tuple(list_option(warn_on)), profile=profile,
            exit_zero=exit_zero,
        )  # fmt: skip
        verdict = outcome(loaded, gate_settings)
        gates = [g.__dict__ for g in verdict.gates.gates]
        if not quiet:
            rows = headline_rows(loaded)
            table = Table(title=f"{loaded.kind} report {source}", title_justify="left")
            for header in ("pair", "bucket", "metric", "value"):
                table.add_column(header, justify="right" if header == "value" else "left")
            for pair, bucket, metric, value, unit, _ in rows.iter_rows():
                table.add_row(pair, bucket, metric, format_value(value, unit))
            console.print(table)
            render_gates(console, verdict.gates)
        result = result_object(
            "report",
            status=verdict.status,
            exit_code=verdict.exit_code,
            pairs=loaded.meta.get("pairs", []),
            gates=gates,
            checks=loaded.checks.to_dicts(),
        )
        result["kind"] = loaded.kind
        result["summary"] = loaded.to_json_dict()["summary"]
        if markdown is not None:
            text = report_markdown(loaded, gates, verdict.status)
            atomic_write(markdown, lambda tmp: Path(tmp).write_text(text))
            result["files"] = {"markdown": str(markdown)}
        if pivot and not json_out:
            sys.stdout.write(loaded.wide().write_csv())
        return result

    execute("report", body, json_out=json_out, quiet=quiet)
