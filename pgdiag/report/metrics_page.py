"""The tables of a `metrics` report's HTML page (`report.html.render_html` calls `metrics_tables`).

One table per metric family (policy, loss, mismatch, ... in `FAMILY_ORDER`; the long and rarely read first
`grad` and `count` families folded), a metric per row with its pooled value, one column per step and its unit;
the anomalies of the verdict (`marks`) are red cells with their label as tooltip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import polars as pl

from pgdiag.report.html_cells import _e, _num, _table
from pgdiag.report.report import Report

if TYPE_CHECKING:
    from pgdiag.report.plots import Mark

FAMILY_ORDER = ("policy", "loss", "mismatch", "advantage", "entropy", "group", "grad", "count")
COLLAPSED_FAMILIES = ("grad", "count")  # long and rarely read first: folded


def metrics_tables(report: Report, marks: Sequence[Mark]) -> str:
    summary = report.summary
    steps = summary.filter(pl.col("breakdown") == "step")["bucket"].unique(maintain_order=True).to_list()
    per_step = {
        (bucket, metric): value
        for bucket, metric, value in summary.filter(pl.col("breakdown") == "step")
        .select("bucket", "metric", "value")
        .iter_rows()
    }
    marked = {(m.metric, str(m.step)): m.label for m in marks}
    pooled = summary.filter(pl.col("breakdown") == "all")
    families: dict[str, list[tuple[str, str, float | None, str]]] = {}
    for pair, metric, value, unit in pooled.select("pair", "metric", "value", "unit").iter_rows():
        family = metric.split("/", 1)[0] if "/" in metric else "metrics"
        families.setdefault(family, []).append((pair, metric, value, unit))
    last = len(FAMILY_ORDER)
    ordered = sorted(families, key=lambda f: FAMILY_ORDER.index(f) if f in FAMILY_ORDER else last - 2.5)
    parts = []
    for family in ordered:
        rows = families[family]
        pairs = sorted({r[0] for r in rows})
        body = []
        for _pair, metric, value, unit in rows:
            cells = [metric, _num(value, unit)]
            for step in steps:
                text = _num(per_step.get((step, metric)), unit)
                label = marked.get((metric, str(step)))
                cells.append(f'<td class="anomaly" title="{_e(label)}">{_e(text)}</td>' if label else text)
            cells.append(f'<td class="unit">{_e(unit)}</td>')
            body.append(cells)
        table = _table(["metric", "all", *[f"step {s}" for s in steps], "unit"], body)
        heading = f"{_e(family)} <span class='note'>({_e(', '.join(pairs))})</span>"
        if family in COLLAPSED_FAMILIES:
            parts.append(f"<details><summary>{heading}: {len(rows)} metrics</summary>{table}</details>")
        else:
            parts.append(f"<h3>{heading}</h3>{table}")
    return "".join(parts)
