"""`pgdiag report REPORT`: re-render a saved report (metrics, compare, whatif, drift) without recomputation.

Thin shell over `pgdiag.report.report.load_report`, `pgdiag.report.markdown` and `pgdiag.report.html`: the
headline rows as a table on stderr, `--markdown PATH` (a summary for a CI comment), `--html PATH` (the one-file
page, its verdict re-derived from the stored values), `--pivot` (the wide table as CSV on stdout), and gates
(`--fail-on`, `--warn-on`, `--profile`) re-evaluated on the stored values. Example::

    pgdiag report /tmp/parity/compare.parquet --fail-on 'k3>1e-3' --markdown /tmp/comment.md
    pgdiag report /tmp/whatif/whatif.parquet --html /tmp/whatif.html
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
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write the one-file HTML report of the saved report (verdict, tables, plots).",
            rich_help_panel=OUTPUT,
        ),
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
    """Re-render a saved report without recomputing it; gates are re-evaluated on its stored values.

    Any kind (metrics, compare, whatif, drift): a table of its headline rows (pair, scope, bucket, metric,
    value), --markdown for a CI comment, --html for the one-file page, --pivot for the wide table; the last line
    is the report's verdict, derived again from the stored values (compare: judged by the gates given).
    """

    def body(console: Console) -> dict[str, Any]:
        from rich.table import Table

        from pgdiag.cli.render import format_value, render_gates, render_verdict
        from pgdiag.data.writing import atomic_write, check_destination
        from pgdiag.report.gates import GateSettings, outcome
        from pgdiag.report.markdown import headline_rows, report_markdown
        from pgdiag.report.report import load_report
        from pgdiag.report.verdict import report_verdict

        if markdown is not None:
            check_destination(
                markdown.parent, [markdown], overwrite=overwrite, hint="--markdown takes a file name"
            )
        if html is not None:
            from pgdiag.report.html import check_html_path

            check_html_path(html, overwrite=overwrite)
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
            for header in ("pair", "scope", "bucket", "metric", "value"):
                table.add_column(header, justify="right" if header == "value" else "left")
            for pair, scope, bucket, metric, value, unit, _ in rows.iter_rows():
                table.add_row(pair, scope, bucket, metric, format_value(value, unit))
            console.print(table)
            render_gates(console, verdict.gates)
        saved_verdict = report_verdict(loaded, verdict.gates)  # from the stored values, as --html shows it
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
        result["verdict"] = saved_verdict.as_dict()
        if markdown is not None:
            text = report_markdown(loaded, gates, verdict.status)
            atomic_write(markdown, lambda tmp: Path(tmp).write_text(text))
            result["files"]["markdown"] = str(markdown)
        if html is not None:
            result["files"]["html"] = str(
                _write_page(loaded, source, html, verdict.gates, overwrite=overwrite)
            )
        if pivot and not json_out:
            sys.stdout.write(loaded.wide().write_csv())
        render_verdict(console, saved_verdict)
        return result

    execute("report", body, json_out=json_out, quiet=quiet)


def _write_page(loaded: Any, source: str, html: Path, gates: Any, *, overwrite: bool) -> Path:
    """The one-file page of a saved report: its verdict derived from the stored values (compare: judged by
    `gates`), every plot its rows support (a compare report's worst trace when it sits beside it)."""
    import polars as pl

    from pgdiag.compare.output import trace_path
    from pgdiag.report.html import verdict_arguments, write_html
    from pgdiag.report.plots import build_figures
    from pgdiag.report.verdict import report_verdict

    page_verdict = verdict_arguments(report_verdict(loaded, gates))
    trace = None
    if loaded.kind == "compare":
        path = Path(source)
        report_file = path if path.is_file() else next(
            p for p in sorted(path.glob("*.parquet")) if ".worst_" not in p.name
        )  # fmt: skip
        trace_file = trace_path(report_file)
        trace = pl.read_parquet(trace_file) if trace_file.exists() else None
    plot_set = build_figures(loaded, trace=trace, marks=page_verdict["marks"])
    return write_html(loaded, html, overwrite=overwrite, plot_set=plot_set, argv=sys.argv[1:], **page_verdict)
