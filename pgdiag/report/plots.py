"""Matplotlib figures of a comparison: token scatter, Δ histogram, breakdowns, per-step drift, worst trace.

What: every `plot_*(source, *, ax=None, ...) -> Figure` draws one diagnostic; `save_figure` writes it atomically.
Sources: token plots (`plot_hexbin`, `plot_worst_trace`) take token data, an `AlignedPair` or a polars frame with
``lp_a``/``lp_b`` columns (the `--tokens-out` table, a worst trace); aggregate plots (`plot_dlogp_hist`,
`plot_by_prob`, `plot_by_position`, `plot_by_step`) take a `Report` and read its breakdown rows, so
`pgdiag plot REPORT` redraws them without the runs.
Why: no display is ever needed: figures are built with `matplotlib.figure.Figure` (no pyplot, no global backend
state), rendered by the Agg canvas, and matplotlib is imported only when a plot is drawn.
How: pass `ax` to draw into an existing axes (its figure is returned), else a new figure is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from pgdiag.errors import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGSIZE = (6.4, 4.4)
PLOT_FORMATS = ("png", "svg", "pdf")


def _axes(ax: Axes | None) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, layout="constrained")
    return fig, fig.add_subplot()


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 120) -> Path:
    """Write `fig` atomically; the format comes from the suffix (png, svg, pdf)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pgdiag.data.writing import atomic_write

    path = Path(path)
    fmt = path.suffix.lstrip(".")
    if fmt not in PLOT_FORMATS:
        raise UsageError(
            "E503", f"plot format {fmt!r} not supported", f"choose one of {', '.join(PLOT_FORMATS)}"
        )
    FigureCanvasAgg(fig)
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi))


def _token_arrays(source: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """(lp_a, lp_b, title) of an `AlignedPair` or a frame with lp_a/lp_b columns."""
    if isinstance(source, pl.DataFrame):
        if not {"lp_a", "lp_b"} <= set(source.columns):
            raise UsageError(
                "E511", "token plots need a table with lp_a and lp_b columns (write it with --tokens-out)"
            )
        title = str(source["pair"][0]) if "pair" in source.columns and source.height else ""
        return source["lp_a"].to_numpy(), source["lp_b"].to_numpy(), title
    if hasattr(source, "lp_a") and hasattr(source, "lp_b"):
        return np.asarray(source.lp_a), np.asarray(source.lp_b), str(getattr(source, "pair", ""))
    raise UsageError("E511", f"cannot draw a token plot from {type(source).__name__}; give token data")


def _rows(report: Any, breakdown: str, metric: str, hint: str) -> pl.DataFrame:
    """The token-scope rows of `breakdown` and `metric` in `report`; E511 (with `hint`) when there are none."""
    summary = getattr(report, "summary", None)
    if summary is None:
        raise UsageError("E511", f"the {breakdown} plot needs a report (got {type(report).__name__})")
    rows = summary.filter(
        (pl.col("breakdown") == breakdown) & (pl.col("metric") == metric) & (pl.col("scope") == "token")
    )
    if rows.height == 0:
        raise UsageError("E511", f"the report has no {breakdown} rows of {metric}", hint)
    return rows


def plot_hexbin(source: Any, *, ax: Axes | None = None, gridsize: int = 60) -> Figure:
    """Hexbin of lp_a (x) against lp_b (y), log colour scale, with the y = x line."""
    lp_a, lp_b, title = _token_arrays(source)
    fig, ax = _axes(ax)
    if lp_a.size:
        art = ax.hexbin(lp_a, lp_b, gridsize=gridsize, bins="log", mincnt=1, cmap="viridis")
        fig.colorbar(art, ax=ax, label="tokens")
        lo = float(min(lp_a.min(), lp_b.min()))
        ax.plot([lo, 0.0], [lo, 0.0], color="red", linewidth=0.8, label="y = x")
        ax.legend(loc="upper left")
    ax.set_xlabel("log-prob side a (nats)")
    ax.set_ylabel("log-prob side b (nats)")
    ax.set_title(title or "log-prob a vs b")
    return fig


def plot_dlogp_hist(source: Any, *, ax: Axes | None = None, bins: int = 200) -> Figure:
    """Histogram of Δ = lp_b − lp_a with a log y axis: from a report's `dlogp` breakdown, or from token data."""
    fig, ax = _axes(ax)
    if hasattr(source, "summary"):
        rows = _rows(
            source, "dlogp", "count/tokens", "give a report written by pgdiag compare (it always has them)"
        ).sort("bucket_lo", "bucket_hi")
        for pair in rows["pair"].unique(maintain_order=True).to_list():
            part = rows.filter(pl.col("pair") == pair)
            labels = part[
                "bucket"
            ].to_list()  # "0" is the exact-zero bin, between the negative and positive bins
            ax.bar(range(len(labels)), part["value"].to_numpy(), label=pair)
            ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_title("Δ histogram (all tokens)")
        ax.legend(loc="upper right", fontsize=7)
    else:
        lp_a, lp_b, title = _token_arrays(source)
        d = lp_b - lp_a
        ax.hist(d, bins=bins, log=True)
        ax.set_title(title or "Δ histogram")
    ax.set_yscale("log")
    ax.set_xlabel("Δ = lp_b − lp_a (nats)")
    ax.set_ylabel("tokens")
    return fig


def _bucket_plot(report: Any, breakdown: str, metric: str, ax: Axes | None, xlabel: str) -> Figure:
    fig, ax = _axes(ax)
    rows = _rows(report, breakdown, metric, f"rerun pgdiag compare with --by {breakdown}").sort("bucket_lo")
    for pair in rows["pair"].unique(maintain_order=True).to_list():
        part = rows.filter(pl.col("pair") == pair)
        labels = part["bucket"].to_list()
        ax.plot(range(len(labels)), part["value"].to_numpy(), marker="o", label=pair)
        ax.set_xticks(range(len(labels)), labels, rotation=45, fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} (nats)")
    ax.legend(fontsize=7)
    return fig


def plot_by_position(report: Any, *, ax: Axes | None = None, metric: str = "mismatch/abs_mean") -> Figure:
    """`metric` (default mean |Δ|) by response position bucket (0 = first response token)."""
    return _bucket_plot(report, "position", metric, ax, "response position")


def plot_by_prob(report: Any, *, ax: Axes | None = None, metric: str = "mismatch/abs_mean") -> Figure:
    """`metric` (default mean |Δ|) by probability bucket of side a."""
    return _bucket_plot(report, "prob_bucket", metric, ax, "probability of the sampled token, side a")


def plot_by_step(report: Any, *, ax: Axes | None = None, metric: str = "mismatch/abs_mean") -> Figure:
    """`metric` per step: the pair's step breakdown, plus each run's own value when side-by-side rows exist."""
    fig, ax = _axes(ax)
    summary = report.summary
    rows = summary.filter((pl.col("breakdown") == "step") & (pl.col("metric") == metric))
    if rows.height == 0:
        raise UsageError(
            "E511", f"the report has no per-step rows of {metric}", "rerun pgdiag compare with --by step"
        )
    for pair in rows["pair"].unique(maintain_order=True).to_list():
        part = rows.filter(pl.col("pair") == pair).sort("bucket_lo")
        ax.plot(part["bucket_lo"].to_numpy(), part["value"].to_numpy(), marker="o", label=pair)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize=7)
    return fig


def plot_worst_trace(source: Any, *, ax: Axes | None = None) -> Figure:
    """Both log-prob streams along the worst sequence (a `worst_trace` frame), with Δ on a twin axis."""
    if not isinstance(source, pl.DataFrame) or not {"resp_pos", "lp_a", "lp_b"} <= set(source.columns):
        raise UsageError("E511", "the worst-trace plot needs a trace table (resp_pos, lp_a, lp_b)")
    fig, ax = _axes(ax)
    x = source["resp_pos"].to_numpy()
    lp_a, lp_b = source["lp_a"].to_numpy(), source["lp_b"].to_numpy()
    ax.plot(x, lp_a, label="side a", linewidth=1.0)
    ax.plot(x, lp_b, label="side b", linewidth=1.0, linestyle="--")
    twin = ax.twinx()
    twin.bar(x, lp_b - lp_a, color="grey", alpha=0.4, label="Δ")
    twin.set_ylabel("Δ (nats)")
    if source.height:
        ax.set_title(f"worst sequence: step {source['step'][0]}, sample {source['sample_id'][0]}")
    ax.set_xlabel("response position")
    ax.set_ylabel("log-prob (nats)")
    ax.legend(loc="lower left", fontsize=7)
    return fig
