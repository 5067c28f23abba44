"""N-way compare: several runs against one baseline on their common samples, plus a matrix of every pair.

What: `compare_many(runs, settings, baseline=0)` reads each run once, keeps the samples every run holds (the
same (step, sample_id), or (step, seq_hash) under ``join = "hash"``), and runs `compare_runs` on the baseline
against each other run, and on every other pair for the matrix of the headline statistic. Why: "which of five
trainers agrees with the reference?" needs one table, on the same samples for every pair, not five commands on
five different sample sets. How: the pairs are ordinary two-run comparisons of in-memory `TokenBatch`es, so each
pair's rows are exactly what `compare_runs` gives for those two runs restricted to the common samples; the
report stacks the baseline pairs' rows and adds the matrix as rows with breakdown ``matrix`` (which gates never
read: gates read each pair's ``all`` rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl

from pgdiag.compare.api import Comparison, _as_source, compare_runs, resolve_streams
from pgdiag.compare.settings import CompareSettings
from pgdiag.data.batch import TokenBatch
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.report.report import Report, ReportRow, summary_frame

MATRIX_STATISTIC = "mismatch/abs_mean"  # mean |Δ| over matched tokens, nats: the headline statistic


@dataclass(frozen=True)
class NWayComparison:
    """Every run against the baseline (`comparisons`, in run order without the baseline), the report that
    stacks them with the matrix rows, and the matrix itself (run_a, run_b, value; every unordered pair once)."""

    report: Report
    comparisons: tuple[Comparison, ...]
    matrix: pl.DataFrame


def _labels(batches: Sequence[TokenBatch]) -> list[str]:
    """Each run's label; repeated labels get ``#<position>`` so every pair is named uniquely."""
    labels = [b.label for b in batches]
    return [f"{lab}#{i}" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def _common_rows(batches: Sequence[TokenBatch], join: str) -> list[np.ndarray]:
    """For each batch, the rows (in its own order) of the samples every batch holds."""
    use_hash = join in ("hash", "hash-any-step")
    keys = []
    for batch in batches:
        if use_hash and batch.seq_hash is None:
            raise UsageError("E512", f"{batch.label}: --join {join} needs runs read from disk (seq_hash)")
        ident = batch.seq_hash.astype(str) if use_hash else batch.sample_id.astype(str)
        step = np.zeros_like(batch.step) if join == "hash-any-step" else batch.step
        keys.append(np.char.add(np.char.add(step.astype(str), "|"), ident.astype(str)))
    common = keys[0]
    for k in keys[1:]:
        common = np.intersect1d(common, k)
    if common.size == 0:
        raise InvalidInputError(
            "E304",
            "the runs share no sample: nothing to compare",
            "check the runs' steps (--steps) and the sample join (--join)",
        )
    return [np.flatnonzero(np.isin(k, common)) for k in keys]


def compare_many(
    runs: Sequence[Any], settings: CompareSettings | None = None, *, baseline: int = 0
) -> NWayComparison:
    """Compare every run of `runs` (two or more `Run`s, paths or `TokenBatch`es) with ``runs[baseline]`` on
    the samples all of them hold, and every pair for the matrix of ``mismatch/abs_mean``.

    Streams: `settings.stream_a` on the baseline (default as for two runs: new, old, the only tag, rollout),
    `settings.stream_b` on every other run (default: the baseline's stream name). Side-by-side metrics and the
    exact temperature fit (`settings.metrics`, `settings.model`) compare two runs only (E503).
    """
    settings = settings or CompareSettings()
    if len(runs) < 2:
        raise UsageError("E503", f"N-way compare needs at least two runs (got {len(runs)})")
    if not 0 <= baseline < len(runs):
        raise UsageError("E503", f"--baseline {baseline}: choose a run from 0 to {len(runs) - 1}")
    if settings.metrics is not None or settings.model is not None:
        raise UsageError("E503", "--metrics and --model compare two runs; give two RUNs or drop them")
    sources = [_as_source(r) for r in runs]
    base = sources[baseline]
    other = next(s for i, s in enumerate(sources) if i != baseline)
    stream_base, stream_other = resolve_streams(
        list(base.streams), list(other.streams), settings.stream_a, settings.stream_b
    )
    streams = [stream_base if i == baseline else stream_other for i in range(len(sources))]
    batches = [_read(source, stream, settings) for source, stream in zip(sources, streams, strict=True)]
    labels = _labels(batches)
    keep = _common_rows(batches, settings.join)
    batches = [replace(b.select(rows), label=lab) for b, rows, lab in zip(batches, keep, labels, strict=True)]

    def pair(i: int, j: int) -> Comparison:
        pair_settings = replace(
            settings, stream_a=streams[i], stream_b=streams[j], label_a=labels[i], label_b=labels[j]
        )
        return compare_runs(batches[i], batches[j], pair_settings)

    order = [i for i in range(len(batches)) if i != baseline]
    comparisons = {(baseline, j): pair(baseline, j) for j in order}
    for a in order:
        for b in order:
            if a < b:
                comparisons[(a, b)] = pair(a, b)
    matrix_rows = []
    for (i, j), comparison in sorted(comparisons.items()):
        value = comparison.report.value(MATRIX_STATISTIC, scope="token")
        matrix_rows.append({"run_a": labels[i], "run_b": labels[j], "value": value})
    matrix = pl.DataFrame(matrix_rows, schema={"run_a": pl.String, "run_b": pl.String, "value": pl.Float64})
    baseline_pairs = tuple(comparisons[(baseline, j)] for j in order)
    return NWayComparison(_report(baseline_pairs, matrix, labels[baseline]), baseline_pairs, matrix)


def _read(source: Any, stream: str, settings: CompareSettings) -> TokenBatch:
    """One run read once (the compared stream), or an in-memory batch as given."""
    if isinstance(source, TokenBatch):
        return source
    if stream not in source.streams:
        raise UsageError(
            "E111", f"{source.label}: no stream {stream!r}; streams: {', '.join(source.streams)}"
        )
    from pgdiag.data.runs import read_token_batch

    loaded = read_token_batch(
        source,
        streams=[stream],
        reward=True,
        env=True,
        ignore=settings.checks.ignore,
        max_examples=settings.checks.max_examples,
    )
    return loaded.batch


def _report(pairs: Sequence[Comparison], matrix: pl.DataFrame, baseline: str) -> Report:
    """The baseline pairs' reports stacked, with the matrix as ``breakdown = matrix`` rows."""
    n_tokens = {p.report.meta["pairs"][0]: p.report.meta["inputs"]["n_tokens"] for p in pairs}
    rows = [
        ReportRow(
            f"{r['run_a']} vs {r['run_b']}",
            "token",
            "matrix",
            f"{r['run_a']}|{r['run_b']}",
            MATRIX_STATISTIC,
            r["value"],
            "nats",
            "token-mean",
            0,
        )
        for r in matrix.iter_rows(named=True)
    ]
    summary = pl.concat([*(p.report.summary for p in pairs), summary_frame(rows)], how="vertical")
    first = pairs[0].report
    meta = {
        **first.meta,
        "pairs": [p.report.meta["pairs"][0] for p in pairs],
        "baseline": baseline,
        "runs": [baseline, *(p.report.meta["labels"]["b"] for p in pairs)],
        "n_tokens_by_pair": n_tokens,
        "matrix_statistic": MATRIX_STATISTIC,
    }
    worst = [p.report.worst_tokens for p in pairs if p.report.worst_tokens is not None]
    worst_seqs = [p.report.worst_seqs for p in pairs if p.report.worst_seqs is not None]
    return Report(
        kind="compare",
        summary=summary,
        meta=meta,
        checks=pl.concat([p.report.checks for p in pairs], how="vertical"),
        worst_tokens=pl.concat(worst, how="vertical") if worst else None,
        worst_seqs=pl.concat(worst_seqs, how="vertical") if worst_seqs else None,
    )
