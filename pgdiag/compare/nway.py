"""N-way compare: several runs against one baseline on their common samples, plus a matrix of every pair.

What: `compare_many(runs, settings, baseline=0)` keeps the samples every run holds (the same (step, sample_id),
or (step, seq_hash) under ``join = "hash"``) and compares the baseline with each other run, and every other pair
for the matrix of the headline statistic. Why: "which of five trainers agrees with the reference?" needs one
table, on the same samples for every pair, not five commands on five different sample sets. How: runs on disk
are read in pieces of whole consecutive steps of all runs together (at most `CompareSettings.chunk_rows` rows of
all runs; docs/compare.md, "Several runs"): each run is read once, each piece restricted to the samples every
run holds in those steps (a sample's key holds its step, so a piece's common samples are the run's common
samples in those steps), and each pair of the piece is aligned and pooled (`PooledParity`) as a two-run
comparison read step by step pools its pieces; the reader (`pgdiag.data.reader.RunsReader`) merges each run's checks
over the pieces and raises the first run's first error after the last piece. So each pair's rows are what `compare_runs` gives for those two
runs restricted to the common samples: bit for bit when the runs fit in one piece (then read whole and compared
as in-memory batches), else to the pooled rounding of docs/compare.md. In-memory batches and
``--join hash-any-step`` (a sample may match in another step) are read whole. The report stacks the baseline
pairs' rows and adds the matrix as rows with breakdown ``matrix`` (which gates never read: gates read each
pair's ``all`` rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import polars as pl

from pgdiag.compare import breakdowns as bd
from pgdiag.compare.align import align_batches
from pgdiag.compare.alignment_issues import Deferred
from pgdiag.compare.api import _as_source, compare_runs, resolve_streams
from pgdiag.compare.pair_report import DLOGP_EDGES, Comparison, diagnosed_rows, pair_comparison
from pgdiag.compare.parity import token_table, token_terms
from pgdiag.compare.pooled import PooledParity, _merge_rows
from pgdiag.compare.settings import CompareSettings
from pgdiag.compare.worst import token_decoder
from pgdiag.data.batch import TokenBatch
from pgdiag.data.load import LoadedBatch
from pgdiag.data.pieces import plan_step_pieces
from pgdiag.data.reader import RunsReader
from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.report.report import Report, ReportRow, summary_frame

MATRIX_STATISTIC = "mismatch/abs_mean"  # mean |Δ| over matched tokens, nats: the headline statistic


@dataclass(frozen=True)
class NWayComparison:
    """Every run against the baseline (`comparisons`, in run order without the baseline), the report that
    stacks them with the matrix rows, and the matrix itself (run_a, run_b, value; every unordered pair once)."""

    report: Report
    comparisons: tuple[Comparison, ...]
    matrix: pl.DataFrame


def _labels(runs: Sequence[Any]) -> list[str]:
    """Each run's (or batch's) label; repeated labels get ``#<position>`` so every pair is named uniquely."""
    labels = [r.label for r in runs]
    return [f"{lab}#{i}" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def _sample_key(
    step: np.ndarray, sample_id: np.ndarray, seq_hash: np.ndarray | None, join: str
) -> np.ndarray:
    """(S,) the key a sample is common by: "step|sample_id", or "step|seq_hash" under a hash join (step 0 for
    hash-any-step)."""
    ident = seq_hash.astype(str) if join in ("hash", "hash-any-step") else sample_id.astype(str)
    step = np.zeros_like(step) if join == "hash-any-step" else step
    return np.char.add(np.char.add(step.astype(str), "|"), ident.astype(str))


def _common_of(keys: Sequence[np.ndarray]) -> list[np.ndarray]:
    """For each key array, the rows (in its own order) whose key every array holds (empty when none)."""
    common = keys[0]
    for k in keys[1:]:
        common = np.intersect1d(common, k)
    return [np.flatnonzero(np.isin(k, common)) for k in keys]


def _no_common_sample() -> InvalidInputError:
    return InvalidInputError(
        Code.NOTHING_MATCHED,
        "the runs share no sample: nothing to compare",
        "check the runs' steps (--steps) and the sample join (--join)",
    )


def _common_rows(batches: Sequence[TokenBatch], join: str) -> list[np.ndarray]:
    """For each batch, the rows (in its own order) of the samples every batch holds (E304 when none)."""
    keys = []
    for batch in batches:
        if join in ("hash", "hash-any-step") and batch.seq_hash is None:
            raise UsageError(
                Code.NEEDS_RUN_ON_DISK, f"{batch.label}: --join {join} needs runs read from disk (seq_hash)"
            )
        keys.append(_sample_key(batch.step, batch.sample_id, batch.seq_hash, join))
    rows = _common_of(keys)
    if rows[0].size == 0:
        raise _no_common_sample()
    return rows


def compare_many(
    runs: Sequence[Any], settings: CompareSettings | None = None, *, baseline: int = 0
) -> NWayComparison:
    """Compare every run of `runs` (two or more `Run`s, paths or `TokenBatch`es) with ``runs[baseline]`` on
    the samples all of them hold, and every pair for the matrix of ``mismatch/abs_mean``.

    Streams: `settings.stream_a` on the baseline (default as for two runs: new, old, the only tag, rollout),
    `settings.stream_b` on every other run (default: the baseline's stream name). Side-by-side metrics and the
    exact temperature fit (`settings.metrics`, `settings.model`) compare two runs only (E521).
    """
    settings = settings or CompareSettings()
    if len(runs) < 2:
        raise UsageError(Code.OPTIONS_CONFLICT, f"N-way compare needs at least two runs (got {len(runs)})")
    if not 0 <= baseline < len(runs):
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"--baseline {baseline}: choose a run from 0 to {len(runs) - 1}"
        )
    if settings.metrics is not None or settings.model is not None:
        raise UsageError(
            Code.OPTIONS_CONFLICT, "--metrics and --model compare two runs; give two RUNs or drop them"
        )
    sources = [_as_source(r) for r in runs]
    base = sources[baseline]
    other = next(s for i, s in enumerate(sources) if i != baseline)
    stream_base, stream_other = resolve_streams(
        list(base.streams), list(other.streams), settings.stream_a, settings.stream_b
    )
    streams = [stream_base if i == baseline else stream_other for i in range(len(sources))]
    for source, stream in zip(sources, streams, strict=True):
        _check_stream(source, stream)
    order = [i for i in range(len(sources)) if i != baseline]
    pairs = [(baseline, j) for j in order] + [(a, b) for a in order for b in order if a < b]
    pieces = _pieces(sources, settings)
    joins = _resolved_joins(sources, pairs, settings.join) if pieces else None
    if pieces and joins is not None:
        comparisons, values = _compare_in_pieces(sources, streams, pairs, pieces, joins, settings)
    else:
        comparisons, values = _compare_whole(sources, streams, pairs, settings)
    matrix_rows = []
    labels = _labels(sources)
    for (i, j), value in sorted(values.items()):
        matrix_rows.append({"run_a": labels[i], "run_b": labels[j], "value": value})
    matrix = pl.DataFrame(matrix_rows, schema={"run_a": pl.String, "run_b": pl.String, "value": pl.Float64})
    baseline_pairs = tuple(comparisons[(baseline, j)] for j in order)
    return NWayComparison(_report(baseline_pairs, matrix, labels[baseline]), baseline_pairs, matrix)


def _check_stream(source: Any, stream: str) -> None:
    if not isinstance(source, TokenBatch) and stream not in source.streams:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"{source.label}: no stream {stream!r}; streams: {', '.join(source.streams)}",
        )


def _pieces(sources: Sequence[Any], settings: CompareSettings) -> list[tuple[tuple[int, ...], list[bool]]]:
    """Consecutive steps of all runs under `settings.chunk_rows` rows (all runs together), each with whether
    each run has rows in it; [] (read whole) for in-memory batches, hash-any-step, a null step or runs that fit
    in one piece."""
    if settings.join == "hash-any-step" or any(isinstance(s, TokenBatch) for s in sources):
        return []
    planned = plan_step_pieces(sources, settings.chunk_rows).pieces
    if planned[0].steps is None:
        return []
    return [(p.steps, list(p.present)) for p in planned]


def _compare_whole(
    sources: Sequence[Any],
    streams: Sequence[str],
    pairs: Sequence[tuple[int, int]],
    settings: CompareSettings,
) -> tuple[dict[tuple[int, int], Comparison], dict[tuple[int, int], float]]:
    """Each run read once whole, restricted to the common samples, and every pair compared in memory: the
    comparison of every pair and its matrix value."""
    batches = [_read(source, stream, settings) for source, stream in zip(sources, streams, strict=True)]
    labels = _labels(batches)
    keep = _common_rows(batches, settings.join)
    batches = [replace(b.select(rows), label=lab) for b, rows, lab in zip(batches, keep, labels, strict=True)]

    def pair(i: int, j: int) -> Comparison:
        pair_settings = replace(
            settings, stream_a=streams[i], stream_b=streams[j], label_a=labels[i], label_b=labels[j]
        )
        return compare_runs(batches[i], batches[j], pair_settings)

    comparisons = {(i, j): pair(i, j) for i, j in pairs}
    values = {p: c.report.value(MATRIX_STATISTIC, scope="token") for p, c in comparisons.items()}
    return comparisons, values


@dataclass
class _PairState:
    """One pair of an N-way compare read in pieces: its pooled tables and deferred counts."""

    join: str  # resolved on the whole runs: id | hash
    matrix_only: bool  # a pair of two non-baseline runs: only its matrix value is reported
    pooled: PooledParity | None = None  # baseline pairs
    held: Deferred | None = None
    token_rows: list[dict[str, float]] = field(
        default_factory=list
    )  # matrix-only pairs: each piece's `all` row

    def matrix_value(self) -> float:
        """`MATRIX_STATISTIC` of a matrix-only pair, pooled as `PooledParity.token_table` pools it."""
        live = [r for r in self.token_rows if r["tokens"] > 0]
        row = self.token_rows[0] if len(self.token_rows) == 1 or not live else _merge_rows(live)
        return float(row[MATRIX_STATISTIC.removeprefix("mismatch/")])


def _compare_in_pieces(
    sources: Sequence[Any],
    streams: Sequence[str],
    pairs: Sequence[tuple[int, int]],
    pieces: Sequence[tuple[tuple[int, ...], list[bool]]],
    joins: dict[tuple[int, int], str],
    settings: CompareSettings,
) -> tuple[dict[tuple[int, int], Comparison], dict[tuple[int, int], float]]:
    """Every run read once, piece by piece; each piece restricted to its common samples and every pair of it
    aligned and pooled. Returns the baseline pairs' comparisons and every pair's matrix value; a matrix-only
    pair keeps each piece's `all` token row alone (its alignment checks still run)."""
    from pgdiag.data.runs import restrict_steps

    labels = _labels(sources)
    ignore = settings.checks.ignore
    decode = None if settings.tokenizer is None else token_decoder(settings.tokenizer)
    baseline_pairs = set(pairs[: len(sources) - 1])
    states = {p: _PairState(joins[p], p not in baseline_pairs) for p in pairs}
    edges = np.asarray(DLOGP_EDGES)
    any_common = False

    def read(piece: tuple[tuple[int, ...], list[bool]], many: bool) -> tuple[list[Any], list[Any]]:
        steps, present = (
            piece  # a run without rows here is not read; its partners' rows are, for their checks
        )
        loaded = [
            _read_loaded(restrict_steps(source, steps), stream, settings, piece=many) if here else None
            for source, stream, here in zip(sources, streams, present, strict=True)
        ]
        batches = [
            None if one is None else replace(one.batch, label=label)
            for one, label in zip(loaded, labels, strict=True)
        ]
        return batches, [None if one is None else one.checks for one in loaded]

    reader = RunsReader(
        pieces, read, n_runs=len(sources)
    )  # each run's first reader error after the last piece
    for read_piece in reader:
        batches, present = read_piece.read, read_piece.piece[1]
        del read_piece  # with `del batches` below: the piece goes before the reader reads the next one
        if not all(present):
            continue
        keys = [_sample_key(b.step, b.sample_id, b.seq_hash, settings.join) for b in batches]
        rows = _common_of(keys)
        if rows[0].size == 0:
            continue
        any_common = True
        for k, (batch, keep) in enumerate(zip(batches, rows, strict=True)):
            if keep.shape[0] != batch.n_samples:  # one copy at a time (peak memory); all rows: no copy
                batches[k] = batch.select(keep)
        del batch
        for (i, j), state in states.items():
            aligned = align_batches(
                batches[i],
                batches[j],
                stream_a=streams[i],
                stream_b=streams[j],
                join=state.join,
                ignore=ignore,
                deferred=True,
            )
            assert aligned.deferred is not None
            state.held = aligned.deferred if state.held is None else state.held.merge(aligned.deferred)
            if aligned.n_samples == 0:
                continue
            if state.matrix_only:
                eps = {"eps_low": settings.clip.eps_low, "eps_high": settings.clip.eps_high}
                terms = token_terms(aligned.lp_a, aligned.lp_b, delta=aligned.delta, **eps)
                table = token_table(aligned.lp_a, aligned.lp_b, terms=terms, **eps)
                state.token_rows.append({k: float(v[0]) for k, v in table.items()})
                continue
            if state.pooled is None:
                state.pooled = PooledParity(
                    by=bd.available(aligned) if settings.by is None else tuple(settings.by),
                    eps_low=settings.clip.eps_low,
                    eps_high=settings.clip.eps_high,
                    worst_k=settings.worst_k,
                    decode=decode,
                    pieces=len(pieces),
                )
            state.pooled.add(aligned, edges)
            del aligned
        del batches
    reader.finish()
    if not any_common:
        raise _no_common_sample()
    comparisons: dict[tuple[int, int], Comparison] = {}
    values: dict[tuple[int, int], float] = {}
    for (i, j), state in states.items():  # the pairs in order, as one read raises their errors
        if state.matrix_only:
            assert state.held is not None
            state.held.unmatched_issues(settings.checks.ignore)  # E304 raises, E306 unless ignored
            state.held.mask_issues(settings.checks.ignore)  # E303 raises unless ignored
            values[(i, j)] = state.matrix_value()
            continue
        comparisons[(i, j)] = _finish(state, labels[i], labels[j], streams[i], streams[j], settings)
        values[(i, j)] = comparisons[(i, j)].report.value(MATRIX_STATISTIC, scope="token")
    return comparisons, values


def _resolved_joins(
    sources: Sequence[Any], pairs: Sequence[tuple[int, int]], join: str
) -> dict[tuple[int, int], str] | None:
    """The join of each pair. `auto` is decided as one read of the pair's common samples decides it: id when at
    least half of side a's common samples match on (step, sample_id, segment_idx), else hash; from the key
    columns alone (`sample_keys`), read once per run. None when a key column cannot be read: the runs are then
    read whole, and the reader reports the column as it does for one read."""
    if join != "auto":
        return dict.fromkeys(pairs, join)
    from pgdiag.data.runs import sample_keys

    try:
        keys = [sample_keys(source) for source in sources]
    except InvalidInputError:
        return None
    common = _common_of(
        [_sample_key(k["step"].to_numpy(), k["sample_id"].to_numpy(), None, "id") for k in keys]
    )
    on = ["step", "sample_id", "segment_idx"]
    frames = [k[rows].select(on) for k, rows in zip(keys, common, strict=True)]
    joins = {}
    for i, j in pairs:
        matched = frames[i].join(frames[j], on=on, how="inner").height
        joins[(i, j)] = "hash" if 2 * matched < frames[i].height else "id"
    return joins


def _finish(
    state: _PairState, label_a: str, label_b: str, stream_a: str, stream_b: str, settings: CompareSettings
) -> Comparison:
    """The comparison of one pair once every piece is pooled: deferred checks (E304, E306, E303/W303), rows."""
    ignore = settings.checks.ignore
    assert state.held is not None
    deferred = state.held.unmatched_issues(ignore) + state.held.mask_issues(ignore)
    assert state.pooled is not None  # E304 raised above when no piece matched
    name = f"{label_a}:{stream_a} vs {label_b}:{stream_b}"
    rows, diagnosis = diagnosed_rows(state.pooled, name, label_a, label_b, stream_a)
    issues = [i for i in (*deferred, *diagnosis.issues) if i.code not in ignore]
    return pair_comparison(
        state.pooled,
        state.held,
        None,
        rows,
        issues,
        [],
        labels=(label_a, label_b),
        streams=(stream_a, stream_b),
        settings=settings,
        diagnosis=diagnosis,
        tau_fit=None,
    )


def _read(source: Any, stream: str, settings: CompareSettings) -> TokenBatch:
    """One run read once whole (the compared stream), or an in-memory batch as given."""
    if isinstance(source, TokenBatch):
        return source
    return _read_loaded(source, stream, settings).batch


def _read_loaded(source: Any, stream: str, settings: CompareSettings, *, piece: bool = False) -> LoadedBatch:
    """One run, or one piece of a run read in several (`piece`: nothing raises, `RunsReader` merges the checks
    and raises), read with the reader's checks (the compared stream)."""
    from pgdiag.data.load import read_token_batch

    return read_token_batch(
        source,
        streams=[stream],
        advantages=False,  # compare reads no advantages (--metrics is refused for N-way)
        reward=True,
        env=True,
        ignore=settings.checks.ignore,
        max_examples=settings.checks.max_examples,
        piece=piece,
        raise_errors=not piece,
    )


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
