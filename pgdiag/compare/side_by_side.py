"""Each run's own metric set beside the comparison (`pgdiag compare --metrics`).

What: `side_settings` picks each side's `MetricSettings` (the compared stream as `new`, the other canonical
behaviour stream as `old`, resolved against the run) before the run is read, so `compare` reads each run once
with the union of the streams both need; `side_by_side_rows` then runs `metrics.api.metrics_report` on those
batches (any aggregation, any key style) and returns its rows with scope `batch`, per step and pooled, plus for
two runs the deltas b − a of the pooled values (pair ``"<b> - <a>"``).
Why: a parity table says the log-probs differ; the side-by-side metrics say what that does to the clip fractions,
KL and losses each trainer logs. Scope `batch` keeps these rows out of compare's gates, and each run's own
`mismatch/*` keys are left out: the compared pair is the mismatch this command reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.errors import UsageError
from pgdiag.metrics.api import metrics_report, resolve_streams
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.report import ReportRow


@dataclass(frozen=True)
class MetricSide:
    """One run whose own metrics are shown: its report label, the run, its batch and resolved settings."""

    label: str
    run: Any  # `Run`
    batch: TokenBatch
    settings: MetricSettings


def side_settings(run: Any, stream: str, settings: MetricSettings) -> MetricSettings:
    """`settings` with the compared stream as `new` and `old` the other canonical behaviour stream (unless set),
    every stream resolved against `run` (`metrics.api.resolve_streams`)."""
    if run is None:
        raise UsageError("E512", "side-by-side metrics need runs read from disk, not in-memory batches")
    new = settings.new if settings.new is not None else (stream if stream != "rollout" else None)
    old = settings.old
    if old is None and new is not None:
        other = [s for s in ("old", "rollout") if s in run.streams and s != new]
        old = other[0] if other else None
    return resolve_streams(run, replace(settings, new=new, old=old))


def side_by_side_rows(sides: Sequence[MetricSide]) -> list[ReportRow]:
    """Rows of scope `batch` for each side and, with two sides, the deltas of the pooled values b − a."""
    rows: list[ReportRow] = []
    pooled: dict[str, dict[str, tuple[float | None, str, str]]] = {}
    for side in sides:
        report = metrics_report(side.batch, side.settings, run=side.run)
        frame = report.summary.filter(
            pl.col("breakdown").is_in(["all", "step"]) & ~pl.col("metric").str.starts_with("mismatch/")
        )
        for r in frame.iter_rows(named=True):
            rows.append(
                ReportRow(
                    r["pair"].replace(f"{side.run.label}:", f"{side.label}:"),
                    "batch",
                    r["breakdown"],
                    r["bucket"],
                    r["metric"],
                    r["value"],
                    r["unit"],
                    r["reduction"],
                    r["n"],
                    r["bucket_lo"],
                    r["bucket_hi"],
                )
            )
            if r["breakdown"] == "all":
                pooled.setdefault(side.label, {})[r["metric"]] = (r["value"], r["unit"], r["reduction"])
    if len(sides) == 2:
        la, lb = sides[0].label, sides[1].label
        for metric, (vb, unit, reduction) in pooled.get(lb, {}).items():
            va = pooled.get(la, {}).get(metric, (None,))[0]
            delta = None if va is None or vb is None else vb - va
            rows.append(ReportRow(f"{lb} - {la}", "batch", "all", "all", metric, delta, unit, reduction, 0))
    return rows
