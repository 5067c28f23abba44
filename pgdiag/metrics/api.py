"""`compute_metrics`: read a run, check it, compute the metric set per step and pooled, return a `Report`.

This is the library function behind `pgdiag metrics` (the CLI only parses options and renders). It resolves
which streams feed which family (docs/cli.md), reads only those columns, validates them (errors
raise `InvalidInputError`, warnings land in `Report.checks`), then runs the native engine (docs/metrics.md)
or a framework key style on every step and on the pooled ``all`` row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.load import LoadedBatch, read_token_batch
from pgdiag.data.reader import PieceReader
from pgdiag.data.runs import Run
from pgdiag.data.schema import stream_column
from pgdiag.data.token_issues import zero_fill_issues
from pgdiag.data.validate import (
    CheckResult,
    CheckSettings,
    Issue,
    check_result,
    raise_first_error,
)
from pgdiag.data.versions import token_lag
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.accumulators import RowFold
from pgdiag.metrics.chunks import plan_chunks
from pgdiag.metrics.kept import truncation_warning
from pgdiag.metrics.lag import LagBreakdown, lag_breakdown
from pgdiag.metrics.pooled import QuantileSettings
from pgdiag.metrics.resolve import metric_streams, pair_names, resolve_streams
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.gates import gate_policy
from pgdiag.report.report import Report, ReportRow, summary_frame

if TYPE_CHECKING:
    from pgdiag.metrics.docsteps import DocStepFeeder
    from pgdiag.metrics.engine import NativeStream, StepMetrics
    from pgdiag.metrics.styles.steps import StyleStream


def default_gates(settings: MetricSettings) -> dict[str, Any]:
    """The gates `metrics` always applies (docs/cli.md): no invalid token, and under `identity` the step-0
    identity check; native metric names are valid gate names even where this report lacks them."""
    from pgdiag.metrics.catalog import METRIC_CATALOG

    if settings.key_style != "pgdiag":
        return gate_policy()
    fail = ["count/tokens_invalid>0"]
    if settings.identity:
        fail.append(f"policy/logratio_absmax>{settings.identity_tol!r}")
    return gate_policy(fail_on=fail, known_metrics=[spec.key for spec in METRIC_CATALOG])


@dataclass(frozen=True)
class StreamSettings:
    """How `compute_metrics` reads a run: chunks of whole consecutive steps, and the pooled quantile rule.

    `max_rows` bounds the rows (samples) of one chunk; None = the largest step's rows, at least
    `min_rows`, so peak memory follows the largest step, not the run (a step is never split). `quantiles`
    says when the ``all`` row's token quantiles stop being exact (docs/metrics.md).
    """

    max_rows: int | None = None
    min_rows: int = 4096
    quantiles: QuantileSettings = field(default_factory=QuantileSettings)
    pooled: bool = True  # False: per-step rows only, no ``all`` row and nothing pooled for it (drift)

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"a chunk needs at least one row, got max_rows={self.max_rows}"
            )

    def budget(self, rows_per_step: dict[int, int]) -> int:
        """The row budget of one chunk for a run with `rows_per_step`."""
        if self.max_rows is not None:
            return self.max_rows
        return max([self.min_rows, *rows_per_step.values()])


def compute_metrics(
    run: Run,
    settings: MetricSettings | None = None,
    *,
    checks: CheckSettings | None = None,
    stream: StreamSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
    accumulators: Sequence[RowFold] = (),
    **options: Any,
) -> Report:
    """The full metric set of `run`, per step and pooled (``all``), as a `Report`.

    `settings` is a `MetricSettings`; without it, flat keyword options build one
    (``compute_metrics(run, aggregation="constant", divisor=40960, eps_low=0.1)``, `MetricSettings.from_options`).
    `checks` names the check codes to ignore and the examples per issue. Every aggregation mode is always
    reported (``loss/<mode>``); `settings.aggregation` picks the headline ``loss/pg``.

    The native engine reads the run in chunks of whole steps (`stream`, docs/reliability.md): each chunk is
    read, validated and reduced per step, and only per-sample tables and token summaries are kept for the
    ``all`` row; a framework key style computes each step with its own function and its ``all`` row from the
    step rows (`pool_style_steps`). With `--docs-per-step` the steps of N documents are cut over the whole
    run from its key columns first and the chunks are read in the run's read order (`metrics.docsteps`). A
    run with null steps (an E213 error) is read whole, and so is a `--docs-per-step` run whose chunks leave
    rows out (ignored structural errors: its documents are counted over the rows kept). `progress(steps_done,
    n_steps)` is called after each chunk. The chunks' checks merge into the run's (`merge_check_results`); an
    error is raised after the last chunk (the chunks after it are validated only), as one read of the run
    raises it. `accumulators` (`metrics.accumulators.RowFold`, e.g. `--losses`) get every chunk's batch, with
    their streams read too, and their rows join the report; `settings.by` adds the `lag` breakdown.
    """
    if settings is None:
        settings = MetricSettings.from_options(**options)
    elif options:
        raise UsageError(Code.SETTINGS_TWICE, "give either a MetricSettings or keyword options, not both")
    checks = checks or CheckSettings()
    stream = stream or StreamSettings()
    settings = resolve_streams(run, settings)
    from pgdiag.metrics.engine import NativeStream
    from pgdiag.metrics.styles.steps import StyleStream

    engine = (
        NativeStream(settings, stream.quantiles, pooled=stream.pooled)
        if settings.key_style == "pgdiag"
        else StyleStream(settings)
    )
    plan = plan_chunks(run, settings, stream.budget, engine)
    if plan is None:  # a run no chunking reads exactly: the reader says what is wrong
        return _whole_run_report(run, settings, checks, accumulators)
    chunks = plan.chunks or [(run, None)]  # a run without rows is read once, as a whole
    reader = (
        PieceReader(  # the reader's checks merged, its first error (then the pair rule's) raised at the end
            [chunk for chunk, _ in chunks],
            lambda chunk, many: _read(chunk, settings, checks, piece=many, accumulators=accumulators),
            after=lambda loaded: _pair_rule(loaded.batch, settings, checks),
        )
    )
    fold = MetricsFold(
        engine, plan.feeder, pooled=stream.pooled, lag=lag_breakdown(settings), rows=accumulators
    )
    for piece in reader:
        n_rows = chunks[piece.index][1]
        if n_rows is not None and piece.batch.n_samples != n_rows:  # rows left out: cut the rows kept
            return _whole_run_report(run, settings, checks, accumulators)
        fold.add(piece.batch, piece.run)
        del piece  # the piece's token arrays go before the reader reads the next one (peak memory)
        if progress is not None:
            progress(len(engine.steps), plan.n_steps)
    found = reader.finish()
    return _pieces_report(run, settings, checks, stream, fold, found, len(plan.chunks))


def _pieces_report(
    run: Run,
    settings: MetricSettings,
    checks: CheckSettings,
    stream: StreamSettings,
    fold: MetricsFold,
    found: CheckResult,
    n_chunks: int,
) -> Report:
    """The report of a run read in pieces: every step, `all`, the merged checks and how the quantiles pooled."""
    engine = fold.engine
    notice = _quantile_notice(engine.quantiles_exact, stream.quantiles)
    return _report(
        fold.finish(),
        settings,
        run=run,
        n_samples=fold.n_samples,
        n_tokens=fold.n_tokens,
        checks=found.issues,
        ignored=checks.ignore,
        extra_meta={
            "pooled_quantiles": {
                "exact": engine.quantiles_exact,
                "exact_limit": stream.quantiles.exact_limit,
                "relative_error": None if engine.quantiles_exact else stream.quantiles.relative_error,
            },
            "chunks": n_chunks,
        },
        extra_notices=[] if notice is None else [notice],
        lag=fold.lag,
        extra_rows=[row for accumulator in fold.rows for row in accumulator.finish()],
    )


class MetricsFold:
    """The metric engine over a run's pieces (`pgdiag.data.fold.Fold`): `add(batch)` per piece in order (through
    the `--docs-per-step` feeder when there is one), `finish()` every step's metrics and, when pooled, `all`. The
    reader (`pgdiag.data.reader.PieceReader`) hands on only the pieces before the first error and raises it.
    `lag` (`--by lag`) and `rows` (`RowFold`s: `--losses`) are fed every piece too; the caller reports them."""

    def __init__(
        self,
        engine: NativeStream | StyleStream,
        feeder: DocStepFeeder | None,
        *,
        pooled: bool,
        lag: LagBreakdown | None = None,
        rows: Sequence[RowFold] = (),
    ) -> None:
        self.engine, self.feeder, self.pooled, self.lag, self.rows = engine, feeder, pooled, lag, rows
        self.n_samples = self.n_tokens = 0

    def add(self, batch: TokenBatch, source: Run | None = None) -> None:
        """Fold one piece in; `source` is the run restricted to it, which `--by lag` reads the versions from."""
        (self.engine if self.feeder is None else self.feeder).add(batch)
        if self.lag is not None:
            assert source is not None
            self.lag.add(batch, token_lag(source, batch))
        for accumulator in self.rows:
            accumulator.add(batch)
        self.n_samples += batch.n_samples
        self.n_tokens += batch.n_tokens

    def finish(self) -> list[tuple[str, StepMetrics]]:
        if self.feeder is not None:
            self.feeder.finish()
        return [*self.engine.steps, self.engine.finish()] if self.pooled else list(self.engine.steps)


def _whole_run_report(
    run: Run, settings: MetricSettings, checks: CheckSettings, accumulators: Sequence[RowFold]
) -> Report:
    """The report of `run` read at once, for a run that no chunking reads exactly (null steps, a step column
    that is not an integer, rows left out under `--docs-per-step`): the reader's first error, then the pair
    rule's, raise."""
    loaded = _read(run, settings, checks, accumulators=accumulators)
    batch, issues = loaded.batch, loaded.checks.issues
    raise_first_error(_pair_rule(batch, settings, checks))
    return metrics_report(
        batch, settings, run=run, checks=issues, ignored=checks.ignore, accumulators=accumulators
    )


def _read(
    run: Run,
    settings: MetricSettings,
    checks: CheckSettings,
    *,
    piece: bool = False,
    accumulators: Sequence[RowFold] = (),
) -> LoadedBatch:
    """One read of `run` (a piece, or the whole run) with the reader's validation, the accumulators' streams too;
    `piece` (one of several): nothing raises, the issues are in the checks for `PieceReader` to merge and raise."""
    return read_token_batch(
        run,
        streams=list(
            dict.fromkeys([*metric_streams(settings), *(s for a in accumulators for s in a.streams)])
        ),
        entropy=[settings.entropy] if settings.entropy else [],
        ignore=checks.ignore,
        max_examples=checks.max_examples,
        piece=piece,
        raise_errors=not piece,
        kept_of=[settings.kept] if settings.kept else [],
    )


def _pair_rule(batch: TokenBatch, settings: MetricSettings, checks: CheckSettings) -> list[Issue]:
    """The pair zero-fill rule (E206) on the metric pairs of a read batch, after the reader's one-stream rules."""
    found: list[Issue] = []
    if Code.ZERO_FILLED not in checks.ignore:
        pairs = [(settings.old, settings.new), (settings.stream_a, settings.stream_b)]
        for a, b in dict.fromkeys(p for p in pairs if p[0] is not None and p[1] is not None and p[0] != p[1]):
            found += _zero_fill(batch, a, b, checks.max_examples)
    return found


def _zero_fill(batch: TokenBatch, a: str, b: str, max_examples: int) -> list[Issue]:
    """E206 (exit 3) where one stream of the pair (a, b) is exactly 0.0 and the other below −1: the pair rule
    `check` and `compare` apply (`data.token_issues.zero_fill_issues`); the reader applied the one-stream rules."""
    return zero_fill_issues(
        batch.streams[a],
        batch.streams[b],
        batch,
        name_a=stream_column(a),
        name_b=stream_column(b),
        single_stream=False,
        max_examples=max_examples,
        label=batch.label,
        legit_a=batch.one_token_sets(a),
        legit_b=batch.one_token_sets(b),
    )


def _quantile_notice(exact: bool, quantiles: QuantileSettings) -> str | None:
    """The notice of an ``all`` row whose token quantiles were sketched (None when they are exact)."""
    if exact:
        return None
    return (
        f"all: token quantiles (policy/logratio_p*, mismatch/abs_p*, abs_dprob_p99, entropy/p*) are sketched past "
        f"{quantiles.exact_limit:,} tokens: relative error <= {quantiles.relative_error:g} (docs/metrics.md)"
    )


def metrics_report(
    batch: TokenBatch,
    settings: MetricSettings,
    *,
    run: Run,
    checks: pl.DataFrame | None = None,
    ignored: Sequence[str] = (),
    accumulators: Sequence[RowFold] = (),
) -> Report:
    """The metric set of an already read and validated `batch` of `run` under stream-resolved `settings`
    (`resolve_streams`), read whole (`compare --metrics` feeds its pieces to a stream instead: `stream_report`)."""
    from pgdiag.metrics.engine import compute_native
    from pgdiag.metrics.styles.steps import compute_by_step, compute_step_style

    lag = lag_breakdown(settings)
    if lag is not None:
        lag.add(batch, token_lag(run, batch))
    if settings.key_style == "pgdiag":
        results = compute_native(batch, settings)
    else:
        results = compute_by_step(
            batch,
            settings,
            lambda step, s, n_split: compute_step_style(step, s, groups_split=n_split, partials=True),
        )
    return _report(
        results,
        settings,
        run=run,
        n_samples=batch.n_samples,
        n_tokens=batch.n_tokens,
        checks=checks,
        ignored=ignored,
        lag=lag,
        extra_rows=_fed_rows(accumulators, batch),
    )


def _fed_rows(accumulators: Sequence[RowFold], batch: TokenBatch) -> list[ReportRow]:
    """The rows of `accumulators` fed `batch`, a whole run read at once."""
    for accumulator in accumulators:
        accumulator.add(batch)
    return [row for accumulator in accumulators for row in accumulator.finish()]


def _report(
    results: Sequence[tuple[str, StepMetrics]],
    settings: MetricSettings,
    *,
    run: Run,
    n_samples: int,
    n_tokens: int,
    checks: pl.DataFrame | None,
    ignored: Sequence[str],
    extra_meta: dict[str, Any] | None = None,
    extra_notices: Sequence[str] = (),
    lag: LagBreakdown | None = None,
    extra_rows: Sequence[ReportRow] = (),
) -> Report:
    """The metrics `Report` of per-step and ``all`` results (and the `lag` and accumulators' rows)."""
    policy_pair, mismatch_pair = pair_names(run.label, settings)
    rows: list[ReportRow] = []
    steps_meta: list[dict[str, Any]] = []
    notices: list[str] = []
    for step_label, step in results:
        breakdown, bucket = ("all", "all") if step_label == "all" else ("step", str(step_label))
        steps_meta.append({"step": step_label, "status": step.status})
        notices.extend(n for n in step.notices if n not in notices)
        for v in step.values:
            pair = mismatch_pair if (v.key.startswith("mismatch/") and mismatch_pair) else policy_pair
            rows.append(ReportRow(pair, "token", breakdown, bucket, v.key, v.value, v.unit, v.reduction, v.n))
    rows += extra_rows
    if lag is not None:
        rows += lag.rows(policy_pair, mismatch_pair)
        extra_notices = [*extra_notices, *lag.notices]
    notices.extend(n for n in extra_notices if n not in notices)
    meta = {
        "command": "metrics",
        "settings": settings.to_dict(),
        "inputs": {
            "runs": [run.label],
            "paths": [str(p) for p in run.paths],
            "streams": metric_streams(settings),
            "entropy": settings.entropy,
            "n_samples": n_samples,
            "n_tokens": n_tokens,
            "ignored_codes": list(ignored),
        },
        "pairs": [p for p in (policy_pair, mismatch_pair) if p],
        "gate_policy": default_gates(settings),
        "steps": steps_meta,
        "notices": notices,
        **(extra_meta or {}),
    }
    if checks is None:
        return Report(kind="metrics", summary=summary_frame(rows), meta=meta)
    warning = (
        None
        if Code.HIDDEN_KEPT_MASS in ignored
        else truncation_warning(run, settings.kept, _all_value(results))
    )
    if warning is not None:
        checks = pl.concat([checks, check_result([warning]).issues], how="vertical_relaxed")
    return Report(kind="metrics", summary=summary_frame(rows), meta=meta, checks=checks)


def _all_value(
    results: Sequence[tuple[str, StepMetrics]], key: str = "mismatch/truncation_bias"
) -> float | None:
    """`key`'s value in the pooled ``all`` row (None when absent)."""
    for label, step in results:
        if label == "all":
            value = step.by_key().get(key)
            return None if value is None else value.value
    return None


def stream_report(
    engine: Any,
    settings: MetricSettings,
    *,
    run: Run,
    n_samples: int,
    n_tokens: int,
    quantiles: QuantileSettings,
) -> Report:
    """The metrics `Report` of an engine (`NativeStream` or `StyleStream`) fed chunk by chunk elsewhere (`compare
    --metrics` feeds it the pieces compare reads): its step rows, the pooled ``all`` row, and the pooled quantile
    meta and notice `compute_metrics` gives; no checks table (the caller's reader checked the chunks)."""
    results = [*engine.steps, engine.finish()]
    exact = bool(engine.quantiles_exact)
    notice = _quantile_notice(exact, quantiles)
    return _report(
        results,
        settings,
        run=run,
        n_samples=n_samples,
        n_tokens=n_tokens,
        checks=None,
        ignored=(),
        extra_meta={
            "pooled_quantiles": {
                "exact": exact,
                "exact_limit": quantiles.exact_limit,
                "relative_error": None if exact else quantiles.relative_error,
            }
        },
        extra_notices=[] if notice is None else [notice],
    )
