"""`pgdiag plot SOURCE --kind KIND... --out DIR [--html PAGE]`: redraw a report's plots without recomputation.

SOURCE is a report written by `pgdiag compare --out`, `metrics --out`, `whatif --out` or `drift --out` (its
``.parquet`` file or directory), or a token table written with `compare --tokens-out`. A comparison draws its
breakdown plots (`dlogp-hist`, `by-prob`, `by-position`, `by-step`) and `worst-trace` (the ``.worst_trace.parquet``
beside it); a metrics report draws the per-step trend plots (`trend-kl`, `trend-clip`, `trend-ess`, `trend-ratio`,
`trend-mismatch`, `trend-loss`); a whatif report its `whatif` figure; a drift report its `drift` figure and the
trend plots; a token table draws `dlogp-vs-logprob`, `hexbin` and `dlogp-hist`. `--kind all`
(the default) lists every kind it left out and why. Figures are written atomically with the Agg backend.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.options import OUTPUT, Fields, option
from pgdiag.cli.outputs import OutputSettings


class PlotKind(StrEnum):
    dlogp_vs_logprob = "dlogp-vs-logprob"
    hexbin = "hexbin"
    dlogp_hist = "dlogp-hist"
    by_prob = "by-prob"
    by_position = "by-position"
    by_step = "by-step"
    worst_trace = "worst-trace"
    trend_kl = "trend-kl"
    trend_clip = "trend-clip"
    trend_ess = "trend-ess"
    trend_ratio = "trend-ratio"
    trend_mismatch = "trend-mismatch"
    trend_loss = "trend-loss"
    whatif = "whatif"
    drift = "drift"
    all = "all"


class PlotFormat(StrEnum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


HELP = """Redraw plots from a saved report (compare, metrics, whatif or drift) or a token table, without
recomputation.

--kind all (the default) draws every kind the source supports and lists those it leaves out, with why.
--html PAGE writes a one-file HTML report of a saved report, and the figures only where --out says.
Existing figures in --out are kept (E502) unless --overwrite is given; the files written are listed.
"""

SourceArg = Annotated[
    Path,
    typer.Argument(
        help="A saved report (.parquet or its directory: compare, metrics, whatif, drift) or a token table.",
        readable=False,  # checked by pgdiag.data.paths: E516 like every other input, not click's message
    ),
]
KindOpt = Annotated[
    list[PlotKind] | None,
    option("--kind", "Plot kind (repeatable; default: all the source supports).", OUTPUT),
]
FiguresOpt = Annotated[
    Path | None,
    option(
        "--out",
        "Directory for the figures (default: plots/, or none with --html: the page embeds them).",
        OUTPUT,
    ),
]
FormatOpt = Annotated[PlotFormat, option("--format", "Figure format.", OUTPUT)]
DpiOpt = Annotated[
    int,
    option(
        "--dpi",
        "Resolution of raster figures (at most 50,000,000 pixels a figure: about 1,000 dpi).",
        OUTPUT,
        min=10,
    ),
]


def plot(
    source: SourceArg,
    *,
    kind: KindOpt = None,
    out: FiguresOpt = None,
    fmt: FormatOpt = PlotFormat.png,
    dpi: DpiOpt = 120,
    output: Annotated[OutputSettings, Fields("html", "overwrite", "json_out", "quiet")],
) -> None:
    """The `plot` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.cli.render import render_written
        from pgdiag.data.paths import check_input_path
        from pgdiag.data.writing import check_destination
        from pgdiag.errors import Code, UsageError
        from pgdiag.report import plots

        if check_input_path(source) is None:
            raise UsageError(Code.INPUT_NOT_FOUND, f"{source}: no such file or directory")
        figures_dir = Path("plots") if out is None and output.html is None else out  # --html alone: the page
        hint = "--out takes the directory of the figures"
        if figures_dir is not None:
            check_destination(figures_dir, [], overwrite=output.overwrite, hint=hint)
        output.refuse_existing("plot")
        report, tokens, trace = _read_source(source, html=output.html is not None)
        page_verdict = _saved_verdict(report) if report is not None else {}
        wanted = tuple(k.value for k in kind) if kind else ("all",)
        plot_set = plots.build_figures(
            report, kinds=wanted, tokens=tokens, trace=trace, marks=page_verdict.get("marks", ())
        )
        files: dict[str, Any] = {}
        if figures_dir is not None:
            figures = [figures_dir / f"{k}.{fmt.value}" for k in plot_set.figures]
            check_destination(figures_dir, figures, overwrite=output.overwrite, hint=hint)
            files["plots"] = plots.save_figures(plot_set, figures_dir, fmt=fmt.value, dpi=dpi)
        if output.html is not None:
            from pgdiag.report.html import write_html

            files["html"] = str(
                write_html(report, output.html, overwrite=output.overwrite, plot_set=plot_set, **page_verdict)
            )
        render_written(screen.notes, files)
        for k, why in plot_set.skipped.items():
            screen.notes.print(f"skipped {k}: {why}", markup=False, soft_wrap=True)
        return result_object("plot", files=files, plots_skipped=plot_set.skipped)

    execute("plot", body, json_out=output.json_out, quiet=output.quiet)


def _read_source(source: Path, *, html: bool) -> tuple[Any, Any, Any]:
    """(report, token table, worst trace) of `source`: a token table (E511 with --html), else a saved report and
    the worst trace beside it when there is one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pgdiag.compare.output import trace_path
    from pgdiag.compare.tokens import TOKEN_TABLE_SCHEMA_ID
    from pgdiag.data.paths import readable_file
    from pgdiag.errors import Code, InvalidInputError, UsageError
    from pgdiag.report.report import load_report, one_line_text, read_table_file

    if source.is_file():
        try:
            footer = pq.read_schema(readable_file(source)).metadata or {}
        except (OSError, pa.ArrowException) as exc:
            raise InvalidInputError(
                Code.NOT_ROLLOUTS_FILE, f"{source}: not a readable Parquet file ({one_line_text(exc)})"
            ) from None
        if footer.get(b"pgdiag.schema", b"").strip(b'"') == TOKEN_TABLE_SCHEMA_ID.encode():
            if html:
                raise UsageError(
                    Code.WRONG_PLOT_INPUT,
                    "--html needs a report (compare, metrics, whatif or drift --out), not a token table",
                )
            return None, read_table_file(source, finite=("lp_a", "lp_b")), None
    report = load_report(source)
    if report.summary.height == 0:
        raise UsageError(
            Code.WRONG_PLOT_INPUT,
            f"{source}: the report has no rows to plot",
            "rerun the command that wrote it",
        )
    report_file = (
        source
        if source.is_file()
        else next(p for p in sorted(source.glob("*.parquet")) if ".worst_" not in p.name)
    )
    trace_file = trace_path(report_file)
    return report, None, read_table_file(trace_file) if trace_file.exists() else None


def _saved_verdict(report: Any) -> dict[str, Any]:
    """The page's verdict arguments from the verdict a saved report carries (``meta["verdict"]``), else a line
    pointing at the command that states one."""
    from pgdiag.report.html import verdict_arguments

    saved = report.meta.get("verdict")
    if not isinstance(saved, dict) or not saved.get("line"):
        return {"verdict": f"{report.kind} report: rerun pgdiag {report.kind} for its verdict"}
    return verdict_arguments(saved)
