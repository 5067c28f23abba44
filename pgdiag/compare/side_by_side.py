"""Each run's own metric set beside the comparison (`pgdiag compare --metrics`).

What: `side_settings` picks each side's `MetricSettings` (the compared stream as `new`, the other canonical
behaviour stream as `old`, resolved against the run) before the run is read, so `compare` reads each run once
with the union of the streams both need; a `SideMetrics` per shown run is fed each piece's batch of that run
(`add`, the metrics engine `pgdiag metrics` streams with: `NativeStream`, or `StyleStream` for a key style), and
`side_by_side_rows` turns them into rows with scope `batch`, per step and pooled, plus for two runs the deltas
b − a of the pooled values (pair ``"<b> - <a>"``).
Why: a parity table says the log-probs differ; the side-by-side metrics say what that does to the clip fractions,
KL and losses each trainer logs. Scope `batch` keeps these rows out of compare's gates, and each run's own
`mismatch/*` keys are left out: the compared pair is the mismatch this command reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.pooled import QuantileSettings
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.report import Report, ReportRow


class SideMetrics:
    """One run's own metric set, accumulated piece by piece as `compare` reads the run (docs/compare.md).

    `add(batch)` feeds one piece's batch of this run (pieces in step order, never splitting a step, as
    `pgdiag metrics` reads chunks) and keeps only per-step rows, per-sample tables and the pooled token
    summaries; `report()` gives the metrics `Report` the same run would get from `compute_metrics` read in the
    same chunks (the ``all`` token quantiles exact up to `quantiles.exact_limit`, then sketched, with its notice).
    """

    def __init__(
        self, label: str, run: Any, settings: MetricSettings, quantiles: QuantileSettings | None = None
    ) -> None:
        from pgdiag.metrics.engine import NativeStream
        from pgdiag.metrics.styles.steps import StyleStream

        self.label = label  # the run's label in the comparison
        self.run = run  # `Run`
        self.settings = settings  # resolved against `run` (`side_settings`)
        self.quantiles = quantiles or QuantileSettings()
        self.engine = (
            NativeStream(settings, self.quantiles)
            if settings.key_style == "pgdiag"
            else StyleStream(settings)
        )
        self.n_samples = 0
        self.n_tokens = 0

    def add(self, batch: TokenBatch) -> None:
        """Reduce one piece's batch of this run (its per-step rows and what the ``all`` row needs)."""
        self.engine.add(batch)
        self.n_samples += batch.n_samples
        self.n_tokens += batch.n_tokens

    def report(self) -> Report:
        """The metrics report of every piece added (step rows, the pooled ``all`` row, quantile meta)."""
        from pgdiag.metrics.api import stream_report  # imported with --metrics only (see `side_settings`)

        return stream_report(
            self.engine,
            self.settings,
            run=self.run,
            n_samples=self.n_samples,
            n_tokens=self.n_tokens,
            quantiles=self.quantiles,
        )


def side_settings(run: Any, stream: str, settings: MetricSettings) -> MetricSettings:
    """`settings` with the compared stream as `new` and `old` the other canonical behaviour stream (unless set),
    every stream resolved against `run` (`metrics.api.resolve_streams`). `metrics.api` is imported here, when
    `--metrics` asks for side-by-side metrics: a plain compare does not pay its import (~0.04 s)."""
    from pgdiag.metrics.api import resolve_streams

    if run is None:
        raise UsageError(
            Code.NEEDS_RUN_ON_DISK, "side-by-side metrics need runs read from disk, not in-memory batches"
        )
    new = settings.new if settings.new is not None else (stream if stream != "rollout" else None)
    old = settings.old
    if old is None and new is not None:
        other = [s for s in ("old", "rollout") if s in run.streams and s != new]
        old = other[0] if other else None
    return resolve_streams(run, replace(settings, new=new, old=old))


def side_by_side_rows(sides: Sequence[SideMetrics]) -> tuple[list[ReportRow], dict[str, Any]]:
    """Rows of scope `batch` for each side and, with two sides, the deltas of the pooled values b − a; also
    each side's pooled-quantile meta and notices by label (compare's ``side_metrics`` meta)."""
    rows: list[ReportRow] = []
    meta: dict[str, Any] = {}
    pooled: dict[str, dict[str, tuple[float | None, str, str]]] = {}
    for side in sides:
        report = side.report()
        meta[side.label] = {
            "pooled_quantiles": report.meta["pooled_quantiles"],
            "notices": list(report.meta["notices"]),
        }
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
    return rows, meta
