"""`drift`: every metric of `metrics` per step over a whole run, read in chunks of whole steps, and the change points
of the headline series (docs/drift.md).

Memory: the run is never loaded at once. The step list comes from the `step` column alone; each step is then
read, validated and reduced to its metric rows by `compute_metrics` (the same code as `pgdiag metrics`), and
only those rows are kept, so peak memory is one step's batch plus a few numbers per step.

Change points: binary segmentation with the standardised CUSUM statistic of a single mean shift. For a series
x of n steps and a split k, z_k = |mean(x[k:]) − mean(x[:k])|·√(k(n−k)/n)/σ, σ the robust noise scale
MAD(Δx)/(0.6745·√2) of the segment searched (first differences, so a jump barely moves it). The best split with
z ≥ threshold is a change point (the step where the new level starts); both halves are searched again, each with
its own σ, down to `min_steps` steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from pgdiag.analysis.settings import DRIFT_HEADLINE, ChangePointSettings
from pgdiag.data.runs import Run
from pgdiag.data.validate import CheckSettings
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.report import Report, ReportRow, summary_frame

if TYPE_CHECKING:
    from pgdiag.metrics.api import StreamSettings


@dataclass(frozen=True)
class ChangePoint:
    """A level shift of `metric` starting at `step`: `jump` = mean after − mean before, `score` the z of it."""

    metric: str
    step: int
    jump: float
    before: float
    after: float
    score: float


def robust_sigma(x: np.ndarray) -> float:
    """Noise scale of a series from its first differences: MAD(Δx) / (0.6745·√2); 0 for fewer than 3 points."""
    if x.shape[0] < 3:
        return 0.0
    diffs = np.diff(x)
    return float(np.median(np.abs(diffs - np.median(diffs))) / (0.6745 * math.sqrt(2.0)))


def _best_split(x: np.ndarray, min_segment: int) -> tuple[int, float]:
    """(k, |mean(x[k:]) − mean(x[:k])|·√(k(n−k)/n)) maximised over min_segment <= k <= n − min_segment."""
    n = x.shape[0]
    ks = np.arange(min_segment, n - min_segment + 1)
    if ks.shape[0] == 0:
        return -1, 0.0
    prefix = np.concatenate([[0.0], np.cumsum(x)])
    before = prefix[ks] / ks
    after = (prefix[n] - prefix[ks]) / (n - ks)
    stat = np.abs(after - before) * np.sqrt(ks * (n - ks) / n)
    best = int(np.argmax(stat))
    return int(ks[best]), float(stat[best])


def change_points(
    steps: np.ndarray, values: np.ndarray, metric: str, settings: ChangePointSettings
) -> list[ChangePoint]:
    """Change points of one series (steps (n,) ascending, values (n,), non-finite values left out)."""
    finite = np.isfinite(values)
    steps, x = steps[finite], values[finite].astype(np.float64)
    if x.shape[0] < max(2 * settings.min_segment, settings.min_steps):
        return []
    scale = float(np.max(np.abs(x)))
    floor = 1e-9 * scale + 1e-300  # a noiseless series: any real shift counts, rounding does not
    found: list[ChangePoint] = []

    def search(lo: int, hi: int) -> None:
        segment = x[lo:hi]
        if segment.shape[0] < max(2 * settings.min_segment, settings.min_steps):
            return
        k, stat = _best_split(segment, settings.min_segment)
        if k < 0 or np.ptp(segment) <= floor:
            return
        score = stat / max(robust_sigma(segment), floor)  # each segment's own noise scale
        if score < settings.threshold:
            return
        before, after = float(np.mean(segment[:k])), float(np.mean(segment[k:]))
        found.append(ChangePoint(metric, int(steps[lo + k]), after - before, before, after, score))
        search(lo, lo + k)
        search(lo + k, hi)

    search(0, x.shape[0])
    return sorted(found, key=lambda c: c.step)


def drift(
    run: Run,
    settings: MetricSettings | None = None,
    *,
    change: ChangePointSettings | None = None,
    checks: CheckSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
    stream: StreamSettings | None = None,
) -> Report:
    """Per-step metrics of `run`, read in chunks of whole steps, plus change points; a Report of kind "drift".

    Rows: every per-step metric row of `compute_metrics` (``breakdown = step``), and one row per change point
    (``breakdown = changepoint``, ``bucket`` = the step, ``metric`` = the series, ``value`` = the jump,
    ``bucket_lo``/``bucket_hi`` = the means before and after, ``n`` = steps in the series). `progress(i, n)`
    is called after each chunk with the steps done. `stream`: the chunk sizes (`metrics.api.StreamSettings`;
    nothing is pooled for an ``all`` row).
    """
    from pgdiag.metrics.api import StreamSettings, compute_metrics

    settings = settings or MetricSettings()
    change = change or ChangePointSettings()
    report = compute_metrics(
        run,
        settings,
        checks=checks,
        stream=replace(stream or StreamSettings(), pooled=False),
        progress=progress,
    )  # chunks of whole steps, so memory follows the largest step
    steps = [int(s["step"]) for s in report.meta.get("steps", []) if s["step"] != "all"]
    rows = [report.summary.filter(pl.col("breakdown") == "step")]
    pairs: list[str] = list(report.meta.get("pairs", []))
    step_settings: dict | None = report.meta.get("settings")
    checks_frames = [report.checks] if report.checks.height else []
    per_step = pl.concat(rows) if rows else summary_frame([])
    all_metrics = settings.key_style != "pgdiag"
    found = find_change_points(per_step, change, all_metrics=all_metrics)
    marks = [
        ReportRow(
            pair,
            "token",
            "changepoint",
            str(cp.step),
            cp.metric,
            cp.jump,
            unit,
            "fit",
            n,
            cp.before,
            cp.after,
        )
        for cp, pair, unit, n in found
    ]
    summary = pl.concat([per_step, summary_frame(marks)])
    meta = {
        "command": "drift",
        "settings": step_settings or settings.to_dict(),
        "change_points": {
            "method": "binary segmentation, standardised CUSUM of a mean shift",
            "threshold": change.threshold,
            "min_segment": change.min_segment,
            "min_steps": change.min_steps,
            "series": searched_series(per_step, change, all_metrics=all_metrics),
            "found": [
                {
                    "metric": cp.metric,
                    "step": cp.step,
                    "jump": cp.jump,
                    "before": cp.before,
                    "after": cp.after,
                    "score": cp.score,
                }
                for cp, _, _, _ in found
            ],
        },
        "inputs": {"runs": [run.label], "paths": [str(p) for p in run.paths], "steps": steps},
        "pairs": pairs,
    }
    all_checks = pl.concat(checks_frames) if checks_frames else None
    if all_checks is None:
        return Report(kind="drift", summary=summary, meta=meta)
    return Report(kind="drift", summary=summary, meta=meta, checks=all_checks)


def searched_series(
    per_step: pl.DataFrame, settings: ChangePointSettings, *, all_metrics: bool = False
) -> list[str]:
    """The per-step series searched for change points: `settings.metrics` (those present), else every metric
    (`all_metrics`, a key style), else the headline metrics the rows have."""
    present = per_step["metric"].unique(maintain_order=True).to_list()
    if settings.metrics:
        return [m for m in settings.metrics if m in present]
    if all_metrics:
        return present
    return [m for m in DRIFT_HEADLINE if m in present]


def find_change_points(
    per_step: pl.DataFrame, settings: ChangePointSettings, *, all_metrics: bool = False
) -> list[tuple[ChangePoint, str, str, int]]:
    """(change point, pair, unit, steps) for every searched series of the per-step rows."""
    out: list[tuple[ChangePoint, str, str, int]] = []
    for metric in searched_series(per_step, settings, all_metrics=all_metrics):
        series = per_step.filter(pl.col("metric") == metric)
        for (pair,), rows in series.group_by(["pair"], maintain_order=True):
            rows = rows.with_columns(pl.col("bucket").cast(pl.Int64, strict=False).alias("_step")).sort(
                "_step"
            )
            steps = rows["_step"].to_numpy()
            values = rows["value"].cast(pl.Float64).fill_null(float("nan")).to_numpy()
            unit = str(rows["unit"][0])
            for cp in change_points(steps, values, metric, settings):
                out.append((cp, str(pair), unit, int(steps.shape[0])))
    return out
