"""A saved report as text without recomputation: the headline rows of each report kind, and a Markdown summary
sized for a CI comment (`pgdiag report REPORT --markdown PATH`, docs/cli.md).

Headline rows: `metrics` and `compare` the pooled rows (``breakdown = all``); `whatif` one row per rule
(``breakdown = threshold``); `drift` one row per change point (``breakdown = changepoint``).
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from pgdiag.report.report import Report

HEADLINE_BREAKDOWN = {"metrics": "all", "compare": "all", "whatif": "threshold", "drift": "changepoint"}
MAX_MARKDOWN_ROWS = 40  # a CI comment stays short: the first rows, then a count of the rest


def headline_rows(report: Report) -> pl.DataFrame:
    """The tidy rows that summarise `report` (pair, scope, bucket, metric, value, unit, n), in report order."""
    breakdown = HEADLINE_BREAKDOWN.get(report.kind, "all")
    rows = report.summary.filter(pl.col("breakdown") == breakdown)
    return rows.select("pair", "scope", "bucket", "metric", "value", "unit", "n")


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-4):
        return f"{value:.4e}"
    return f"{value:.6g}"


def report_markdown(report: Report, gates: list[dict[str, Any]], status: str) -> str:
    """A Markdown summary: kind, pairs, gate verdict and failing gates, and the headline rows (capped)."""
    pairs = ", ".join(report.meta.get("pairs", [])) or "—"
    lines = [f"### pgdiag {report.kind}: {status}", "", f"pairs: {pairs}", ""]
    failing = [g for g in gates if g.get("status") not in ("pass", "skipped")]
    if gates:
        lines.append(f"gates: {len(gates)} evaluated, {len(failing)} not passing")
        for gate in failing:
            where = f" [{gate['pair']}]" if gate.get("pair") else ""
            lines.append(f"- **{gate['status']}** `{gate['expr']}`{where}: {_number(gate.get('value'))}")
        lines.append("")
    rows = headline_rows(report)
    lines += ["| pair | bucket | metric | value |", "|---|---|---|---|"]
    for pair, _, bucket, metric, value, _, _ in rows.head(MAX_MARKDOWN_ROWS).iter_rows():
        lines.append(f"| {pair} | {bucket} | `{metric}` | {_number(value)} |")
    if rows.height > MAX_MARKDOWN_ROWS:
        lines.append(f"\n… {rows.height - MAX_MARKDOWN_ROWS} more rows in the report.")
    return "\n".join(lines) + "\n"
