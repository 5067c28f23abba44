"""The figures of an `explain` report: cause shares per response-position bucket, and the layer-wise errors.

`plot_shares(report)`: one stacked bar per position bucket (and one for all tokens), each cause's share of that
bucket's mismatch (``explain/<cause>`` rows). `plot_layers(report)`: the cumulative and the local error per layer
of `explain --layers` (``meta["layers"]``, log scale), the first divergent layer marked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import polars as pl

from pgdiag.errors import Code, UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure() -> tuple[Figure, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5), layout="constrained")
    return fig, fig.add_subplot()


def plot_shares(report: Any) -> Figure:
    """Stacked shares of every cause per response-position bucket (module docstring)."""
    rows = report.summary.filter(
        pl.col("metric").str.starts_with("explain/")
        & ~pl.col("metric").str.starts_with("explain/k3")
        & (pl.col("metric") != "explain/abs_mean")
        & pl.col("breakdown").is_in(["all", "position"])
    )
    if rows.height == 0:
        raise UsageError(
            Code.WRONG_PLOT_INPUT, "the explain plot needs an explain report (explain/<cause> rows)"
        )
    buckets = rows["bucket"].unique(maintain_order=True).to_list()
    causes = [m.removeprefix("explain/") for m in rows["metric"].unique(maintain_order=True).to_list()]
    fig, ax = _figure()
    bottom = [0.0] * len(buckets)
    for cause in causes:
        values = []
        for bucket in buckets:
            cell = rows.filter((pl.col("bucket") == bucket) & (pl.col("metric") == f"explain/{cause}"))[
                "value"
            ]
            values.append(float(cell[0]) if cell.len() and cell[0] is not None else 0.0)
        if any(values):
            ax.bar(buckets, values, bottom=bottom, label=cause)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("response position (all = every token)")
    ax.set_ylabel("share of the bucket's k3")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"explain: causes by position ({report.meta.get('pairs', [''])[0]})")
    ax.legend(fontsize=7, loc="upper right")
    return fig


def plot_layers(report: Any) -> Figure:
    """Cumulative and local error per layer, log scale, the first divergent layer marked."""
    layers = (getattr(report, "meta", {}) or {}).get("layers")
    if not layers:
        raise UsageError(Code.WRONG_PLOT_INPUT, "the layers plot needs explain --layers")
    fig, ax = _figure()
    index = [row["layer"] for row in layers["rows"]]
    for key, label in (("cumulative", "cumulative error"), ("local", "local error (A's input)")):
        values = [float("nan") if row[key] is None else max(row[key], 1e-30) for row in layers["rows"]]
        ax.plot(index, values, marker="o", label=label)  # NaN: a dump without the block's input
    first = layers.get("first_divergent")
    if first is not None:
        ax.axvline(first, color="red", linestyle="--", label=f"first divergent layer {first}")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative RMS error of the block output")
    ax.set_title(f"layers: {layers['config_a']} vs {layers['config_b']}")
    ax.legend(fontsize=8)
    return fig
