"""`pgdiag report REPORT`: re-render a saved report (metrics, compare, whatif, drift) without recomputation.

Thin shell over `pgdiag.report.report.load_report`, `pgdiag.report.markdown` and `pgdiag.report.html`: the
headline rows as a table on stdout, `--markdown PATH` (a summary for a CI comment), `--html PATH` (the one-file
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

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.options import OUTPUT, Fields, GateOptions, option
from pgdiag.cli.outputs import OutputSettings

HELP = """Re-render a saved report without recomputing it; gates are re-evaluated on its stored values.

Any kind (metrics, compare, whatif, drift): a table of its headline rows (pair, scope, bucket, metric,
value), --markdown for a CI comment, --html for the one-file page, --pivot for the wide table; the last line
is the report's verdict, derived again from the stored values (compare: judged by the gates given).
"""

SourceArg = Annotated[str, typer.Argument(help="A report .parquet file, or a directory holding one report.")]
MarkdownOpt = Annotated[
    Path | None,
    option("--markdown", "Write a Markdown summary for a CI comment.", OUTPUT),
]
PivotOpt = Annotated[
    bool,
    option("--pivot", "Print the wide table (one column per metric) as CSV on stdout.", OUTPUT),
]


def report(
    source: SourceArg,
    *,
    markdown: MarkdownOpt = None,
    pivot: PivotOpt = False,
    gate: Annotated[GateOptions, Fields("fail_on", "warn_on", "profile", "exit_zero")],
    output: Annotated[OutputSettings, Fields("html", "json_out", "overwrite", "quiet")],
) -> None:
    """The `report` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.cli.render import render_verdict
        from pgdiag.data.writing import atomic_write, check_destination
        from pgdiag.report.gates import outcome
        from pgdiag.report.markdown import report_markdown
        from pgdiag.report.report import load_report
        from pgdiag.report.verdict import report_verdict

        if markdown is not None:
            check_destination(
                markdown.parent, [markdown], overwrite=output.overwrite, hint="--markdown takes a file name"
            )
        output.refuse_existing("report")
        loaded = load_report(source)
        verdict = outcome(loaded, gate.settings())
        gates = [g.__dict__ for g in verdict.gates.gates]
        results = screen.notes if pivot else screen.results  # --pivot: the CSV alone on stdout
        saved_verdict = report_verdict(loaded, verdict.gates)  # from the stored values, as --html shows it
        if not output.quiet:
            _render(results, loaded, source, verdict)
        result = result_object(
            "report",
            status=verdict.status,
            exit_code=verdict.exit_code,
            pairs=loaded.meta.get("pairs", []),
            gates=gates,
            checks=loaded.checks.to_dicts(),
            kind=loaded.kind,
            summary=loaded.to_json_dict()["summary"],
            verdict=saved_verdict.as_dict(),
        )
        if markdown is not None:
            text = report_markdown(loaded, gates, verdict.status)
            atomic_write(markdown, lambda tmp: Path(tmp).write_text(text))
            result["files"]["markdown"] = str(markdown)
        if output.html is not None:
            page = _write_page(loaded, source, output.html, verdict.gates, overwrite=output.overwrite)
            result["files"]["html"] = str(page)
        if pivot and not output.json_out:
            sys.stdout.write(loaded.wide().write_csv())
        render_verdict(results, saved_verdict)
        return result

    execute("report", body, json_out=output.json_out, quiet=output.quiet)


def _render(console: Any, loaded: Any, source: str, verdict: Any) -> None:
    """The headline rows of a saved report and its gates."""
    from rich.table import Table

    from pgdiag.cli.render import format_value, render_gates
    from pgdiag.report.markdown import headline_rows

    table = Table(title=f"{loaded.kind} report {source}", title_justify="left")
    for header in ("pair", "scope", "bucket", "metric", "value"):
        table.add_column(header, justify="right" if header == "value" else "left")
    for pair, scope, bucket, metric, value, unit, _ in headline_rows(loaded).iter_rows():
        table.add_row(pair, scope, bucket, metric, format_value(value, unit))
    console.print(table)
    render_gates(console, verdict.gates)


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
