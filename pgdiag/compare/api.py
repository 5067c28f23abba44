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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from pgdiag.checks.signatures import Signatures, signature_issues
from pgdiag.compare import breakdowns as bd
from pgdiag.compare.align import AlignedPair, Deferred, align_batches, finite_only, unmatched_side
from pgdiag.compare.exact import (
    EXACT_GATES,
    ExactAgreement,
    ExactResult,
    check_float32_storage,
    exact_rows,
)
from pgdiag.compare.parity import unit_and_reduction
from pgdiag.compare.pieces import Piece, checked_matches, concat_batches, plan_pieces
from pgdiag.compare.pooled import PooledParity
from pgdiag.compare.settings import CompareSettings
from pgdiag.compare.side_by_side import SideMetrics, side_by_side_rows, side_settings
from pgdiag.compare.worst import token_decoder
from pgdiag.data.batch import TokenBatch
from pgdiag.data.validate import CheckResult, CheckSettings, Issue, merge_check_results, raise_first_error
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.metrics.api import metric_streams
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.gates import gate_policy
from pgdiag.report.report import CHECKS_SCHEMA, Report, ReportRow, summary_frame

if TYPE_CHECKING:
    from pgdiag.compare.tokens import TokenTableWriter

_CANONICAL = ("rollout", "old", "ref", "new")
_DLOGP_STEPS = (1e-6, 1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0)  # nats
DLOGP_EDGES = (-np.inf, *(-x for x in reversed(_DLOGP_STEPS)), 0.0, *_DLOGP_STEPS, np.inf)  # Δ histogram bins


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


def auto_stream(streams: Sequence[str], *, exclude: str | None = None) -> str | None:
    """First present of new, old, the only recompute tag, rollout, skipping `exclude`."""
    present = [s for s in streams if s != exclude]
    tags = [s for s in present if s not in _CANONICAL]
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
            "E111", f"cannot choose --stream-a among {list(streams_a)}", "name one with --stream-a"
        )
    if stream_b is None and one_run:  # engine vs trainer: old, else the recomputed policy
        stream_b = (
            "old" if "old" in streams_a and stream_a != "old" else auto_stream(streams_a, exclude=stream_a)
        )
    elif stream_b is None:
        stream_b = stream_a
    if stream_b is None or (one_run and stream_b == stream_a):
        raise UsageError(
            "E111",
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
) -> Side:
    """Read `source` (a run, or a piece of one: `in_pieces`, its rules judged over the run merged at the end):
    the compared `streams` plus, for side-by-side `metrics` (resolved), theirs."""
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
        advantages=metrics is not None,
        reward=True,
        env=True,
        ignore=checks.ignore,
        max_examples=checks.max_examples,
        piece=in_pieces,
    )
    return Side(loaded.batch, loaded.checks, run, metrics)


def _read_side_b(
    run: Any,
    piece: Piece,
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


def _rows(
    pair: str,
    scope: str,
    breakdown: str,
    table: dict[str, np.ndarray],
    bucket_index: int,
    bucket: str,
    lo: float | None,
    hi: float | None,
    n_key: str,
) -> list[ReportRow]:
    n = int(table[n_key][bucket_index])
    rows = []
    for stat, values in table.items():
        if stat in ("tokens", "samples"):
            continue
        unit, reduction = unit_and_reduction(stat, scope)
        key = "count/mismatch_abs_delta_gt_20" if stat == "abs_delta_gt_20" else f"mismatch/{stat}"
        rows.append(
            ReportRow(
                pair, scope, breakdown, bucket, key, float(values[bucket_index]), unit, reduction, n, lo, hi
            )
        )
    return rows


def parity_rows(pooled: PooledParity, name: str) -> tuple[list[ReportRow], dict[str, float | None]]:
    """Every summary row of one pair from its pooled pieces; also the `all` token stats by name."""
    rows: list[ReportRow] = []
    tokens = pooled.token_table()
    rows += _rows(name, "token", "all", tokens, 0, "all", None, None, "tokens")
    n_tok = pooled.n_tokens
    rows.append(ReportRow(name, "token", "all", "all", "count/mismatch_tokens", n_tok, "count", "sum", n_tok))
    rows.append(
        ReportRow(
            name, "token", "all", "all", "count/mismatch_invalid", pooled.n_invalid, "count", "sum", n_tok
        )
    )
    seqs = pooled.sequence_table()
    rows += _rows(name, "sequence", "all", seqs, 0, "all", None, None, "samples")
    n_seq = int(seqs["samples"][0])
    rows.append(ReportRow(name, "sequence", "all", "all", "count/samples", n_seq, "count", "sum", n_seq))
    for breakdown in pooled.by:
        for label, lo, hi, table in pooled.bucket_rows(breakdown):
            rows += _rows(name, "token", breakdown, table, 0, label, lo, hi, "tokens")
    rows += _dlogp_rows(name, pooled.hist, pooled.n_zero, n_tok)
    stats = {k: (None if not np.isfinite(v[0]) else float(v[0])) for k, v in tokens.items()}
    return rows, stats


def _dlogp_rows(name: str, counts: np.ndarray, n_zero: int, n_tokens: int) -> list[ReportRow]:
    """Token counts per Δ bin (breakdown `dlogp`): the histogram behind the dlogp-hist plot, over all tokens."""
    edges = np.asarray(DLOGP_EDGES)
    rows = []
    for k in range(edges.shape[0] - 1):
        lo, hi = float(edges[k]), float(edges[k + 1])
        rows.append(
            ReportRow(
                name,
                "token",
                "dlogp",
                f"[{lo:g},{hi:g})",
                "count/tokens",
                int(counts[k]),
                "count",
                "sum",
                n_tokens,
                lo,
                hi,
            )
        )
    rows.append(
        ReportRow(name, "token", "dlogp", "0", "count/tokens", n_zero, "count", "sum", n_tokens, 0.0, 0.0)
    )
    return rows


def _checks_frame(issues: Sequence[Issue], reader_checks: Sequence[pl.DataFrame | None]) -> pl.DataFrame:
    own = pl.DataFrame(
        {
            "code": [i.code for i in issues],
            "severity": [i.severity for i in issues],
            "count": [i.count for i in issues],
            "message": [i.message for i in issues],
            "step": [i.step for i in issues],
            "sample_id": [i.sample_id for i in issues],
            "pos": [i.pos for i in issues],
        },
        schema=CHECKS_SCHEMA,
    )
    frames = [f.select(list(CHECKS_SCHEMA)).cast(CHECKS_SCHEMA) for f in reader_checks if f is not None]
    return pl.concat([*frames, own], how="vertical")


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


@dataclass(frozen=True)
class Comparison:
    """A finished comparison: the report, the worst sequence's trace and the tokens that token plots read.

    `pair` holds every aligned token when the runs were read in one piece (in-memory batches, one piece of
    steps, `keep_tokens=True`), else None: a comparison read step by step keeps
    `tokens`, every k-th matched token's (pair, lp_a, lp_b) (k = 1 up to 4,000,000 tokens,
    `pooled.SAMPLE_CAP`), which the token plots draw. docs/compare.md says which reads are whole.
    `tokens_file` is the token table written with `tokens_out` (else None).
    """

    report: Report
    pair: AlignedPair | None
    tokens: AlignedPair | pl.DataFrame  # what token plots read
    worst_trace: pl.DataFrame
    tokens_file: Path | None = None

    def trace(self) -> pl.DataFrame:
        """Both streams along the worst sequence (`worst.worst_trace`)."""
        return self.worst_trace


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
    runs whole and keeps every aligned token in memory in `Comparison.pair`. Returns a `Comparison`. Raises
    `InvalidInputError` (exit 3) on alignment errors, `UsageError` (exit 2) on bad options.
    """
    if settings is None:
        settings = CompareSettings.from_options(**options)
    elif options:
        raise UsageError("E514", "give either a CompareSettings or keyword options, not both")
    if tokens_out is None:
        return _compare_runs(a, b, settings, decode=decode, keep_tokens=keep_tokens, writer=None)
    from pgdiag.compare.tokens import TokenTableWriter

    with TokenTableWriter(tokens_out, overwrite=overwrite) as writer:  # removed on any error
        comparison = _compare_runs(a, b, settings, decode=decode, keep_tokens=keep_tokens, writer=writer)
        return replace(comparison, tokens_file=writer.commit())


def _compare_runs(
    a: Any,
    b: Any,
    settings: CompareSettings,
    *,
    decode: Callable[[Sequence[int]], str] | None,
    keep_tokens: bool,
    writer: TokenTableWriter | None,
) -> Comparison:
    """`compare_runs` once its settings are built; each piece's matched tokens go to `writer` when given."""
    if decode is None and settings.tokenizer is not None:
        decode = token_decoder(settings.tokenizer)
    ignore = settings.checks.ignore
    eps_low, eps_high = settings.clip.eps_low, settings.clip.eps_high
    stream_a, stream_b, join, by = settings.stream_a, settings.stream_b, settings.join, settings.by
    label_a, label_b, worst_k, model = settings.label_a, settings.label_b, settings.worst_k, settings.model
    one_run = b is None
    a = _as_source(a)
    b = None if one_run else _as_source(b)
    streams_a = _streams_of(a)
    streams_b = None if one_run else _streams_of(b)
    sa, sb = resolve_streams(streams_a, streams_b, stream_a, stream_b)
    if not one_run and sb not in streams_b:
        raise UsageError(
            "E111", f"run b has no stream {sb!r}; streams: {', '.join(streams_b)}", "name it with --stream-b"
        )
    metrics_a = metrics_b = None
    if settings.metrics is not None:  # each run's own metrics: resolved first, so each run is read once
        metrics_a = side_settings(
            None if isinstance(a, TokenBatch) else a, sb if one_run else sa, settings.metrics
        )
        if not one_run:
            metrics_b = side_settings(None if isinstance(b, TokenBatch) else b, sb, settings.metrics)
    in_memory = isinstance(a, TokenBatch) or isinstance(b, TokenBatch)
    whole = (
        in_memory
        or keep_tokens
        or (settings.metrics is not None and settings.metrics.docs_per_step is not None)
        or (join == "hash-any-step" and (settings.metrics is not None or model is not None))
    )
    from pgdiag.compare.tau import TauSamples
    from pgdiag.data.runs import restrict_steps

    plan = plan_pieces(
        a, b, one_run=one_run, whole=whole, join=join, chunk_rows=settings.chunk_rows, ignore=ignore
    )
    pieces = plan.pieces
    if len(pieces) > 1:
        join = _resolve_join(a, a if one_run else b, join)
    pooled: PooledParity | None = None
    held: Deferred | None = None
    checks_a: list[CheckResult] = []  # reader checks of each piece, merged per code and rule at the end
    checks_b: list[CheckResult] = []
    shown: list[SideMetrics] = []  # each run's own metrics, fed piece by piece (--metrics)
    tau_samples = None if model is None else TauSamples()  # the first matched tokens the τ fit reads
    exact = ExactAgreement() if settings.exact else None
    if exact is not None:
        check_float32_storage(a, sa)
        check_float32_storage(a if one_run else b, sb)
    pair: AlignedPair | None = None
    side_a = side_b = None
    la = lb = ""
    for piece in pieces:
        src_a = a if piece.steps is None else restrict_steps(a, piece.steps)
        side_a = (
            _read_side(src_a, [sa, sb] if one_run else [sa], settings.checks, metrics_a, len(pieces) > 1)
            if piece.in_a
            else None
        )
        if one_run:
            side_b = side_a
        elif piece.in_b:
            side_b = _read_side_b(b, piece, [sb], settings.checks, metrics_b, len(pieces) > 1)
        else:
            side_b = None
        if side_a is not None and side_a.checks is not None:
            checks_a.append(side_a.checks)
        if not one_run and side_b is not None and side_b.checks is not None:
            checks_b.append(side_b.checks)
        if not la:
            la, lb = _labels(
                side_a.batch if side_a else None,
                side_b.batch if side_b else None,
                label_a,
                label_b,
                one_run,
                a,
                b,
            )
        if held is None and plan.keys is not None:  # hash-any-step in pieces: samples paired on the keys
            held = plan.keys.deferred(f"{la}:{sa} vs {lb}:{sb}", la, lb)
        if metrics_a is not None and not shown:
            shown.append(SideMetrics(la, a, metrics_a))
            if metrics_b is not None:
                shown.append(SideMetrics(lb, b, metrics_b))
        # each run's own metrics before the pair is aligned and the batch dropped; a lone step feeds its run
        for metric_side, side in zip(shown, (side_a, side_b), strict=False):
            if side is not None:
                metric_side.add(side.batch)
        if side_a is None or side_b is None:  # a step present in one run only: all its samples unmatched
            if plan.keys is not None:  # counted on the keys; read for its reader checks
                continue
            lone, which = (side_b, "b") if side_a is None else (side_a, "a")
            part = unmatched_side(
                replace(lone.batch, label=lb if which == "b" else la),
                side=which,
                pair_name=f"{la}:{sa} vs {lb}:{sb}",
                label_other=la if which == "b" else lb,
                join=join,
            )
            held = part if held is None else held.merge(part)
            continue
        batch_a = replace(side_a.batch, label=la)
        batch_b = batch_a if one_run else replace(side_b.batch, label=lb)
        piece_pair = align_batches(
            batch_a,
            batch_b,
            stream_a=sa,
            stream_b=sb,
            join=join,
            ignore=ignore,
            deferred=len(pieces) > 1,
            matches=checked_matches(piece, batch_a, batch_b),
            keep_nonfinite=exact is not None,
        )
        del batch_a, batch_b
        if exact is not None:
            exact.add(piece_pair)
            piece_pair = finite_only(piece_pair)
        side_a = _aligned(side_a)
        side_b = side_a if one_run else _aligned(side_b)
        if piece_pair.deferred is not None:
            held = piece_pair.deferred if held is None else held.merge(piece_pair.deferred)
        if piece_pair.n_samples == 0:  # nothing matched in these steps: counted in E306 (deferred) only
            continue
        if pooled is None:
            chosen = bd.available(piece_pair) if by is None else tuple(by)
            pooled = PooledParity(
                by=chosen,
                eps_low=eps_low,
                eps_high=eps_high,
                worst_k=worst_k,
                decode=decode,
                pieces=len(pieces),
            )
        pooled.add(piece_pair, np.asarray(DLOGP_EDGES))
        if writer is not None:
            writer.add(piece_pair)
        if tau_samples is not None and not tau_samples.full:
            tau_samples.add(piece_pair, _input_ids_of(piece_pair, side_b))
        if len(pieces) == 1:
            pair = piece_pair
        del piece_pair
    reader_a, reader_b = merge_check_results(checks_a), merge_check_results(checks_b)
    raise_first_error([*reader_a.found, *reader_b.found])  # E206's share and E302 by nulls, over the run
    deferred_issues: list[Issue] = []
    if held is not None:
        deferred_issues = held.shift_issues(ignore)  # E302 on the sample pooled over the pieces
        deferred_issues += held.unmatched_issues(ignore)  # E304 raises, E306 raises unless ignored
        deferred_issues += held.mask_issues(ignore)
    assert pooled is not None  # E304 raised above when no piece matched
    name = f"{la}:{sa} vs {lb}:{sb}"
    rows, diagnosis = diagnosed_rows(pooled, name, la, lb, sa)
    tau = None
    issues_tau: list[Issue] = []
    if model is not None:
        from pgdiag.compare.tau import exact_tau

        assert tau_samples is not None
        tau = exact_tau(tau_samples, model)
        rows.append(ReportRow(name, "token", "all", "all", "mismatch/tau_fit", tau.tau, "1", "fit", tau.n))
        rows.append(
            ReportRow(name, "token", "all", "all", "mismatch/tau_fit_rms", tau.rms, "nats", "fit", tau.n)
        )
        issues_tau = _tau_warning(name, la, lb, pooled.n_tokens, tau.tau)
    exact_result = None
    if exact is not None:
        found = [*(pair.issues if pair is not None else ()), *deferred_issues]
        exact_result = exact.finish(sum(i.count for i in found if i.code in ("W303", "E303")))
        rows += exact_rows(exact_result, name)
    side_meta: dict[str, Any] = {}
    if shown:
        side_rows, side_meta = side_by_side_rows(shown)
        rows += side_rows
    meta_a = Side(None, None, None if isinstance(a, TokenBatch) else a)
    if one_run:
        issues_meta = _metadata_issues(meta_a, [sa, sb])
    else:
        meta_b = Side(None, None, None if isinstance(b, TokenBatch) else b)
        issues_meta = _metadata_issues(meta_a, [sa]) + _metadata_issues(meta_b, [sb])
    hints = diagnosis.issues
    if tau is not None:  # the exact fit supersedes the slope hint's temperature warning
        hints = tuple(i for i in hints if not (i.code == "W401" and i.message.startswith(f"{name}: slope")))
    pair_issues = pair.issues if pair is not None else ()
    if pair is None:
        pair_issues = tuple(deferred_issues)
    issues = [i for i in (*pair_issues, *hints, *issues_tau, *issues_meta) if i.code not in ignore]
    reader_checks = [reader_a.issues] if checks_a else []
    if checks_b:
        reader_checks.append(reader_b.issues)
    return pair_comparison(
        pooled,
        held,
        pair,
        rows,
        issues,
        reader_checks,
        labels=(la, lb),
        streams=(sa, sb),
        settings=settings,
        diagnosis=diagnosis,
        tau_fit=None if tau is None else tau.tau,
        side_meta=side_meta,
        exact=exact_result,
    )


def diagnosed_rows(
    pooled: PooledParity, name: str, label_a: str, label_b: str, stream_a: str
) -> tuple[list[ReportRow], Signatures]:
    """The summary rows of one pair (`parity_rows`) with the signature rows (first-token ratio, τ hint), and
    the signatures' findings."""
    rows, stats = parity_rows(pooled, name)
    signature = pooled.signature
    assert signature is not None
    diagnosis = signature_issues(
        signature,
        name=name,
        name_a=label_a,
        name_b=label_b,
        sampling_side_is_engine=stream_a == "rollout",
        fit=(stats.get("fit_slope"), stats.get("pearson_r")),
    )
    n = pooled.n_tokens
    if diagnosis.first_token_ratio is not None:
        rows.append(
            ReportRow(
                name,
                "token",
                "all",
                "all",
                "mismatch/first_token_ratio",
                diagnosis.first_token_ratio,
                "ratio",
                "token-mean",
                n,
            )
        )
    if diagnosis.slope is not None:
        rows.append(
            ReportRow(name, "token", "all", "all", "mismatch/tau_hint", diagnosis.slope, "1", "fit", n)
        )
    return rows, diagnosis


def pair_comparison(
    pooled: PooledParity,
    held: Deferred | None,
    pair: AlignedPair | None,
    rows: list[ReportRow],
    issues: list[Issue],
    reader_checks: list[pl.DataFrame],
    *,
    labels: tuple[str, str],
    streams: tuple[str, str],
    settings: CompareSettings,
    diagnosis: Signatures,
    tau_fit: float | None,
    side_meta: dict[str, Any] | None = None,
    exact: ExactResult | None = None,
) -> Comparison:
    """The `Comparison` of one pooled pair: its summary rows, checks (`issues` after the reader's), meta, worst
    tables and trace. `pair` is the aligned pair of a one-piece read (else None: `held` has the counts);
    `side_meta`: the side-by-side metric sets' meta (`--metrics`), stored as ``side_metrics``."""
    la, lb = labels
    sa, sb = streams
    name = f"{la}:{sa} vs {lb}:{sb}"
    checks = _checks_frame(issues, reader_checks)
    assert pair is not None or held is not None
    n_samples_a = pair.n_samples_a if pair is not None else held.n_a
    n_samples_b = pair.n_samples_b if pair is not None else held.n_b
    meta = {
        "pairs": [name],
        "gate_policy": gate_policy(
            default_family="mismatch", fail_on=EXACT_GATES if exact is not None else ()
        ),
        "labels": {"a": la, "b": lb},
        "streams": {"a": sa, "b": sb},
        "join": pair.join if pair is not None else held.join,
        "by": list(pooled.by),
        "eps_low": settings.clip.eps_low,
        "eps_high": settings.clip.eps_high,
        "worst_k": settings.worst_k,
        "ignored": sorted(settings.checks.ignore),
        "inputs": {
            "n_samples": {la: n_samples_a, lb: n_samples_b},
            "n_matched_samples": pooled.n_samples,
            "n_tokens": pooled.n_tokens,
            "steps": sorted(pooled.steps),
        },
        "diagnosis": {
            name: {
                "tau_hint": diagnosis.slope,
                "tau_fit": tau_fit,
                "tau_source": "logits (--model)" if tau_fit is not None else "fit_slope (logprob-only hint)",
                "first_token_ratio": diagnosis.first_token_ratio,
            }
        },
        **({"side_metrics": side_meta} if side_meta else {}),
        **({"exact": {name: exact.as_dict()}} if exact is not None else {}),
    }
    worst_tok, worst_seq = pooled.worst()
    report = Report(
        kind="compare",
        summary=summary_frame(rows),
        meta=meta,
        checks=checks,
        worst_tokens=worst_tok,
        worst_seqs=worst_seq,
    )
    trace = pooled.trace
    assert trace is not None
    return Comparison(report, pair, pair if pair is not None else pooled.plot_tokens(name), trace)


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
            "E512", "--model needs runs read from disk (the fit recomputes logits from input_ids)"
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
            raise InvalidInputError("E103", f"{run.label}: cannot read column input_ids ({exc})") from exc
        by_row = dict(zip(frame["_pgdiag_row"].to_list(), frame["input_ids"], strict=True))
        return [by_row[int(r)].to_numpy() for r in source_rows]

    return read


def _tau_warning(name: str, label_a: str, label_b: str, n_tokens: int, tau: float | None) -> list[Issue]:
    if tau is None or abs(tau - 1.0) <= TAU_WARN:
        return []
    return [
        Issue(
            "W401",
            "warning",
            n_tokens,
            f"{name}: best-fit temperature {tau:.4g} from {label_b}'s logits: {label_a} looks "
            f"sampled at T ≈ {tau:.3g} relative to {label_b}; check temperature on both sides",
        )
    ]
