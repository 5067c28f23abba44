"""Terminal tables of `pgdiag explain`: the causes with their shares, and the layer-wise divergence."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from pgdiag.report.format import format_value


def render_explain(console: Console, result: Any) -> None:
    """One row per cause (largest share first): share, k3 and mean |Δ| before and after its removal."""
    table = Table(
        title=f"explain {result.pair[0]} vs {result.pair[1]}: {result.n_tokens} tokens, k3 "
        f"{format_value(result.k3, 'nats')}, mean |Δ| {format_value(result.abs_mean, 'nats')}",
        title_justify="left",
        box=box.SIMPLE,
    )
    for header in ("cause", "share", "k3 before", "k3 after", "|Δ| before", "|Δ| after"):
        table.add_column(header, justify="left" if header == "cause" else "right")
    for cause in result.causes:
        table.add_row(
            cause.cause,
            f"{100 * cause.share:.1f} %",
            format_value(cause.k3_before, "nats"),
            format_value(cause.k3_after, "nats"),
            format_value(cause.abs_mean_before, "nats"),
            format_value(cause.abs_mean_after, "nats"),
        )
    console.print(table)
    if result.by_position:
        shown = ", ".join(
            f"{bucket}: {causes[0].cause} {100 * causes[0].share:.0f} %"
            for bucket, causes in result.by_position.items()
        )
        console.print(f"top cause per response position: {shown}", markup=False)
    fired = [s["name"] for s in result.signatures if s["fired"]]
    console.print(f"signatures fired: {', '.join(fired) or 'none'}", markup=False)
    if result.skipped:
        for name, why in result.skipped.items():
            console.print(f"skipped {name}: {why}", markup=False)
    console.print(
        f"recompute tags in {result.token_run}: {', '.join(result.configs)} (compare any two with "
        f"pgdiag compare {result.token_run} --stream-a A --stream-b B)",
        markup=False,
    )


def render_layers(console: Console, found: Any) -> None:
    """Per layer: cumulative and local error, route flips (MoE); the first divergent layer last."""
    table = Table(
        title=f"layers {found.config_a} vs {found.config_b}: {found.n_tokens} tokens",
        title_justify="left",
        box=box.SIMPLE,
    )
    for header in ("layer", "cumulative", "local", "route flips"):
        table.add_column(header, justify="right")
    for row in found.rows:
        flips = "" if row.route_flips is None else f"{100 * row.route_flips:.2f} %"
        local = "n/a" if row.local is None else f"{row.local:.3g}"
        table.add_row(str(row.layer), f"{row.cumulative:.3g}", local, flips)
    console.print(table)
    where = "none" if found.first_divergent is None else f"layer {found.first_divergent}"
    console.print(f"first divergent layer (local error): {where}", markup=False)
    for what, why in found.skipped.items():
        console.print(f"skipped {what}: {why}", markup=False)
