"""Each run's own metric set beside the comparison (`pgdiag compare --metrics`, issue 5 "metrics side by side").

What: `side_by_side_rows(runs, labels, streams, settings, checks)` runs `pgdiag.compute_metrics` on each run (any
aggregation, any key style through its `MetricSettings`) and returns its rows with scope `batch`, per step and pooled, plus
for two runs the deltas b − a of the pooled values (pair ``"<b> - <a>"``).
Why: a parity table says the log-probs differ; the side-by-side metrics say what that does to the clip fractions,
KL and losses each trainer logs. Scope `batch` keeps these rows out of compare's gates, and each run's own
`mismatch/*` keys are left out: the compared pair is the mismatch this command reports.
How: the compared stream is each run's `new`; its `old` is ``old``, else ``rollout``, when that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import polars as pl

from pgdiag.data.validate import CheckSettings
from pgdiag.errors import UsageError
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.report import ReportRow


def metric_streams(run: Any, stream: str, settings: MetricSettings) -> MetricSettings:
    """`settings` with the compared stream as `new` and `old` the other canonical behaviour stream, unless set."""
    new = settings.new if settings.new is not None else (stream if stream != "rollout" else None)
    old = settings.old
    if old is None and new is not None:
        other = [s for s in ("old", "rollout") if s in run.streams and s != new]
        old = other[0] if other else None
    return replace(settings, new=new, old=old)


def side_by_side_rows(
    runs: tuple[Any, Any],
    labels: tuple[str, str],
    streams: tuple[str, str],
    settings: MetricSettings,
    checks: CheckSettings,
) -> list[ReportRow]:
    """Rows of scope `batch` for run a (and run b when `runs[1]` is not None) and the deltas b − a.

    `runs` are `Run`s (None for b with one run), `labels` the report labels of a and b, `streams` the compared
    streams of a and b (one run: b's stream is the one whose metrics are reported).
    """
    run_a, run_b = runs
    if run_a is None:
        raise UsageError("E503", "side-by-side metrics need runs read from disk, not in-memory batches")
    from pgdiag.metrics.api import compute_metrics

    one_run = run_b is None
    sides: Sequence[tuple[str, Any, str]] = (
        [(labels[0], run_a, streams[1])]
        if one_run
        else [(labels[0], run_a, streams[0]), (labels[1], run_b, streams[1])]
    )
    rows: list[ReportRow] = []
    pooled: dict[str, dict[str, tuple[float | None, str, str]]] = {}
    for label, run, stream in sides:
        report = compute_metrics(run, metric_streams(run, stream, settings), checks=checks)
        frame = report.summary.filter(
            pl.col("breakdown").is_in(["all", "step"]) & ~pl.col("metric").str.starts_with("mismatch/")
        )
        for r in frame.iter_rows(named=True):
            rows.append(
                ReportRow(
                    r["pair"].replace(f"{run.label}:", f"{label}:"),
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
                pooled.setdefault(label, {})[r["metric"]] = (r["value"], r["unit"], r["reduction"])
    if not one_run:
        la, lb = labels
        for metric, (vb, unit, reduction) in pooled.get(lb, {}).items():
            va = pooled.get(la, {}).get(metric, (None,))[0]
            delta = None if va is None or vb is None else vb - va
            rows.append(ReportRow(f"{lb} - {la}", "batch", "all", "all", metric, delta, unit, reduction, 0))
    return rows
