"""`compare_runs(a, b)`: the library function behind `pgdiag compare` (docs/compare.md).

What: reads two runs (or two streams of one run), aligns them (`align`), computes the parity table at token and
sequence scope (`parity`), the breakdowns (`breakdowns`), the logprob-only signatures (`pgdiag.checks.signatures`, as `pgdiag check` runs them), the worst-K
tables (`worst`) and, on request, each run's own metric set side by side; returns one `Report`.
Why: the CLI, notebooks and tests all get the same numbers from one call; nothing here prints.
How: inputs are `Run`s, paths (read with `pgdiag.data.runs.read_run`) or in-memory `TokenBatch`es. Runs on disk
are read in pieces of whole consecutive steps of both runs (under ``--join hash-any-step``, steps of run a with
the steps of run b that hold their matches, paired once on the key columns: `pieces`), each aligned, checked
and reduced into `pooled.PooledParity` before the next is read (docs/compare.md, "Reading step by step").
Streams resolve as
docs/compare.md says: one run, a = `rollout`, b = `old` (engine vs trainer), else the first present of `new`, the
only recompute tag, `rollout` (excluding a); two runs, a = first present of that list in run a, b = the same name. Rows follow the tidy
report schema (docs/compare.md); side-by-side run metrics use scope `batch`, which compare's gates never read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from pgdiag.compare.pair_fold import PairFold, PairSources, PieceSides, Side
from pgdiag.compare.pair_report import Comparison
from pgdiag.compare.pieces import concat_batches, plan_pieces
from pgdiag.compare.settings import CompareSettings
from pgdiag.compare.side_by_side import side_settings
from pgdiag.compare.worst import token_decoder
from pgdiag.data.batch import TokenBatch
from pgdiag.data.pieces import PairPiece
from pgdiag.data.reader import RunsReader
from pgdiag.data.schema import BASE_STREAMS
from pgdiag.data.validate import CheckResult, CheckSettings
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.accumulators import RowFold
from pgdiag.metrics.resolve import metric_streams
from pgdiag.metrics.settings import MetricSettings

if TYPE_CHECKING:
    from pgdiag.compare.tokens import TokenTableWriter


def auto_stream(streams: Sequence[str], *, exclude: str | None = None) -> str | None:
    """First present of new, old, the only recompute tag, rollout, skipping `exclude`."""
    present = [s for s in streams if s != exclude]
    tags = [s for s in present if s not in BASE_STREAMS]
    for name in ("new", "old"):
        if name in present:
            return name
    if len(tags) == 1:
        return tags[0]
    return "rollout" if "rollout" in present else None


def resolve_streams(
    streams_a: Sequence[str], streams_b: Sequence[str] | None, stream_a: str | None, stream_b: str | None
) -> tuple[str, str]:
    """(stream_a, stream_b) after the defaults of docs/compare.md; UsageError naming the streams present."""
    one_run = streams_b is None
    if stream_a is None:
        stream_a = "rollout" if one_run and "rollout" in streams_a else auto_stream(streams_a)
    if stream_a is None:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"cannot choose --stream-a among {list(streams_a)}",
            "name one with --stream-a",
        )
    if stream_b is None and one_run:  # engine vs trainer: old, else the recomputed policy
        stream_b = (
            "old" if "old" in streams_a and stream_a != "old" else auto_stream(streams_a, exclude=stream_a)
        )
    elif stream_b is None:
        stream_b = stream_a
    if stream_b is None or (one_run and stream_b == stream_a):
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"one run needs two different streams; present: {', '.join(streams_a)}",
            "name them with --stream-a and --stream-b",
        )
    return stream_a, stream_b


def _read_side(
    source: Any,
    streams: Sequence[str],
    checks: CheckSettings,
    metrics: MetricSettings | None,
    in_pieces: bool = False,
    advantages: bool = False,
) -> Side:
    """Read `source` (a run, or a piece of one: `in_pieces`, its rules judged over the run merged at the end):
    the compared `streams` plus, for side-by-side `metrics` (resolved), theirs (and the advantages: `advantages`)."""
    if isinstance(source, TokenBatch):
        return Side(source, None, None)
    from pgdiag.data.load import read_token_batch

    run = source
    wanted = list(dict.fromkeys([*streams, *(metric_streams(metrics) if metrics is not None else [])]))
    entropy = [s for s in wanted if s in run.entropy_streams]
    if metrics is not None and metrics.entropy is not None and metrics.entropy not in entropy:
        entropy.append(metrics.entropy)
    loaded = read_token_batch(
        run,
        streams=wanted,
        entropy=entropy,
        advantages=metrics is not None or advantages,
        reward=True,
        env=True,
        ignore=checks.ignore,
        max_examples=checks.max_examples,
        piece=in_pieces,
        raise_errors=not in_pieces,  # in pieces the reader (`RunsReader`) raises the run's first error at the end
    )
    return Side(loaded.batch, loaded.checks, run, metrics)


def _read_side_b(
    run: Any,
    piece: PairPiece,
    streams: Sequence[str],
    checks: CheckSettings,
    metrics: MetricSettings | None,
    in_pieces: bool = False,
) -> Side:
    """Side b of `piece`: its steps, or under hash-any-step the steps first read with it and then those read
    again (their reader checks were counted with their first read, so only the first read's are kept)."""
    from pgdiag.data.runs import restrict_steps

    steps = piece.b_steps
    first = None
    if steps is None or steps:
        first = _read_side(
            run if steps is None else restrict_steps(run, steps), streams, checks, metrics, in_pieces
        )
    if not piece.steps_b_again:
        assert first is not None
        return first
    again = _read_side(restrict_steps(run, piece.steps_b_again), streams, checks, metrics, in_pieces)
    if first is None:
        return replace(again, checks=None)
    return replace(first, batch=concat_batches(first.batch, again.batch))


def _as_source(source: Any) -> Any:
    """A `TokenBatch` or `Run` as given; a path is read once with `read_run`."""
    if isinstance(source, TokenBatch):
        return source
    from pgdiag.data.runs import Run, read_run

    return source if isinstance(source, Run) else read_run(Path(source))


def _streams_of(source: Any) -> list[str]:
    return list(source.streams)


def _resolve_join(a: Any, b: Any, join: str) -> str:
    """`auto` decided on the whole runs' keys, as one piece would: id when at least half of a's samples match on
    (step, sample_id, segment_idx), else hash."""
    if join != "auto":
        return join

    def keys(run: Any) -> pl.DataFrame:
        names = run.lazy.collect_schema().names()
        segment = pl.col("segment_idx").fill_null(0) if "segment_idx" in names else pl.lit(0)
        return run.lazy.select(
            pl.col("step").cast(pl.Int64),
            pl.col("sample_id").cast(pl.String),
            segment.cast(pl.Int32).alias("seg"),
        ).collect()

    ka = keys(a)
    matched = ka.join(keys(b).unique(), on=["step", "sample_id", "seg"], how="inner").height
    return "hash" if 2 * matched < ka.height else "id"


def compare_runs(
    a: Any,
    b: Any = None,
    settings: CompareSettings | None = None,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
    keep_tokens: bool = False,
    tokens_out: str | Path | None = None,
    overwrite: bool = False,
    accumulators: Sequence[RowFold] = (),
    **options: Any,
) -> Comparison:
    """Parity of `a` against `b` (or of two streams of `a` when `b` is None). Δ = lp_b − lp_a.

    `a`, `b`: a `Run`, a run path, or a `TokenBatch`. `settings`: a `CompareSettings`; without it, flat keyword
    options build one (``compare_runs(a, b, by=["step"], eps_low=0.1)``, `CompareSettings.from_options`).
    `decode`: token ids -> text for the worst-token context (else `settings.tokenizer` is used).
    Runs on disk are read step by step, `settings.chunk_rows` rows of both runs at a time (docs/compare.md).
    `tokens_out`: a .parquet path; every matched token is written there piece by piece
    (`tokens.TokenTableWriter`, `--tokens-out`), the file appearing only when the comparison succeeds (E502 when
    it exists and not `overwrite`; its path in `Comparison.tokens_file`). `keep_tokens=True` (notebooks) reads the
    runs whole and keeps every aligned token in memory in `Comparison.pair`. `accumulators`
    (`metrics.accumulators.RowFold`, e.g. `--losses`) get side a's batch of every piece, their streams and the
    advantages read too, and their rows join the report. Returns a `Comparison`. Raises
    `InvalidInputError` (exit 3) on alignment errors, `UsageError` (exit 2) on bad options.
    """
    if settings is None:
        settings = CompareSettings.from_options(**options)
    elif options:
        raise UsageError(Code.SETTINGS_TWICE, "give either a CompareSettings or keyword options, not both")
    if tokens_out is None:
        return _compare_runs(a, b, settings, decode, keep_tokens, None, tuple(accumulators))
    from pgdiag.compare.tokens import TokenTableWriter

    with TokenTableWriter(tokens_out, overwrite=overwrite) as writer:  # removed on any error
        comparison = _compare_runs(a, b, settings, decode, keep_tokens, writer, tuple(accumulators))
        return replace(comparison, tokens_file=writer.commit())


def _compare_runs(
    a: Any,
    b: Any,
    settings: CompareSettings,
    decode: Callable[[Sequence[int]], str] | None,
    keep_tokens: bool,
    writer: TokenTableWriter | None,
    accumulators: tuple[RowFold, ...] = (),
) -> Comparison:
    """`compare_runs` once its settings are built: the pieces planned, each read and folded into a `PairFold`;
    each piece's matched tokens go to `writer` when given."""
    if decode is None and settings.tokenizer is not None:
        decode = token_decoder(settings.tokenizer)
    sources = replace(_sources(a, b, settings), accumulators=accumulators)
    whole = (
        isinstance(sources.a, TokenBatch)
        or isinstance(sources.b, TokenBatch)
        or keep_tokens
        or (settings.metrics is not None and settings.metrics.docs_per_step is not None)
        or (settings.join == "hash-any-step" and (settings.metrics is not None or settings.model is not None))
    )
    a, b, one_run = sources.a, sources.b, sources.one_run
    plan = plan_pieces(
        a,
        b,
        one_run=one_run,
        whole=whole,
        join=settings.join,
        chunk_rows=settings.chunk_rows,
        ignore=settings.checks.ignore,
    )
    n = len(plan.pieces)
    join = settings.join if n == 1 else _resolve_join(a, a if one_run else b, settings.join)
    pair = PairFold(sources, settings, join=join, n_pieces=n, keys=plan.keys, decode=decode, writer=writer)
    reader = RunsReader(  # each run's checks merged, its first error raised after the last piece
        plan.pieces,
        lambda piece, many: _read_piece(sources, piece, settings.checks, in_pieces=many),
        n_runs=1 if one_run else 2,
    )
    for piece in reader:
        pair.add(piece.read)
        del piece  # the piece's batches go before the reader reads the next one (peak memory)
    return pair.finish(reader.finish())


def _sources(a: Any, b: Any, settings: CompareSettings) -> PairSources:
    """The two sources (paths read once), their compared streams (docs/compare.md defaults; E111) and each
    side's `--metrics` settings, resolved before any piece is read so each run is read once."""
    one_run = b is None
    a = _as_source(a)
    b = None if one_run else _as_source(b)
    streams_a = _streams_of(a)
    streams_b = None if one_run else _streams_of(b)
    sa, sb = resolve_streams(streams_a, streams_b, settings.stream_a, settings.stream_b)
    if streams_b is not None and sb not in streams_b:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"run b has no stream {sb!r}; streams: {', '.join(streams_b)}",
            "name it with --stream-b",
        )
    metrics_a = metrics_b = None
    if settings.metrics is not None:
        metrics_a = side_settings(
            None if isinstance(a, TokenBatch) else a, sb if one_run else sa, settings.metrics
        )
        if not one_run:
            metrics_b = side_settings(None if isinstance(b, TokenBatch) else b, sb, settings.metrics)
    return PairSources(a, b, (sa, sb), (metrics_a, metrics_b))


def _read_piece(
    sources: PairSources, piece: PairPiece, checks: CheckSettings, *, in_pieces: bool
) -> tuple[PieceSides, list[CheckResult | None]]:
    """Both sides of `piece` read (side a's steps; side b's, or under hash-any-step the steps of b it needs), and
    the reader's checks of each run read (run a's alone for two streams of one run)."""
    from pgdiag.data.runs import restrict_steps

    (sa, sb), (metrics_a, metrics_b) = sources.streams, sources.metrics
    a = sources.a if piece.steps is None else restrict_steps(sources.a, piece.steps)
    streams = list(
        dict.fromkeys([sa, sb] if sources.one_run else [sa]) | dict.fromkeys(sources.extra_streams)
    )
    extra = bool(sources.accumulators)
    side_a = _read_side(a, streams, checks, metrics_a, in_pieces, extra) if piece.in_a else None
    checks_a = None if side_a is None else side_a.checks
    if sources.one_run:
        return PieceSides(piece, side_a, side_a), [checks_a]
    side_b = _read_side_b(sources.b, piece, [sb], checks, metrics_b, in_pieces) if piece.in_b else None
    return PieceSides(piece, side_a, side_b), [checks_a, None if side_b is None else side_b.checks]
