"""`pgdiag plot SOURCE --kind KIND... --out DIR`: redraw a comparison's plots without recomputation.

SOURCE is a report written by `pgdiag compare --out` (its ``.parquet`` file or directory): the aggregate plots
(`dlogp-hist`, `by-prob`, `by-position`, `by-step`) read its breakdown rows and `worst-trace` the
``.worst_trace.parquet`` beside it; or a token table written with `--tokens-out` (a ``.parquet`` with lp_a and
lp_b columns) for `hexbin` and `dlogp-hist`. Figures are written atomically with the Agg backend, never shown.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pgdiag.cli.common import OUTPUT, JsonOpt, OverwriteOpt, QuietOpt, execute, result_object


class PlotKind(StrEnum):
    hexbin = "hexbin"
    dlogp_hist = "dlogp-hist"
    by_prob = "by-prob"
    by_position = "by-position"
    by_step = "by-step"
    worst_trace = "worst-trace"
    all = "all"


class PlotFormat(StrEnum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


REPORT_KINDS = ("dlogp-hist", "by-prob", "by-position", "by-step", "worst-trace")
TOKEN_KINDS = ("hexbin", "dlogp-hist")


def register(app: typer.Typer) -> None:
    """Add the `plot` command to `app`."""
    app.command("plot")(plot)


def plot(
    source: Annotated[
        Path, typer.Argument(help="A compare report (.parquet or its directory) or a token table.")
    ],
    *,
    kind: Annotated[
        list[PlotKind] | None,
        typer.Option(
            "--kind", help="Plot kind (repeatable; default: all the source supports).", rich_help_panel=OUTPUT
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the figures.", rich_help_panel=OUTPUT)
    ] = Path("plots"),
    fmt: Annotated[
        PlotFormat, typer.Option("--format", help="Figure format.", rich_help_panel=OUTPUT)
    ] = PlotFormat.png,
    dpi: Annotated[
        int, typer.Option("--dpi", min=10, help="Resolution of raster figures.", rich_help_panel=OUTPUT)
    ] = 120,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Redraw plots from a saved comparison report or token table.

    Existing figures in --out are kept (E502) unless --overwrite is given; the figures written are listed.
    """

    def body(console: Console) -> dict[str, Any]:
        import polars as pl
        import pyarrow.parquet as pq

        from pgdiag.cli.render import render_written
        from pgdiag.compare.output import draw_plots, trace_path
        from pgdiag.compare.tokens import TOKEN_TABLE_SCHEMA_ID
        from pgdiag.data.writing import check_destination
        from pgdiag.errors import UsageError
        from pgdiag.report.report import load_report

        if not source.exists():
            raise UsageError("E501", f"{source}: no such file or directory")
        check_destination(out, [], overwrite=overwrite, hint="--out takes the directory of the figures")
        is_tokens = False
        if source.is_file():
            footer = pq.read_schema(source).metadata or {}
            is_tokens = footer.get(b"pgdiag.schema", b"").strip(b'"') == TOKEN_TABLE_SCHEMA_ID.encode()
        wanted = tuple(k.value for k in kind) if kind else ("all",)
        if is_tokens:
            tokens = pl.read_parquet(source)
            kinds = TOKEN_KINDS if "all" in wanted else wanted
            bad = [k for k in kinds if k not in TOKEN_KINDS]
            if bad:
                raise UsageError(
                    "E503", f"a token table draws {', '.join(TOKEN_KINDS)}, not {', '.join(bad)}"
                )
            written = {}
            from pgdiag.report import plots

            check_destination(out, [out / f"{k}.{fmt.value}" for k in kinds], overwrite=overwrite)
            for k in kinds:
                fig = plots.plot_hexbin(tokens) if k == "hexbin" else plots.plot_dlogp_hist(tokens)
                written[k] = str(plots.save_figure(fig, out / f"{k}.{fmt.value}", dpi=dpi))
        else:
            report = load_report(source)
            report_file = (
                source
                if source.is_file()
                else next(p for p in sorted(source.glob("*.parquet")) if ".worst_" not in p.name)
            )
            trace_file = trace_path(report_file)
            trace = pl.read_parquet(trace_file) if trace_file.exists() else None
            if "all" in wanted:
                has_step = report.summary.filter(pl.col("breakdown") == "step").height > 0
                kinds = tuple(
                    k
                    for k in REPORT_KINDS
                    if (k != "by-step" or has_step) and (k != "worst-trace" or trace is not None)
                )
            else:
                kinds = wanted
            check_destination(out, [out / f"{k}.{fmt.value}" for k in kinds], overwrite=overwrite)
            written = draw_plots(report, trace, None, out, kinds=kinds, fmt=fmt.value, dpi=dpi)
        files = {"plots": written}
        render_written(console, files)
        return result_object("plot", files=files)

    execute("plot", body, json_out=json_out, quiet=quiet)
