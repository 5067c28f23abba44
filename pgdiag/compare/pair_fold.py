"""One comparison folded over the pieces of its runs (`pgdiag.data.fold.Fold`): `PairFold`.

What: `add(PieceSides)` takes one piece as the reader gave it (side a and side b of the same steps, either None
where that run has no rows) and aligns, checks and pools it (`pooled.PooledParity`, the `--metrics` side sets,
the `--tokens-out` writer, the `--model` τ samples); `finish(reader checks)` returns the `Comparison`
(`pair_report.pair_comparison`) once the reader (`pgdiag.data.reader.RunsReader`) has merged each run's checks
and raised the first reader error, after the last piece.
Why: `compare_runs` is then a short loop over the reader, and a new per-pair accumulator is added here, once.
How: state kept between pieces is the pooled tables and counts (of the order of the steps and buckets), never
a piece's token arrays: each side's batch is dropped as soon as the pair is aligned (peak memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from pgdiag.compare import breakdowns as bd
from pgdiag.compare.align import AlignedPair, align_batches, finite_only
from pgdiag.compare.alignment_issues import Deferred, unmatched_side
from pgdiag.compare.exact import ExactAgreement, check_float32_storage, exact_rows
from pgdiag.compare.pair_report import DLOGP_EDGES, Comparison, diagnosed_rows, pair_comparison
from pgdiag.compare.pieces import checked_matches, keys_deferred
from pgdiag.compare.pooled import PooledParity
from pgdiag.compare.settings import CompareSettings
from pgdiag.compare.side_by_side import SideMetrics, side_by_side_rows
from pgdiag.data.batch import TokenBatch
from pgdiag.data.pieces import AnyStepKeys, PairPiece
from pgdiag.data.validate import CheckResult, Issue
from pgdiag.data.versions import token_lag_at
from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.metrics.accumulators import RowFold
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.report import ReportRow

if TYPE_CHECKING:
    from pgdiag.compare.tokens import TokenTableWriter


@dataclass(frozen=True)
class Side:
    """One side of a comparison once read: its token batch (with `seq_hash` when read from disk), reader checks."""

    batch: TokenBatch | None  # None once aligned (`_aligned`)
    checks: CheckResult | None  # the reader's checks
    run: Any  # the `Run`, or None for an in-memory batch
    metrics: MetricSettings | None = None  # this side's resolved side-by-side metric settings
    sample_row: np.ndarray | None = None  # (S,) the batch's `sample_row`, kept when the batch is dropped


def _aligned(side: Side) -> Side:
    """`side` without its batch, once the pair is built (peak memory).

    The pair holds views of the arrays the tables read, so side b's own positions and token ids (80 MB at 10M
    tokens) are freed before the parity tables allocate theirs (new memory costs ~2 ms per MiB on this machine;
    see `parity.TokenTerms`).
    """
    return replace(side, batch=None, sample_row=None if side.batch is None else side.batch.sample_row)


def _labels(
    a: TokenBatch | None,
    b: TokenBatch | None,
    label_a: str | None,
    label_b: str | None,
    one_run: bool,
    run_a: Any,
    run_b: Any,
) -> tuple[str, str]:
    """The two labels: given, else each batch's (its run's when that run has no rows in the first piece)."""
    la = label_a or (a.label if a is not None else run_a.label)
    lb = label_b or (b.label if b is not None else (run_a if one_run else run_b).label)
    if la == lb and not one_run:
        la, lb = f"{la}:a", f"{lb}:b"
    return la, lb


def _metadata_issues(side: Side, streams: list[str]) -> list[Issue]:
    """Footer checks of the compared streams (`pgdiag.checks.metadata.metadata_checks`: W402, W403, W405, W409, W411)."""
    if side.run is None:
        return []
    from pgdiag.checks.metadata import metadata_checks

    return [
        Issue(i.code, i.severity, i.count, f"{side.run.label}: {i.message}", i.step, i.sample_id, i.pos)
        for i in metadata_checks(side.run.meta, streams, {})
    ]


TAU_WARN = 0.02  # |tau_fit − 1| above this is reported (the `recommended` profile's tau_dev gate)


def _input_ids_of(pair: AlignedPair, side_b: Side) -> Callable[[np.ndarray], list[np.ndarray]]:
    """matched samples of `pair` -> side b's full input_ids of each, read from side b's run (the piece's steps),
    those rows only; the exact τ fit needs side b read from disk."""
    if side_b.run is None or side_b.sample_row is None:
        raise UsageError(
            Code.NEEDS_RUN_ON_DISK,
            "--model needs runs read from disk (the fit recomputes logits from input_ids)",
        )
    run, sample_row = side_b.run, np.asarray(side_b.sample_row, dtype=np.int64)

    def read(samples: np.ndarray) -> list[np.ndarray]:
        source_rows = sample_row[pair.rows_b[samples]]  # (k,) rows of side b's run
        wanted = np.unique(source_rows)
        try:
            frame = (
                run.lazy.with_row_index("_pgdiag_row")
                .filter(pl.col("_pgdiag_row").is_in(wanted.tolist()))
                .select("_pgdiag_row", "input_ids")
                .collect()
            )
        except pl.exceptions.PolarsError as exc:
            raise InvalidInputError(
                Code.LOSSY_CAST, f"{run.label}: cannot read column input_ids ({exc})"
            ) from exc
        by_row = dict(zip(frame["_pgdiag_row"].to_list(), frame["input_ids"], strict=True))
        return [by_row[int(r)].to_numpy() for r in source_rows]

    return read


def _tau_warning(name: str, label_a: str, label_b: str, n_tokens: int, tau: float | None) -> list[Issue]:
    if tau is None or abs(tau - 1.0) <= TAU_WARN:
        return []
    return [
        Issue(
            Code.ONE_SIDED_TEMPERATURE,
            "warning",
            n_tokens,
            f"{name}: best-fit temperature {tau:.4g} from {label_b}'s logits: {label_a} looks "
            f"sampled at T ≈ {tau:.3g} relative to {label_b}; check temperature on both sides",
        )
    ]


@dataclass(frozen=True)
class PairSources:
    """The two sources of one comparison, resolved before the first piece: runs (or in-memory batches), the
    compared streams and each side's `--metrics` settings. `b` is None for two streams of `a`."""

    a: Any
    b: Any
    streams: tuple[str, str]
    metrics: tuple[MetricSettings | None, MetricSettings | None] = (None, None)
    accumulators: tuple[RowFold, ...] = ()  # fed side a's batch of every piece (`--losses`); their rows join

    @property
    def extra_streams(self) -> list[str]:
        """Side a's streams the accumulators read besides the compared ones."""
        return [s for accumulator in self.accumulators for s in accumulator.streams]

    @property
    def one_run(self) -> bool:
        """Two streams of run a."""
        return self.b is None


@dataclass
class PieceSides:
    """One piece as the reader gave it: side a and side b (None where that run has no rows in the piece).

    Mutable on purpose: `PairFold.add` takes the sides out (`take`), so their token arrays are freed once the pair
    is aligned, not when the caller's reference goes."""

    piece: PairPiece
    side_a: Side | None
    side_b: Side | None

    def take(self) -> tuple[Side | None, Side | None]:
        """The two sides, leaving None behind."""
        sides = (self.side_a, self.side_b)
        self.side_a = self.side_b = None
        return sides


class PairFold:
    """One comparison over its pieces (module docstring): `add` each piece in step order, then `finish` once."""

    def __init__(
        self,
        sources: PairSources,
        settings: CompareSettings,
        *,
        join: str,
        n_pieces: int,
        keys: AnyStepKeys | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        writer: TokenTableWriter | None = None,
    ) -> None:
        from pgdiag.compare.tau import TauSamples

        self.sources, self.settings, self.join, self.n_pieces, self.keys = (
            sources,
            settings,
            join,
            n_pieces,
            keys,
        )
        self.decode, self.writer = decode, writer
        self.pooled: PooledParity | None = None
        self.held: Deferred | None = None  # counts deferred to the end (E302 sample, E304/E306, masks)
        self.shown: list[SideMetrics] = []  # each run's own metrics, fed piece by piece (--metrics)
        self.tau_samples = None if settings.model is None else TauSamples()  # the first matched tokens for τ
        self.pair: AlignedPair | None = None  # every aligned token, when the comparison is one piece
        self.labels: tuple[str, str] | None = None
        self.exact = ExactAgreement() if settings.exact else None  # --exact: every token's bits compared
        if self.exact is not None:
            check_float32_storage(sources.a, sources.streams[0])
            check_float32_storage(sources.a if sources.one_run else sources.b, sources.streams[1])

    @property
    def name(self) -> str:
        """The pair's name in rows and messages: ``label_a:stream_a vs label_b:stream_b``."""
        assert self.labels is not None
        (la, lb), (sa, sb) = self.labels, self.sources.streams
        return f"{la}:{sa} vs {lb}:{sb}"

    def add(self, read: PieceSides) -> None:
        """Fold one piece in: its reader checks and side metrics, then its aligned pair into the pooled tables."""
        piece = read.piece
        side_a, side_b = read.take()
        self._first_piece(side_a, side_b)
        if side_a is not None and side_a.batch is not None and self.sources.accumulators:
            batch = replace(side_a.batch, label=self.labels[0] if self.labels else side_a.batch.label)
            for accumulator in self.sources.accumulators:
                accumulator.add(batch)
        # each run's own metrics before the pair is aligned and the batch dropped; a lone step feeds its run
        for metric_side, side in zip(self.shown, (side_a, side_b), strict=False):
            if side is not None:
                metric_side.add(side.batch)
        if side_a is None or side_b is None:  # a step present in one run only: all its samples unmatched
            if self.keys is None:  # else counted on the keys; it was read for its reader checks
                self._hold(self._unmatched(side_a, side_b))
            return
        piece_pair = self._align(piece, side_a, side_b)
        if self.exact is not None:  # the exact tally sees every token; the parity tables the finite ones
            self.exact.add(piece_pair)
            piece_pair = finite_only(piece_pair)
        lag = self._lag(side_a, piece_pair)
        side_a = _aligned(side_a)  # the batches go before the tables allocate theirs (peak memory)
        side_b = side_a if self.sources.one_run else _aligned(side_b)
        self._hold(piece_pair.deferred)
        if piece_pair.n_samples == 0:  # nothing matched in these steps: counted in E306 (deferred) only
            return
        self._pool(piece_pair, side_b, lag)

    def _lag(self, side_a: Side, pair: AlignedPair) -> np.ndarray | None:
        """(M,) the lag of each matched token, read from side a's run (`--by lag` only; NaN without versions)."""
        if self.settings.by is None or "lag" not in self.settings.by:
            return None
        batch = side_a.batch
        assert batch is not None
        found = None
        if side_a.run is not None:
            rows = pair.rows_a[pair.token_row]  # (M,) batch a's row of each matched token
            found = token_lag_at(side_a.run, batch.step, batch.sample_id, batch.segment_idx, rows, pair.pos)
        return np.full(pair.n_tokens, np.nan) if found is None else found.lag

    def _first_piece(self, side_a: Side | None, side_b: Side | None) -> None:
        """Labels, the hash-any-step counts and the side metric sets, fixed by the first piece."""
        if self.labels is not None:
            return
        src, settings = self.sources, self.settings
        self.labels = _labels(
            side_a.batch if side_a else None,
            side_b.batch if side_b else None,
            settings.label_a,
            settings.label_b,
            src.one_run,
            src.a,
            src.b,
        )
        la, lb = self.labels
        if self.keys is not None:  # hash-any-step in pieces: samples paired on the keys
            self.held = keys_deferred(self.keys, self.name, la, lb)
        metrics_a, metrics_b = src.metrics
        if metrics_a is not None:
            self.shown.append(SideMetrics(la, src.a, metrics_a))
            if metrics_b is not None:
                self.shown.append(SideMetrics(lb, src.b, metrics_b))

    def _hold(self, part: Deferred | None) -> None:
        if part is not None:
            self.held = part if self.held is None else self.held.merge(part)

    def _unmatched(self, side_a: Side | None, side_b: Side | None) -> Deferred:
        assert self.labels is not None
        la, lb = self.labels
        lone, which = (side_b, "b") if side_a is None else (side_a, "a")
        assert lone is not None and lone.batch is not None
        return unmatched_side(
            replace(lone.batch, label=lb if which == "b" else la),
            side=which,
            pair_name=self.name,
            label_other=la if which == "b" else lb,
            join=self.join,
        )

    def _align(self, piece: PairPiece, side_a: Side, side_b: Side) -> AlignedPair:
        assert self.labels is not None and side_a.batch is not None and side_b.batch is not None
        la, lb = self.labels
        sa, sb = self.sources.streams
        batch_a = replace(side_a.batch, label=la)
        batch_b = batch_a if self.sources.one_run else replace(side_b.batch, label=lb)
        return align_batches(
            batch_a,
            batch_b,
            stream_a=sa,
            stream_b=sb,
            join=self.join,
            ignore=self.settings.checks.ignore,
            deferred=self.n_pieces > 1,
            matches=checked_matches(piece, batch_a, batch_b),
            keep_nonfinite=self.exact is not None,
        )

    def _pool(self, piece_pair: AlignedPair, side_b: Side, lag: np.ndarray | None) -> None:
        settings = self.settings
        if self.pooled is None:
            chosen = bd.available(piece_pair) if settings.by is None else tuple(settings.by)
            self.pooled = PooledParity(
                by=chosen,
                eps_low=settings.clip.eps_low,
                eps_high=settings.clip.eps_high,
                worst_k=settings.worst_k,
                decode=self.decode,
                pieces=self.n_pieces,
            )
        self.pooled.add(piece_pair, np.asarray(DLOGP_EDGES), lag)
        if self.writer is not None:
            self.writer.add(piece_pair)
        if self.tau_samples is not None and not self.tau_samples.full:
            self.tau_samples.add(piece_pair, _input_ids_of(piece_pair, side_b))
        if self.n_pieces == 1:
            self.pair = piece_pair

    def finish(self, reader: Sequence[CheckResult | None] = ()) -> Comparison:
        """The comparison over every piece, with the reader's checks of each run merged over the pieces (None for
        a side never read from disk: `RunsReader.finish`, which raised the runs' first reader error)."""
        ignore = self.settings.checks.ignore
        deferred_issues: list[Issue] = []
        if self.held is not None:
            deferred_issues = self.held.shift_issues(ignore)  # E302 on the sample pooled over the pieces
            deferred_issues += self.held.unmatched_issues(ignore)  # E304 raises, E306 raises unless ignored
            deferred_issues += self.held.mask_issues(ignore)
        pooled = self.pooled
        assert pooled is not None and self.labels is not None  # E304 raised above when no piece matched
        la, lb = self.labels
        rows, diagnosis = diagnosed_rows(pooled, self.name, la, lb, self.sources.streams[0])
        tau, issues_tau = self._tau(rows)
        exact_result = None
        if self.exact is not None:
            found = [*(self.pair.issues if self.pair is not None else ()), *deferred_issues]
            exact_result = self.exact.finish(
                sum(i.count for i in found if i.code in (Code.MASKS_DIFFER_SLIGHTLY, Code.MASKS_DIFFER))
            )
            rows += exact_rows(exact_result, self.name)
        side_meta: dict[str, Any] = {}
        if self.shown:
            side_rows, side_meta = side_by_side_rows(self.shown)
            rows += side_rows
        rows += [row for accumulator in self.sources.accumulators for row in accumulator.finish()]
        hints = diagnosis.issues
        if tau is not None:  # the exact fit supersedes the slope hint's temperature warning
            slope = f"{self.name}: slope"
            hints = tuple(
                i for i in hints if not (i.code == Code.ONE_SIDED_TEMPERATURE and i.message.startswith(slope))
            )
        pair_issues = self.pair.issues if self.pair is not None else tuple(deferred_issues)
        issues = [i for i in (*pair_issues, *hints, *issues_tau, *self._metadata()) if i.code not in ignore]
        reader_checks = [found.issues for found in reader if found is not None]
        return pair_comparison(
            pooled,
            self.held,
            self.pair,
            rows,
            issues,
            reader_checks,
            labels=self.labels,
            streams=self.sources.streams,
            settings=self.settings,
            diagnosis=diagnosis,
            tau_fit=tau,
            side_meta=side_meta,
            exact=exact_result,
        )

    def _tau(self, rows: list[ReportRow]) -> tuple[float | None, list[Issue]]:
        """The exact temperature fit (`--model`): its rows appended to `rows`, its value and warning."""
        model = self.settings.model
        if model is None:
            return None, []
        from pgdiag.compare.tau import exact_tau

        assert self.tau_samples is not None and self.pooled is not None and self.labels is not None
        tau = exact_tau(self.tau_samples, model)
        name = self.name
        rows.append(ReportRow(name, "token", "all", "all", "mismatch/tau_fit", tau.tau, "1", "fit", tau.n))
        rows.append(
            ReportRow(name, "token", "all", "all", "mismatch/tau_fit_rms", tau.rms, "nats", "fit", tau.n)
        )
        return tau.tau, _tau_warning(name, *self.labels, self.pooled.n_tokens, tau.tau)

    def _metadata(self) -> list[Issue]:
        """The footer checks of the compared streams of each run read from disk."""
        src = self.sources
        sa, sb = src.streams
        meta_a = Side(None, None, None if isinstance(src.a, TokenBatch) else src.a)
        if src.one_run:
            return _metadata_issues(meta_a, [sa, sb])
        meta_b = Side(None, None, None if isinstance(src.b, TokenBatch) else src.b)
        return _metadata_issues(meta_a, [sa]) + _metadata_issues(meta_b, [sb])
