"""The tables of a `drift` report's HTML page (`report.html.render_html` calls `drift_tables`).

The change points found (step, metric, level before and after, jump, z score), the per-step series searched for
them with the first step of each new level in red, and every per-step metric folded by family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import polars as pl

from pgdiag.report.html_cells import _e, _num, _table
from pgdiag.report.report import Report

if TYPE_CHECKING:
    from pgdiag.report.plots import Mark


def _series_table(
    per_step: Mapping[tuple[str, str], float | None],
    units: Mapping[str, str],
    steps: Sequence[str],
    metrics: Sequence[str],
    marked: Mapping[tuple[str, str], str],
) -> str:
    """Rows = steps, columns = `metrics` (with their units); cells in `marked` are red with the label as tooltip."""
    header = ["step", *[f"{m} ({units[m]})" if units.get(m) else m for m in metrics]]
    body = []
    for step in steps:
        row = [step]
        for metric in metrics:
            text = _num(per_step.get((step, metric)), units.get(metric, ""))
            label = marked.get((metric, step))
            row.append(f'<td class="anomaly" title="{_e(label)}">{_e(text)}</td>' if label else text)
        body.append(row)
    return _table(header, body)


def drift_tables(report: Report, marks: Sequence[Mark]) -> str:
    summary = report.summary
    meta = report.meta.get("change_points") or {}
    found = meta.get("found") or []
    score = {(str(cp["metric"]), str(cp["step"])): cp.get("score") for cp in found}
    points = summary.filter(pl.col("breakdown") == "changepoint")
    parts = [
        f"<h3>change points <span class='note'>({len(found)}; {_e(meta.get('method', ''))}, z ≥ "
        f"{_e(_num(meta.get('threshold')))}; the step is the first of the new level)</span></h3>"
    ]
    if points.height:
        body = [
            [
                str(step), metric, pair, _num(lo, unit), _num(hi, unit), _num(jump, unit),
                _num(score.get((metric, str(step)))), f'<td class="unit">{_e(unit)}</td>',
            ]
            for step, metric, pair, lo, hi, jump, unit in points.select(
                "bucket", "metric", "pair", "bucket_lo", "bucket_hi", "value", "unit"
            ).iter_rows()
        ]  # fmt: skip
        parts.append(_table(["step", "metric", "pair", "before", "after", "jump", "z", "unit"], body, left=3))
    else:
        parts.append("<p class='note'>No change point: no searched series changed level.</p>")
    rows = summary.filter(pl.col("breakdown") == "step")
    steps = sorted(
        rows["bucket"].unique().to_list(), key=lambda b: (int(b) if b.lstrip("-").isdigit() else 0, b)
    )
    per_step = {(b, m): v for b, m, v in rows.select("bucket", "metric", "value").iter_rows()}
    units = dict(rows.select("metric", "unit").unique("metric", keep="first").iter_rows())
    present = rows["metric"].unique(maintain_order=True).to_list()
    # the series searched (older reports: those with a change point)
    series = list(
        dict.fromkeys(
            [*(m for m in meta.get("series") or [] if m in present), *(str(cp["metric"]) for cp in found)]
        )
    )
    marked = {(m.metric, str(m.step)): m.label for m in marks}
    if series:
        parts.append(
            "<h3>per-step series searched for change points <span class='note'>(red: the first step of a new "
            "level)</span></h3>"
        )
        parts.append(_series_table(per_step, units, steps, series, marked))
    families: dict[str, list[str]] = {}
    for metric in present:
        families.setdefault(metric.split("/", 1)[0] if "/" in metric else "metrics", []).append(metric)
    for family, metrics in families.items():
        parts.append(
            f"<details><summary>{_e(family)} per step: {len(metrics)} metrics</summary>"
            + _series_table(per_step, units, steps, metrics, marked)
            + "</details>"
        )
    return "".join(parts)
