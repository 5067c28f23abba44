"""Matplotlib figures of a report: comparison plots (Δ vs log-prob, hexbin, Δ histogram, breakdowns, per-step
drift, worst trace) and per-step trend plots of a metrics report (KL, clip fractions, ESS, ratio extremes,
mismatch, loss under each mode).

What: every `plot_*(source, *, ax=None, ...) -> Figure` draws one diagnostic; `build_figures` draws every kind a
source supports and says why it skipped the others (`PlotSet`); `save_figure` writes a figure atomically.
Sources: token plots (`plot_dlogp_vs_logprob`, `plot_hexbin`) take token data, an `AlignedPair` or a polars frame
with ``lp_a``/``lp_b`` columns (the `--tokens-out` table); aggregate plots (`plot_dlogp_hist`, `plot_by_prob`,
`plot_by_position`, `plot_by_step`, `plot_trend`) take a `Report` and read its rows, so `pgdiag plot REPORT`
redraws them without the runs; `plot_worst_trace` takes a worst-trace frame.
Conventions: every figure has a title and axis labels with units; bucket plots write each bucket's count (n) on
it and fade buckets with fewer than `SMALL_BUCKET` tokens; magnitudes (|Δ|, KL k3, fractions, ESS) have a y axis
from 0; steps are integer ticks labelled with their token counts; legends name the streams.
Why: no display is ever needed: figures are built with `matplotlib.figure.Figure` (no pyplot, no global backend
state), rendered by the Agg canvas, and matplotlib is imported only when a plot is drawn.
How: pass `ax` to draw into an existing axes (its figure is returned), else a new figure is made.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from pgdiag.errors import Code, InvalidInputError, UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGSIZE = (6.4, 4.4)
PLOT_FORMATS = ("png", "svg", "pdf")
SMALL_BUCKET = 30  # buckets (and steps) with fewer tokens than this are drawn faded
FADED_ALPHA = 0.3
HEXBIN_GRIDSIZE = 60
MAX_LABELLED_STEPS = 12  # above this many steps, tick labels carry the step only (no counts)
# A figure is rendered at most this many pixels (width x height at --dpi), each side under Agg's 2^16 limit:
# 50 megapixels is a 200 MB RGBA buffer, dpi 1,000 for a default-size figure (docs/report.md).
MAX_FIGURE_PIXELS = 50_000_000
MAX_FIGURE_SIDE = 2**16 - 1
_FLOAT_LIMIT = float(np.finfo(np.float64).max) / 16  # larger values are not drawn: tick arithmetic overflows

COMPARE_KINDS = (
    "dlogp-vs-logprob",
    "hexbin",
    "dlogp-hist",
    "by-prob",
    "by-position",
    "by-step",
    "worst-trace",
)
TOKEN_KINDS = ("dlogp-vs-logprob", "hexbin", "dlogp-hist")


@dataclass(frozen=True)
class TrendPanel:
    """One trend plot of a metrics report: which metrics it draws per step, its unit and its y axis."""

    title: str
    metrics: tuple[str, ...]
    unit: str
    from_zero: bool = True  # a magnitude: y axis starts at 0
    log_y: bool = False
    prefix: str = ""  # metrics matching this prefix are drawn too (loss/<mode>)


TREND_PANELS: dict[str, TrendPanel] = {
    "trend-kl": TrendPanel(
        "KL estimators per step",
        ("policy/kl_k1", "policy/kl_k3", "policy/kl_rev_k3"),
        "nats",
        from_zero=False,
    ),
    "trend-clip": TrendPanel(
        "clip fractions per step",
        (
            "policy/clip_frac_band",
            "policy/clip_frac_binding",
            "policy/clip_frac_low",
            "policy/clip_frac_high",
        ),
        "fraction",
    ),
    "trend-ess": TrendPanel(
        "effective sample size per step",
        ("policy/ess_token", "policy/ess_seq", "mismatch/ess_token", "mismatch/ess_seq"),
        "fraction of N",
    ),
    "trend-ratio": TrendPanel(
        "importance-ratio extremes per step",
        ("policy/ratio_max", "policy/ratio_min", "policy/seq_ratio_max", "policy/seq_ratio_min"),
        "ratio",
        log_y=True,
    ),
    "trend-mismatch": TrendPanel(
        "rollout vs trainer mismatch per step",
        ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/abs_max", "mismatch/kl_k3"),
        "nats",
    ),
    "trend-loss": TrendPanel(
        "pg loss per step, every aggregation mode", (), "loss", from_zero=False, prefix="loss/"
    ),
}
TREND_KINDS = tuple(TREND_PANELS)
REPORT_KINDS = (
    "whatif",
    "drift",
    "explain-shares",
    "layers",
)  # the figures of whatif, drift and explain reports
ALL_KINDS = COMPARE_KINDS + TREND_KINDS + REPORT_KINDS


@dataclass(frozen=True)
class Mark:
    """An anomaly to mark on a trend plot: `metric` at `step`, with a short `label` (e.g. "ESS 0.015 < 0.1")."""

    metric: str
    step: int
    label: str


def finding_marks(findings: Iterable[Any]) -> list[Mark]:
    """The marks of verdict findings (objects or dicts with ``metric``, ``step``, ``message``) that name one
    metric at one integer step; the others (pooled, empty steps) mark nothing."""
    marks = []
    for finding in findings:
        get = finding.get if isinstance(finding, Mapping) else lambda key, f=finding: getattr(f, key, None)
        metric, step, message = get("metric"), get("step"), get("message")
        try:
            step_number = int(step)
        except (TypeError, ValueError):
            continue
        if metric:
            label = re.sub(r"^step \S+: ", "", str(message or metric))  # the x axis says the step
            marks.append(Mark(str(metric), step_number, label))
    return marks


@dataclass(frozen=True)
class PlotSet:
    """Figures drawn by `build_figures` ({kind: Figure}, in drawing order) and the kinds it left out, with why."""

    figures: dict[str, Figure] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _axes(ax: Axes | None) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, layout="constrained")
    return fig, fig.add_subplot()


def check_pixels(fig: Figure, dpi: float, name: str = "the figure") -> None:
    """UsageError E503 when `fig` at `dpi` would exceed `MAX_FIGURE_PIXELS` (or a side `MAX_FIGURE_SIDE`), or
    when `dpi` is not a positive finite number; the hint names the largest dpi this figure allows."""
    width_in, height_in = (float(v) for v in fig.get_size_inches())
    largest = int(
        min(np.sqrt(MAX_FIGURE_PIXELS / (width_in * height_in)), MAX_FIGURE_SIDE / max(width_in, height_in))
    )
    if not (np.isfinite(dpi) and dpi > 0):
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"--dpi {dpi}: not a positive number", f"give a dpi from 10 to {largest}"
        )
    width, height = width_in * dpi, height_in * dpi
    if width * height > MAX_FIGURE_PIXELS or max(width, height) > MAX_FIGURE_SIDE:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"--dpi {dpi:g}: {name} would be {width:,.0f} x {height:,.0f} pixels, over the limit of "
            f"{MAX_FIGURE_PIXELS:,} pixels ({MAX_FIGURE_SIDE:,} a side)",
            f"give --dpi {largest} or less (or --format svg/pdf at a smaller dpi)",
        )


def save_figures(
    plot_set: PlotSet, directory: str | Path, *, fmt: str = "png", dpi: int = 120
) -> dict[str, str]:
    """Write every figure of `plot_set` as ``<directory>/<kind>.<fmt>``; returns {kind: path}.

    Every figure's size at `dpi` is checked first (`check_pixels`), so a refused dpi writes no file."""
    for kind, fig in plot_set.figures.items():
        check_pixels(fig, dpi, kind)
    return {
        kind: str(save_figure(fig, Path(directory) / f"{kind}.{fmt}", dpi=dpi))
        for kind, fig in plot_set.figures.items()
    }


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 120) -> Path:
    """Write `fig` atomically; the format comes from the suffix (png, svg, pdf)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pgdiag.data.writing import atomic_write

    path = Path(path)
    fmt = path.suffix.lstrip(".")
    if fmt not in PLOT_FORMATS:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"plot format {fmt!r} not supported",
            f"choose one of {', '.join(PLOT_FORMATS)}",
        )
    check_pixels(fig, dpi, path.name)
    FigureCanvasAgg(fig)
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi))


def figure_bytes(fig: Figure, *, fmt: str = "png", dpi: int = 110) -> bytes:
    """`fig` rendered to bytes (for embedding in a page)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    check_pixels(fig, dpi)
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi)
    return buffer.getvalue()


def stream_names(pair: str) -> tuple[str, str]:
    """("run_a:new", "run_b:new") of a pair label "run_a:new vs run_b:new"; ("a", "b") when it has no " vs "."""
    a, sep, b = pair.partition(" vs ")
    return (a, b) if sep and a and b else ("a", "b")


def _token_arrays(source: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """(lp_a, lp_b, pair) of an `AlignedPair` or a frame with lp_a/lp_b columns."""
    if isinstance(source, pl.DataFrame):
        if not {"lp_a", "lp_b"} <= set(source.columns):
            raise UsageError(
                Code.WRONG_PLOT_INPUT,
                "token plots need a table with lp_a and lp_b columns (write it with --tokens-out)",
            )
        pair = str(source["pair"][0]) if "pair" in source.columns and source.height else ""
        return _finite_tokens("lp_a", source["lp_a"]), _finite_tokens("lp_b", source["lp_b"]), pair
    if hasattr(source, "lp_a") and hasattr(source, "lp_b"):
        lp_a, lp_b = _finite_tokens("lp_a", source.lp_a), _finite_tokens("lp_b", source.lp_b)
        return lp_a, lp_b, str(getattr(source, "pair", ""))
    raise UsageError(
        Code.WRONG_PLOT_INPUT, f"cannot draw a token plot from {type(source).__name__}; give token data"
    )


def _finite_tokens(name: str, values: Any) -> np.ndarray:
    """`values` as float64 (E103 when they are not numbers; E207 for a null, NaN or ±inf: hexbins need finite
    data and the token table holds loss positions, which are finite by the schema)."""
    try:
        if isinstance(values, pl.Series) and not values.dtype.is_numeric():
            raise TypeError(values.dtype)
        array = (
            values.cast(pl.Float64, strict=True).to_numpy()
            if isinstance(values, pl.Series)
            else np.asarray(values, dtype=np.float64)
        )
    except (pl.exceptions.PolarsError, TypeError, ValueError):
        raise InvalidInputError(Code.LOSSY_CAST, f"token data, column {name}: not numbers") from None
    bad = ~np.isfinite(array)
    if bad.any():
        row = int(np.argmax(bad))
        raise InvalidInputError(
            Code.NON_FINITE,
            f"token data, row {row}, column {name}: {array[row]} ({int(bad.sum())} null, NaN or ±inf)",
        )
    return array


def _rows(report: Any, breakdown: str, metric: str, hint: str) -> pl.DataFrame:
    """The token-scope rows of `breakdown` and `metric` in `report`; E511 (with `hint`) when there are none."""
    summary = getattr(report, "summary", None)
    if summary is None:
        raise UsageError(
            Code.WRONG_PLOT_INPUT, f"the {breakdown} plot needs a report (got {type(report).__name__})"
        )
    rows = summary.filter(
        (pl.col("breakdown") == breakdown) & (pl.col("metric") == metric) & (pl.col("scope") == "token")
    )
    if rows.height == 0:
        raise UsageError(Code.WRONG_PLOT_INPUT, f"the report has no {breakdown} rows of {metric}", hint)
    return rows


def _alpha(n: int) -> float:
    return 1.0 if n >= SMALL_BUCKET else FADED_ALPHA


def _legend(ax: Axes, counts: Sequence[int], **kwargs: Any) -> None:
    """The axes' legend; when a bucket is faded, one more entry says what faded means."""
    handles, labels = ax.get_legend_handles_labels()
    if any(n < SMALL_BUCKET for n in counts):
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="0.5", alpha=FADED_ALPHA))
        labels.append(f"faded: n < {SMALL_BUCKET}")
    ax.legend(handles, labels, fontsize=7, **kwargs)


def near_equal(lp_a: np.ndarray, lp_b: np.ndarray, *, gridsize: int = HEXBIN_GRIDSIZE) -> bool:
    """True when a hexbin of lp_a vs lp_b cannot show the difference: p99 |Δ| is below one hexagon's width."""
    if lp_a.size == 0:
        return True
    spread = float(np.ptp(np.concatenate([lp_a, lp_b])))
    p99 = float(np.quantile(np.abs(lp_b - lp_a), 0.99))
    return spread == 0 or p99 < spread / gridsize


def plot_hexbin(source: Any, *, ax: Axes | None = None, gridsize: int = HEXBIN_GRIDSIZE) -> Figure:
    """Hexbin of lp_a (x) against lp_b (y), log colour scale, with the y = x line. Near-equal runs all sit on
    the line: `plot_dlogp_vs_logprob` shows their difference."""
    lp_a, lp_b, pair = _token_arrays(source)
    name_a, name_b = stream_names(pair)
    fig, ax = _axes(ax)
    if lp_a.size:
        art = ax.hexbin(lp_a, lp_b, gridsize=gridsize, bins="log", mincnt=1, cmap="viridis")
        fig.colorbar(art, ax=ax, label="tokens per hexagon")
        lo = float(min(lp_a.min(), lp_b.min()))
        ax.plot([lo, 0.0], [lo, 0.0], color="red", linewidth=0.8, label="y = x")
        ax.legend(loc="upper left", fontsize=7)
    ax.set_xlabel(f"log-prob, {name_a} (nats)")
    ax.set_ylabel(f"log-prob, {name_b} (nats)")
    ax.set_title(f"log-prob {name_b} vs {name_a}  (n = {lp_a.size:,} tokens)", fontsize=10)
    return fig


def plot_dlogp_vs_logprob(source: Any, *, ax: Axes | None = None, gridsize: int = HEXBIN_GRIDSIZE) -> Figure:
    """Δ = lp_b − lp_a (y) against lp_a (x): a hexbin with a log colour scale, the Δ = 0 line and the mean
    |Δ| per log-prob bin. Shows near-equal runs, whose lp_b vs lp_a hexbin is a line, at the scale of Δ."""
    lp_a, lp_b, pair = _token_arrays(source)
    name_a, name_b = stream_names(pair)
    fig, ax = _axes(ax)
    delta = lp_b - lp_a  # (M,)
    if lp_a.size:
        art = ax.hexbin(lp_a, delta, gridsize=(gridsize, gridsize // 2), bins="log", mincnt=1, cmap="viridis")
        fig.colorbar(art, ax=ax, label="tokens per hexagon")
        ax.axhline(0.0, color="red", linewidth=0.8, label="Δ = 0")
        edges = np.linspace(float(lp_a.min()), float(lp_a.max()) + 1e-12, 21)
        which = np.clip(np.digitize(lp_a, edges) - 1, 0, len(edges) - 2)
        counts = np.bincount(which, minlength=len(edges) - 1)
        sums = np.bincount(which, weights=np.abs(delta), minlength=len(edges) - 1)
        filled = counts > 0
        centres = (edges[:-1] + edges[1:]) / 2
        ax.plot(
            centres[filled], sums[filled] / counts[filled], color="orange", linewidth=1.2, label="mean |Δ|"
        )
        ax.legend(loc="lower left", fontsize=7)
    ax.set_xlabel(f"log-prob, {name_a} (nats)")
    ax.set_ylabel(f"Δ = {name_b} − {name_a} (nats)")
    ax.set_title(f"Δ vs log-prob  (n = {lp_a.size:,} tokens)", fontsize=10)
    return fig


def _bin_label(lo: float, hi: float, label: str) -> str:
    return label if lo != hi else "0 (exact)"


def plot_dlogp_hist(source: Any, *, ax: Axes | None = None, bins: int = 80) -> Figure:
    """Histogram of Δ = lp_b − lp_a, log y axis: from a report's `dlogp` breakdown (its empty outer bins left out,
    the exact-zero bin between the negative and positive ones), or from token data."""
    fig, ax = _axes(ax)
    if hasattr(source, "summary"):
        rows = _rows(
            source, "dlogp", "count/tokens", "give a report written by pgdiag compare (it always has them)"
        )
        pairs = rows["pair"].unique(maintain_order=True).to_list()
        # one x position per bin, ordered by (lo, hi): "[-1e-06,0)" < "0" < "[0,1e-06)"
        bins_ = rows.select("bucket", "bucket_lo", "bucket_hi").unique().sort("bucket_lo", "bucket_hi")
        totals = rows.group_by("bucket").agg(pl.col("value").sum())
        filled = set(totals.filter(pl.col("value") > 0)["bucket"].to_list())
        occupied = [i for i, b in enumerate(bins_["bucket"].to_list()) if b in filled]
        if occupied:  # the occupied range, with one empty bin either side for context
            first, last = max(occupied[0] - 1, 0), min(occupied[-1] + 1, bins_.height - 1)
            bins_ = bins_.slice(first, last - first + 1)
        labels = [_bin_label(lo, hi, b) for b, lo, hi in bins_.iter_rows()]
        width = 0.8 / max(len(pairs), 1)
        n_total = 0.0  # a float: a damaged report's counts may sum past any integer (inf)
        positive = False
        for index, pair in enumerate(pairs):
            part = rows.filter(pl.col("pair") == pair)
            count_of = dict(zip(part["bucket"].to_list(), part["value"].to_list(), strict=True))
            heights = [_count(count_of.get(b)) for b in bins_["bucket"].to_list()]
            n_total += sum(_count(v) for v in count_of.values())
            positive = positive or any(h > 0 for h in heights)
            x = np.arange(len(labels)) + (index - (len(pairs) - 1) / 2) * width
            ax.bar(x, heights, width=width, label=" vs ".join(stream_names(pair)))
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"Δ histogram  (n = {n_total:,.0f} tokens)", fontsize=10)
        name_a, name_b = stream_names(pairs[0]) if len(pairs) == 1 else ("a", "b")
        ax.set_xlabel(f"Δ = {name_b} − {name_a} (nats, bin edges)")
        if len(pairs) > 1:
            ax.legend(loc="upper right", fontsize=7)
    else:
        lp_a, lp_b, pair = _token_arrays(source)
        name_a, name_b = stream_names(pair)
        delta = lp_b - lp_a
        lo, hi = (float(delta.min()), float(delta.max())) if delta.size else (-1.0, 1.0)
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        ax.hist(delta, bins=np.linspace(lo, hi, bins + 1))
        ax.set_title(f"Δ histogram  (n = {delta.size:,} tokens)", fontsize=10)
        ax.set_xlabel(f"Δ = {name_b} − {name_a} (nats)")
        positive = delta.size > 0
    if positive:
        ax.set_yscale("log")
        ax.set_ylabel("tokens")
    else:  # a log axis needs a positive count; an empty histogram is drawn on a linear one and says so
        ax.set_ylabel("tokens (linear axis: no positive count)")
    return fig


def _count(value: float | None) -> float:
    """A bin count as a bar height: a missing, NaN, negative or overflowing count draws as 0."""
    if value is None:
        return 0.0
    value = float(value)
    return value if 0 < value < _FLOAT_LIMIT else 0.0


BUCKET_TITLES = {"position": "response position", "prob_bucket": "probability of the sampled token"}


def _stat_label(metric: str) -> str:
    stat = metric.split("/", 1)[-1]
    return {
        "abs_mean": "mean |Δ|",
        "abs_p50": "median |Δ|",
        "abs_p95": "p95 |Δ|",
        "abs_p99": "p99 |Δ|",
        "abs_max": "max |Δ|",
        "bias": "mean Δ",
        "rms": "rms Δ",
    }.get(stat, metric)


def _finite_values(column: pl.Series) -> np.ndarray:
    """The finite values of a report column (nulls, NaN and ±inf left out), for axis limits."""
    values = column.cast(pl.Float64).to_numpy()
    return values[np.abs(values) < _FLOAT_LIMIT]  # NaN compares false: left out too


def _drawable(column: pl.Series) -> np.ndarray:
    """A report column as float64 for drawing: nulls, ±inf and values within 16x of the float range (where
    matplotlib's tick arithmetic overflows) as NaN: a gap in the line."""
    values = column.cast(pl.Float64).fill_null(np.nan).to_numpy()
    return np.where(np.abs(values) < _FLOAT_LIMIT, values, np.nan)


def _headroom(values: np.ndarray, factor: float) -> float:
    """The top of a y axis from 0: `factor` x the largest value, 1 when nothing is positive; never past the
    float range (a value near 1.8e308 keeps its own top), so matplotlib can place ticks."""
    if values.size == 0 or not values.max() > 0:
        return 1.0
    top = float(values.max())
    return top * factor if top * factor < _FLOAT_LIMIT else top


def _is_magnitude(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return finite.size == 0 or bool((finite >= 0).all())


def _bucket_plot(report: Any, breakdown: str, metric: str, ax: Axes | None, xlabel: str) -> Figure:
    """Bars of `metric` per bucket (grouped by pair), each with its count written on it, faded where n is
    small; y from 0 when the values are a magnitude."""
    fig, ax = _axes(ax)
    rows = _rows(report, breakdown, metric, f"rerun pgdiag compare with --by {breakdown}").sort("bucket_lo")
    pairs = rows["pair"].unique(maintain_order=True).to_list()
    labels = rows["bucket"].unique(maintain_order=True).to_list()
    width = 0.8 / len(pairs)
    unit = str(rows["unit"][0])
    counts: list[int] = []
    for index, pair in enumerate(pairs):
        part = rows.filter(pl.col("pair") == pair)
        where = {b: (v, n) for b, v, n in part.select("bucket", "value", "n").iter_rows()}
        colour = f"C{index}"
        for i, bucket in enumerate(labels):
            value, n = where.get(bucket, (None, 0))
            x = i + (index - (len(pairs) - 1) / 2) * width
            height = float(value) if value is not None and abs(value) < _FLOAT_LIMIT else 0.0
            ax.bar(
                x,
                height,
                width=width,
                color=colour,
                alpha=_alpha(n),
                label=" vs ".join(stream_names(pair)) if i == 0 else None,
            )
            ax.annotate(
                f"n={n:,}",
                (x, height),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=6,
                rotation=90 if len(labels) * len(pairs) > 8 else 0,
            )
            counts.append(int(n))
    values = _finite_values(rows["value"])
    if _is_magnitude(values):
        ax.set_ylim(bottom=0.0, top=_headroom(values, 1.25))
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{_stat_label(metric)} ({unit})")
    ax.set_title(f"{_stat_label(metric)} by {BUCKET_TITLES.get(breakdown, breakdown)}", fontsize=10)
    _legend(ax, counts, loc="upper left")
    return fig


def plot_by_position(report: Any, *, ax: Axes | None = None, metric: str = "mismatch/abs_mean") -> Figure:
    """`metric` (default mean |Δ|) by response position bucket (0 = first response token)."""
    return _bucket_plot(report, "position", metric, ax, "response position (tokens, 0 = first)")


def plot_by_prob(report: Any, *, ax: Axes | None = None, metric: str = "mismatch/abs_mean") -> Figure:
    """`metric` (default mean |Δ|) by probability bucket of side a."""
    return _bucket_plot(report, "prob_bucket", metric, ax, "probability of the sampled token, side a")


def _step_axis(ax: Axes, steps: Sequence[int], counts: Mapping[int, int]) -> None:
    """Integer step ticks; with few steps each tick also carries the step's token count."""
    from matplotlib.ticker import MaxNLocator

    if len(steps) <= MAX_LABELLED_STEPS:
        ax.set_xticks(list(steps), [f"{s}\nn={counts.get(s, 0):,}" for s in steps], fontsize=7)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


def _step_rows(summary: pl.DataFrame, metric: str) -> pl.DataFrame:
    """Per-step rows of `metric` with an integer step column, in step order."""
    rows = summary.filter((pl.col("breakdown") == "step") & (pl.col("metric") == metric))
    return (
        rows.with_columns(pl.col("bucket").cast(pl.Int64, strict=False).alias("step"))
        .filter(pl.col("step").is_not_null())
        .sort("step")
    )


def plot_by_step(report: Any, *, ax: Axes | None = None, metric: str = "mismatch/abs_mean") -> Figure:
    """`metric` per step: the pair's step breakdown, plus each run's own value when side-by-side rows exist."""
    fig, ax = _axes(ax)
    rows = _step_rows(report.summary, metric)
    if rows.height == 0:
        raise UsageError(
            Code.WRONG_PLOT_INPUT,
            f"the report has no per-step rows of {metric}",
            "rerun pgdiag compare with --by step",
        )
    counts: dict[int, int] = {}
    for index, pair in enumerate(rows["pair"].unique(maintain_order=True).to_list()):
        part = rows.filter(pl.col("pair") == pair)
        steps, values, ns = part["step"].to_numpy(), _drawable(part["value"]), part["n"].to_list()
        ax.plot(steps, values, color=f"C{index}", linewidth=1.0, label=pair)
        ax.scatter(steps, values, color=f"C{index}", alpha=[_alpha(n) for n in ns], zorder=3)
        for step, n in zip(steps.tolist(), ns, strict=True):
            counts.setdefault(int(step), int(n))
    unit = str(rows["unit"][0])
    values = _finite_values(rows["value"])
    if _is_magnitude(values):
        ax.set_ylim(bottom=0.0, top=_headroom(values, 1.15))
    _step_axis(ax, sorted(counts), counts)
    ax.set_ylabel(f"{_stat_label(metric)} ({unit})")
    ax.set_title(f"{_stat_label(metric)} per step", fontsize=10)
    _legend(ax, list(counts.values()))
    return fig


def plot_trend(report: Any, kind: str, *, ax: Axes | None = None, marks: Sequence[Mark] = ()) -> Figure:
    """One `TREND_PANELS` plot of a metrics report: its metrics per step, `marks` ringed in red and labelled."""
    if kind not in TREND_PANELS:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"unknown trend plot {kind!r}", f"choose from {', '.join(TREND_PANELS)}"
        )
    panel = TREND_PANELS[kind]
    metrics = trend_metrics(report, kind)
    if not metrics:
        raise UsageError(
            Code.WRONG_PLOT_INPUT, f"the report has no per-step rows for {kind}", _trend_hint(kind)
        )
    if panel.prefix and ax is None:
        return _trend_grid(report, kind, metrics, marks)
    fig, ax = _axes(ax)
    counts: dict[int, int] = {}
    drawn: list[float] = []
    pairs: list[str] = []
    for index, metric in enumerate(metrics):
        rows = _step_rows(report.summary, metric)
        steps, values = rows["step"].to_numpy(), _drawable(rows["value"])
        ax.plot(steps, values, marker="o", markersize=4, color=f"C{index}", linewidth=1.2, label=metric)
        drawn += [v for v in values.tolist() if v == v]
        pairs += [p for p in rows["pair"].unique(maintain_order=True).to_list() if p not in pairs]
        for step, n in zip(steps.tolist(), rows["n"].to_list(), strict=True):
            counts.setdefault(int(step), int(n))
        for mark in marks:
            if mark.metric != metric:
                continue
            hit = rows.filter(pl.col("step") == int(mark.step))
            if hit.height == 0 or hit["value"][0] is None or not abs(hit["value"][0]) < _FLOAT_LIMIT:
                continue
            y = float(hit["value"][0])
            ax.scatter([mark.step], [y], s=140, facecolors="none", edgecolors="red", linewidths=1.8, zorder=4)
            right_half = len(counts) > 1 and mark.step > (min(counts) + max(counts)) / 2
            ax.annotate(
                mark.label,
                (mark.step, y),
                xytext=(-6 if right_half else 6, 6),
                textcoords="offset points",
                ha="right" if right_half else "left",
                fontsize=7,
                color="red",
            )
    if panel.log_y and drawn and min(drawn) > 0:
        ax.set_yscale("log")
    elif panel.from_zero and drawn and min(drawn) >= 0:
        ax.set_ylim(bottom=0.0, top=max(_headroom(np.asarray(drawn), 1.15), 1e-12))
    _step_axis(ax, sorted(counts), counts)
    ax.set_ylabel(f"{panel.unit}" if panel.unit != "loss" else "loss (per the mode's normaliser)")
    ax.set_title(f"{panel.title}\n{', '.join(pairs)}", fontsize=9)
    ax.legend(fontsize=6, loc="best")
    return fig


def _trend_grid(report: Any, kind: str, metrics: Sequence[str], marks: Sequence[Mark]) -> Figure:
    """Small multiples: one axes per metric (the loss modes differ in scale by orders of magnitude)."""
    from matplotlib.figure import Figure

    panel = TREND_PANELS[kind]
    columns = 3
    rows_ = -(-len(metrics) // columns)
    fig = Figure(figsize=(10, 2.4 * rows_ + 0.6), layout="constrained")
    axes = fig.subplots(rows_, columns, squeeze=False).ravel()
    pairs: list[str] = []
    for ax, metric in zip(axes, metrics, strict=False):
        rows = _step_rows(report.summary, metric)
        steps, values = rows["step"].to_numpy(), _drawable(rows["value"])
        ax.plot(steps, values, marker="o", markersize=3, linewidth=1.2)
        ax.axhline(0.0, color="0.6", linewidth=0.6)
        for mark in marks:
            hit = rows.filter(pl.col("step") == int(mark.step)) if mark.metric == metric else rows.clear()
            if hit.height and hit["value"][0] is not None and abs(hit["value"][0]) < _FLOAT_LIMIT:
                ax.scatter(
                    [mark.step], [hit["value"][0]], s=120, facecolors="none", edgecolors="red", zorder=4
                )
        counts = dict(zip(rows["step"].to_list(), rows["n"].to_list(), strict=True))
        _step_axis(ax, sorted(counts), counts)
        ax.set_xlabel("")
        ax.set_title(metric, fontsize=8)
        ax.tick_params(labelsize=7)
        pairs += [p for p in rows["pair"].unique(maintain_order=True).to_list() if p not in pairs]
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"{panel.title} ({panel.unit}, per the mode's normaliser; x: step)\n{', '.join(pairs)}", fontsize=9
    )
    return fig


def trend_metrics(report: Any, kind: str) -> list[str]:
    """The metrics of trend plot `kind` that `report` has per-step values for (at least one not null)."""
    panel = TREND_PANELS[kind]
    summary = getattr(report, "summary", None)
    if summary is None:
        return []
    stepped = summary.filter((pl.col("breakdown") == "step") & pl.col("value").is_not_null())
    present = stepped["metric"].unique(maintain_order=True).to_list()
    if panel.prefix:
        return [m for m in present if m.startswith(panel.prefix)]
    return [m for m in panel.metrics if m in present]


def _trend_hint(kind: str) -> str:
    if kind == "trend-mismatch":
        return "the mismatch family needs a rollout stream beside old (or --stream-a/--stream-b)"
    return "the report needs per-step rows of the policy family (old and new streams)"


def plot_worst_trace(source: Any, *, ax: Axes | None = None) -> Figure:
    """Both log-prob streams along the worst sequence (a `worst_trace` frame), with Δ on a twin axis."""
    if not isinstance(source, pl.DataFrame) or not {"resp_pos", "lp_a", "lp_b"} <= set(source.columns):
        raise UsageError(
            Code.WRONG_PLOT_INPUT, "the worst-trace plot needs a trace table (resp_pos, lp_a, lp_b)"
        )
    fig, ax = _axes(ax)
    pair = str(source["pair"][0]) if "pair" in source.columns and source.height else ""
    name_a, name_b = stream_names(pair)
    x = source["resp_pos"].to_numpy()
    lp_a, lp_b = source["lp_a"].to_numpy(), source["lp_b"].to_numpy()
    twin = ax.twinx()
    bars = twin.bar(x, lp_b - lp_a, color="grey", alpha=0.35, label=f"Δ = {name_b} − {name_a}")
    twin.set_ylabel("Δ (nats)")
    line_a = ax.plot(x, lp_a, label=name_a, linewidth=1.2, marker=".")
    line_b = ax.plot(x, lp_b, label=name_b, linewidth=1.2, linestyle="--", marker=".")
    ax.set_zorder(twin.get_zorder() + 1)  # the streams above the Δ bars
    ax.patch.set_visible(False)
    if source.height:
        ax.set_title(
            f"worst sequence: step {source['step'][0]}, sample {source['sample_id'][0]}"
            f"  ({source.height} tokens)",
            fontsize=10,
        )
    ax.set_xlabel("response position (tokens)")
    ax.set_ylabel("log-prob (nats)")
    ax.legend(handles=[*line_a, *line_b, bars], loc="lower left", fontsize=7)
    return fig


def _report_kind(report: Any) -> str:
    return str(getattr(report, "kind", "compare"))


def build_figures(
    report: Any = None,
    *,
    kinds: Sequence[str] = ("all",),
    tokens: Any = None,
    trace: pl.DataFrame | None = None,
    marks: Sequence[Mark] = (),
) -> PlotSet:
    """Draw `kinds` ("all" = every kind the sources support) from a report, token data and a worst trace.

    A kind named explicitly whose data is absent raises `UsageError` E503; under "all" it lands in
    `PlotSet.skipped` with the reason (no token data, near-equal runs for the hexbin, no per-step rows, ...).
    """
    wanted_all = "all" in kinds
    if report is None and tokens is None:
        raise UsageError(Code.WRONG_PLOT_INPUT, "nothing to plot: give a report or token data")
    if wanted_all:
        if report is None:
            candidates: tuple[str, ...] = TOKEN_KINDS
        elif _report_kind(report) == "metrics":
            candidates = TREND_KINDS
        elif _report_kind(report) == "whatif":
            candidates = ("whatif",)
        elif _report_kind(report) == "drift":  # its per-step rows are metrics': their trend plots too
            candidates = ("drift", *TREND_KINDS)
        elif _report_kind(report) == "explain":
            candidates = ("explain-shares", "layers")
        else:
            candidates = COMPARE_KINDS
    else:
        candidates = tuple(dict.fromkeys(kinds))
    figures: dict[str, Figure] = {}
    skipped: dict[str, str] = {}
    for kind in candidates:
        reason = _missing(kind, report, tokens, trace, wanted_all)
        if reason is not None:
            if not wanted_all:
                raise UsageError(Code.WRONG_PLOT_INPUT, f"plot {kind}: {reason}")
            skipped[kind] = reason
            continue
        figures[kind] = _draw(kind, report, tokens, trace, marks)
    return PlotSet(figures, skipped)


def _missing(kind: str, report: Any, tokens: Any, trace: pl.DataFrame | None, wanted_all: bool) -> str | None:
    """Why `kind` cannot (or, under "all", should not) be drawn from these sources; None when it can."""
    if kind not in ALL_KINDS:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"unknown plot kind {kind!r}", f"choose from {', '.join(ALL_KINDS)}, all"
        )
    if kind in ("dlogp-vs-logprob", "hexbin"):
        if tokens is None:
            return "needs token data: write it with compare --tokens-out and plot that table"
        lp_a, lp_b, _ = _token_arrays(tokens)
        if kind == "hexbin" and wanted_all and near_equal(lp_a, lp_b):
            p99 = float(np.quantile(np.abs(lp_b - lp_a), 0.99)) if lp_a.size else 0.0
            return (
                f"near-equal runs (p99 |Δ| = {p99:.3g} nats, under one hexagon): every token sits on y = x; "
                "dlogp-vs-logprob shows Δ instead (ask for --kind hexbin to draw it anyway)"
            )
        return None
    if kind == "dlogp-hist":
        if report is not None and _has(report, "dlogp"):
            return None
        return None if tokens is not None else "needs a report with Δ-histogram rows or token data"
    if report is None:
        return "needs a report"
    if kind in TREND_KINDS:
        if _report_kind(report) != "metrics" and not trend_metrics(report, kind):
            return "a trend plot of a metrics report (pgdiag metrics --out)"
        key_style = (getattr(report, "meta", {}).get("settings") or {}).get("key_style")
        if not trend_metrics(report, kind) and key_style not in (None, "pgdiag"):
            return f"trend plots read pgdiag's own keys; this report has --key-style {key_style} keys"
        if not trend_metrics(report, kind):
            return f"no per-step values of {', '.join(TREND_PANELS[kind].metrics) or 'loss/*'}: {_trend_hint(kind)}"
        return None
    if kind == "worst-trace":
        return (
            None if trace is not None else "needs the worst trace (compare --out writes it beside the report)"
        )
    if kind == "whatif":
        return None if _has(report, "threshold") else "needs a whatif report (pgdiag whatif --out)"
    if kind == "drift":
        return None if _has(report, "step") else "needs per-step rows (pgdiag drift --out)"
    if kind == "explain-shares":
        shares = _report_kind(report) == "explain" and (getattr(report, "meta", {}) or {}).get("explain")
        return None if shares else "needs an explain report (pgdiag explain --out)"
    if kind == "layers":
        return None if (getattr(report, "meta", {}) or {}).get("layers") else "needs explain --layers"
    breakdown = {"by-prob": "prob_bucket", "by-position": "position", "by-step": "step"}[kind]
    if not _has(report, breakdown):
        return f"the report has no {breakdown} breakdown (compare --by {breakdown})"
    return None


def _has(report: Any, breakdown: str) -> bool:
    summary = getattr(report, "summary", None)
    return summary is not None and summary.filter(pl.col("breakdown") == breakdown).height > 0


def _draw(kind: str, report: Any, tokens: Any, trace: pl.DataFrame | None, marks: Sequence[Mark]) -> Figure:
    if kind == "dlogp-vs-logprob":
        return plot_dlogp_vs_logprob(tokens)
    if kind == "hexbin":
        return plot_hexbin(tokens)
    if kind == "dlogp-hist":
        return plot_dlogp_hist(report if report is not None and _has(report, "dlogp") else tokens)
    if kind == "by-prob":
        return plot_by_prob(report)
    if kind == "by-position":
        return plot_by_position(report)
    if kind == "by-step":
        return plot_by_step(report)
    if kind == "worst-trace":
        return plot_worst_trace(trace)
    if kind == "whatif":
        return plot_whatif(report)
    if kind == "drift":
        return plot_drift(report)
    if kind in ("explain-shares", "layers"):
        from pgdiag.report import explain_plots

        return (
            explain_plots.plot_shares(report)
            if kind == "explain-shares"
            else explain_plots.plot_layers(report)
        )
    return plot_trend(report, kind, marks=marks)


def plot_whatif(report: Any, *, ax: Axes | None = None) -> Figure:
    """Data kept (fraction of tokens) vs token ESS after each correction rule of a whatif report, one marker per
    rule family, each point labelled with its thresholds; the uncorrected batch (ESS before) is a dashed line."""
    summary = report.summary.filter(pl.col("breakdown") == "threshold")
    wide = summary.pivot(on="metric", index="bucket", values="value", aggregate_function="first")
    needed = {"whatif/tokens_kept", "whatif/ess_token_after"}
    if not needed <= set(wide.columns):
        raise UsageError(Code.WRONG_PLOT_INPUT, "the whatif plot needs a whatif report (threshold rows)")
    fig, ax = _axes(ax)
    rules = wide.filter(pl.col("bucket") != "none")
    families: dict[str, list[tuple[float, float, str]]] = {}
    for bucket, kept, ess in rules.select(
        "bucket", "whatif/tokens_kept", "whatif/ess_token_after"
    ).iter_rows():
        if not (_plottable(kept) and _plottable(ess)):
            continue  # null, NaN, ±inf or overflowing in a damaged report: no point
        family, _, threshold = str(bucket).partition(":")
        families.setdefault(family, []).append((float(kept), float(ess), threshold))
    markers = "osD^vP*X"
    for i, (family, points) in enumerate(families.items()):
        xs, ys, _ = zip(*points, strict=True)
        ax.scatter(xs, ys, marker=markers[i % len(markers)], label=family)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    before = wide.filter(pl.col("bucket") == "none")
    if before.height and "whatif/ess_token" in before.columns and _plottable(before["whatif/ess_token"][0]):
        ax.axhline(before["whatif/ess_token"][0], linestyle="--", color="grey", label="no correction")
    ax.set_xlabel("tokens kept (fraction)")
    ax.set_ylabel("token ESS after the rule (fraction)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"whatif: data kept vs ESS ({report.meta.get('pairs', [''])[0]})")
    ax.legend(fontsize=8)
    return fig


def _plottable(value: Any) -> bool:
    """A number matplotlib can place: not null, NaN, ±inf or within 16x of the float range."""
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < _FLOAT_LIMIT


def _change_points(report: Any) -> list[dict[str, Any]]:
    """The change points a drift report's meta lists, each with a metric name and a plottable step, jump and
    level after (entries of a damaged report lacking one are left out)."""
    found = (report.meta.get("change_points") or {}).get("found") or []
    return [
        cp
        for cp in found
        if isinstance(cp, Mapping)
        and isinstance(cp.get("metric"), str)
        and all(_plottable(cp.get(key)) for key in ("step", "jump", "after"))
    ]


def plot_drift(report: Any, *, metrics: Sequence[str] = ()) -> Figure:
    """Small multiples of a drift report: each searched headline metric per step, its change points as dashed
    vertical lines labelled with the jump. `metrics` empty: the series that have change points, else the first
    four per-step metrics."""
    from matplotlib.figure import Figure

    found = _change_points(report)
    step_metrics = (
        report.summary.filter(pl.col("breakdown") == "step")["metric"].unique(maintain_order=True).to_list()
    )
    if not step_metrics:
        raise UsageError(
            Code.WRONG_PLOT_INPUT, "the drift plot needs per-step rows (a drift or metrics report)"
        )
    chosen = list(metrics) or list(dict.fromkeys(cp["metric"] for cp in found)) or step_metrics[:4]
    columns = min(2, len(chosen))
    grid_rows = (len(chosen) + columns - 1) // columns
    fig = Figure(figsize=(FIGSIZE[0] * columns * 0.8, FIGSIZE[1] * grid_rows * 0.7), layout="constrained")
    for index, metric in enumerate(chosen):
        ax = fig.add_subplot(grid_rows, columns, index + 1)
        rows = _step_rows(report.summary, metric)
        ax.plot(rows["step"].to_numpy(), _drawable(rows["value"]), marker="o", markersize=3)
        for cp in (c for c in found if c["metric"] == metric):
            ax.axvline(cp["step"] - 0.5, color="red", linestyle="--", linewidth=1)
            ax.annotate(
                f"step {cp['step']}: {cp['jump']:+.3g}", (cp["step"], cp["after"]), xytext=(4, 4),
                textcoords="offset points", fontsize=7, color="red",
            )  # fmt: skip
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(str(rows["unit"][0]) if rows.height else "")
    fig.suptitle(f"drift: {', '.join(report.meta.get('pairs', [])[:1])}", fontsize=9)
    return fig
