"""Which rows a command reads together: pieces of whole steps over 1..N runs (the one piece planner), and the
pieces of two runs paired across steps (`any_step_pieces`, `compare --join hash-any-step`).

What: `plan_step_pieces` cuts the steps of one or more runs into pieces of consecutive whole steps, at most
`chunk_rows` rows of all the runs together, each piece saying which runs have rows in it; `check`, `metrics`,
`compare` (two runs, one run's streams, N-way) read their runs piece by piece in that order; `metrics
--docs-per-step` reads pieces of whole steps in the run's read order (`plan_read_order_pieces`). A run that cannot
be filtered by step (`reads_whole`) or that fits one piece is read whole (one `StepPiece(None, ...)`).
Why: memory then follows a piece, not the run, and every command cuts a run the same way.
How: the step column alone is read (`step_rows`: rows per step; `reads_whole`: null steps). Parquet decodes whole
row groups, so a piece that holds part of a row group decodes all of it: the steps one row group holds are kept
in one piece (`row_group_spans`, from the footers' `step` statistics) unless that piece would then exceed
`TIE_FACTOR` x `chunk_rows` rows. A run written as one row group of a few hundred thousand rows is then decoded
once, not once per piece (that cost `compare` 1.8x at 10M tokens); a larger one is still cut at step boundaries,
so memory stays bounded.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from pgdiag.data.runs import Run, row_keys, sample_keys
from pgdiag.errors import Code, InvalidInputError

# a piece may grow to TIE_FACTOR x chunk_rows rows to keep the steps of one Parquet row group together
TIE_FACTOR = 4


@dataclass(frozen=True)
class StepPlan:
    """The pieces of 1..N runs in read order and the rows per step of all of them (empty when read whole
    because a step column cannot be filtered)."""

    pieces: list[StepPiece]
    rows_per_step: dict[int, int]
    by_step: bool = True  # False: a run's step column cannot be filtered, so every run is read whole


@dataclass(frozen=True)
class StepPiece:
    """The steps of one piece (None: every run whole) and whether each run has rows in it."""

    steps: tuple[int, ...] | None
    present: tuple[bool, ...]


def step_rows(run: Run) -> dict[int, int]:
    """Rows per step of `run` (its filters applied), in step order; reads the `step` column alone (E103 when the
    column cannot be read as integers)."""
    try:
        frame = (
            run.lazy.select(pl.col("step").cast(pl.Int64, strict=True))
            .group_by("step")
            .len()
            .sort("step")
            .collect()
        )
    except pl.exceptions.PolarsError as exc:
        raise InvalidInputError(
            Code.LOSSY_CAST,
            f"{run.display_path(run.paths[0])}, column step: cannot be read as integers ({exc})",
        ) from exc
    return {
        int(s): int(n)
        for s, n in zip(frame["step"].to_list(), frame["len"].to_list(), strict=True)
        if s is not None
    }


def run_steps(run: Run) -> list[int]:
    """The distinct steps of `run` (its filters applied), ascending; reads the `step` column alone."""
    return [int(step) for step in step_rows(run)]


def reads_whole(run: Run) -> bool:
    """Whether `run` cannot be read step by step, so a command reads it whole, where the reader says why: a `step`
    column that is missing or not an integer (E102/E103: no piece can filter it) or rows whose `step` is null
    (E213: no piece holds them)."""
    step_type = run.lazy.collect_schema().get("step")
    if step_type is None or not step_type.is_integer():
        return True
    return bool(run.lazy.select(pl.col("step").null_count()).collect().item())


def row_group_spans(paths: Sequence[Path]) -> list[tuple[int, int]]:
    """(lowest, highest) `step` of every Parquet row group of `paths` that holds more than one step, from the
    footers' statistics (no data read); row groups without step statistics (hive ``step=`` directories, a
    writer that kept none) are left out."""
    spans: list[tuple[int, int]] = []
    for path in paths:
        try:
            metadata = pq.ParquetFile(path).metadata
        except (OSError, ValueError):
            continue  # the reader reports an unreadable file
        names = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
        if "step" not in names:
            continue
        column = names.index("step")
        for group in range(metadata.num_row_groups):
            stats = metadata.row_group(group).column(column).statistics
            if stats is None or not stats.has_min_max or not isinstance(stats.min, int):
                continue
            if stats.max > stats.min:
                spans.append((int(stats.min), int(stats.max)))
    return spans


def tied_steps(steps: Sequence[int], spans: Sequence[tuple[int, int]]) -> set[int]:
    """The steps (of ascending `steps`) that one row group of `spans` holds together with the next step."""
    tied: set[int] = set()
    for lo, hi in spans:
        first, last = bisect.bisect_left(steps, lo), bisect.bisect_right(steps, hi)
        tied.update(steps[first : last - 1])
    return tied


def step_chunks(
    rows_per_step: Mapping[int, int], max_rows: int, tied: set[int] | None = None
) -> list[tuple[int, ...]]:
    """Consecutive steps grouped so that each group holds at most `max_rows` rows; a step larger than that is a
    group of its own (memory is then bounded by the largest step). A step in `tied` stays with the next one
    unless the group would then exceed `TIE_FACTOR` x `max_rows` rows."""
    chunks: list[tuple[int, ...]] = []
    current: list[int] = []
    held = 0
    for step, n in rows_per_step.items():
        limit = TIE_FACTOR * max_rows if current and current[-1] in (tied or ()) else max_rows
        if current and held + n > limit:
            chunks.append(tuple(current))
            current, held = [], 0
        current.append(step)
        held += n
    if current:
        chunks.append(tuple(current))
    return chunks


def plan_step_pieces(runs: Sequence[Run], chunk_rows: int | Callable[[dict[int, int]], int]) -> StepPlan:
    """The pieces of consecutive whole steps in which `runs` are read together (module docstring).

    `chunk_rows`: the rows of all runs one piece holds, or a function of the rows per step that gives it. One
    piece, `StepPiece(None, (True, ...))`, when the runs fit in one or when a run cannot be read by step (a step
    column that is missing, not an integer or null: the whole read reports it)."""
    whole = [StepPiece(None, tuple(True for _ in runs))]
    if any(reads_whole(run) for run in runs):
        return StepPlan(whole, {}, by_step=False)
    try:
        per_run = [step_rows(run) for run in runs]
    except InvalidInputError:
        return StepPlan(whole, {}, by_step=False)  # the reader reports the unreadable step column
    total: dict[int, int] = {}
    for rows in per_run:
        for step, n in rows.items():
            total[step] = total.get(step, 0) + n
    total = dict(sorted(total.items()))
    budget = chunk_rows(total) if callable(chunk_rows) else chunk_rows
    if sum(total.values()) <= budget:
        return StepPlan(whole, total)
    steps = list(total)
    tied = set().union(*(tied_steps(steps, row_group_spans(run.paths)) for run in runs))
    chunks = step_chunks(total, budget, tied)
    if len(chunks) <= 1:
        return StepPlan(whole, total)
    return StepPlan(
        [StepPiece(c, tuple(any(s in rows for s in c) for rows in per_run)) for c in chunks], total
    )


# ---- pieces in the run's read order (`metrics --docs-per-step`) -------------------------------------------


def read_order_chunks(step: np.ndarray, max_rows: int) -> list[tuple[tuple[int, ...], int, int]]:
    """Chunks of real steps as (steps, first row, end row) of the read order, given the `step` (R,) of every row in
    read order: reading the chunks' steps one chunk after the other gives every row once, in read order.

    A step is in one chunk; steps whose rows interleave in the read order share a chunk (a file that mixes
    steps), and consecutive such spans are grouped up to `max_rows` rows (a larger span is a chunk of its own).
    """
    n_rows = int(step.shape[0])
    if n_rows == 0:
        return []
    values, first = np.unique(step, return_index=True)
    _, from_end = np.unique(step[::-1], return_index=True)
    last = n_rows - 1 - from_end  # (V,) last row of each step, same order as `values`
    order = np.argsort(first, kind="stable")
    values, first, last = values[order], first[order], last[order]
    reach = np.maximum.accumulate(last)  # (V,) last row of any step seen so far
    opens = np.concatenate([[True], first[1:] > reach[:-1]])  # a span starts where no earlier step reaches
    span_lo = first[opens]
    span_hi = np.append(span_lo[1:], n_rows)
    span_steps = np.split(values, np.flatnonzero(opens)[1:])
    chunks: list[tuple[tuple[int, ...], int, int]] = []
    steps: list[int] = []
    lo = 0
    for s_lo, s_hi, s_steps in zip(span_lo.tolist(), span_hi.tolist(), span_steps, strict=True):
        if steps and s_hi - lo > max_rows:
            chunks.append((tuple(steps), lo, s_lo))
            steps, lo = [], s_lo
        steps.extend(int(v) for v in s_steps)
    chunks.append((tuple(steps), lo, n_rows))
    return chunks


def plan_read_order_pieces(
    run: Run, chunk_rows: int | Callable[[dict[int, int]], int]
) -> tuple[pl.DataFrame, list[tuple[tuple[int, ...], int, int]]] | None:
    """The row keys of `run` (`data.runs.row_keys`: step, sample_id, group_id in read order) and its pieces in
    read order (`read_order_chunks`: steps, first row, end row), for `metrics --docs-per-step`, which cuts steps
    of N documents across the run's steps; `chunk_rows` as in `plan_step_pieces` (a function gets the rows of
    each step). None when the run is read whole (a step column that cannot be filtered, null steps, or key
    columns the reader refuses: the whole read says what is wrong)."""
    if reads_whole(run):
        return None
    keys = row_keys(run)  # (R,) rows
    if keys is None or keys["step"].null_count():
        return None
    steps = keys["step"].to_numpy()  # (R,)
    counts = np.unique(steps, return_counts=True)[1].tolist()
    budget = chunk_rows(dict(enumerate(counts))) if callable(chunk_rows) else chunk_rows
    return keys, read_order_chunks(steps, budget)


# ---- two runs paired across steps (`compare --join hash-any-step`) ----------------------------------------

ROW_DROPPING_CODES = (Code.LENGTH_MISMATCH, Code.BAD_PROMPT_LEN, Code.NULL_REQUIRED)


@dataclass(frozen=True)
class PairPiece:
    """One piece of a two-run comparison: its steps, whether each run has rows in it and, under hash-any-step,
    the steps of b it reads and its pairs."""

    steps: tuple[int, ...] | None  # steps of a (and of b unless `steps_b` is set); None: the whole run
    in_a: bool = True
    in_b: bool = True
    steps_b: tuple[int, ...] | None = None  # hash-any-step: the steps of b first read with this piece
    steps_b_again: tuple[int, ...] = ()  # hash-any-step: steps of b an earlier piece read (read again)
    matches: tuple[np.ndarray, np.ndarray] | None = (
        None  # (rows of a, rows of b) paired on the whole runs' keys
    )
    n_a: int = 0  # rows of a and of b (first read, then again) this piece reads: checked against the batches
    n_b: int = 0

    @property
    def b_steps(self) -> tuple[int, ...] | None:
        """The steps of b read first with this piece."""
        return self.steps if self.steps_b is None else self.steps_b


@dataclass(frozen=True)
class AnyStepKeys:
    """The sample counts of a hash-any-step plan, from the whole runs' keys (E304, E306 of compare)."""

    n_a: int
    n_b: int
    n_matched: int
    first_only_a: tuple[int, str] | None  # (step, sample_id) of the first sample of a without a match
    first_only_b: tuple[int, str] | None
    steps_a: tuple[int, int] | None  # (min, max) step
    steps_b: tuple[int, int] | None


@dataclass(frozen=True)
class PairPlan:
    """The pieces of one two-run comparison; `keys` holds the sample counts when they come from the keys."""

    pieces: list[PairPiece]
    keys: AnyStepKeys | None = None


def _ranked(frame: pl.DataFrame, group: list[str]) -> pl.DataFrame:
    """Rank identical sequences within `group` by (step, sample_id, segment_idx) so duplicates pair in order
    (ties, samples whose keys repeat under an ignored E210, keep their row order)."""
    return frame.sort(["step", "sample_id", "segment_idx"], maintain_order=True).with_columns(
        pl.int_range(pl.len()).over(group).alias("rank")
    )


def rank_join(fa: pl.DataFrame, fb: pl.DataFrame, group: list[str]) -> pl.DataFrame:
    """(ia, ib, *group, rank) of the samples paired by a hash join: the n-th sample of `fa` with a given `group`
    value pairs with the n-th of `fb` (n in (step, sample_id, segment_idx) order). Frames: `_key_frame`'s
    columns, index columns ``ia`` and ``ib``."""
    on = [*group, "rank"]
    return _ranked(fa, group).select("ia", *on).join(_ranked(fb, group).select("ib", *on), on=on)


def _first(step: np.ndarray, sample_id: pl.Series, rows: np.ndarray) -> tuple[int, str] | None:
    if rows.size == 0:
        return None
    r = int(rows[0])
    return int(step[r]), str(sample_id[r])


def _span(step: np.ndarray) -> tuple[int, int] | None:
    return None if step.size == 0 else (int(step.min()), int(step.max()))


def _key_frame(keys: pl.DataFrame, index: str) -> pl.DataFrame:
    return keys.select(
        pl.int_range(pl.len(), dtype=pl.Int64).alias(index),
        "step",
        "sample_id",
        "segment_idx",
        pl.col("seq_hash").alias("hash"),
    )


def _rows_by_step(step: np.ndarray) -> dict[int, np.ndarray]:
    """step -> (k,) its rows, in read order."""
    order = np.argsort(step, kind="stable")
    values, starts = np.unique(step[order], return_index=True)
    return {int(v): rows for v, rows in zip(values, np.split(order, starts[1:]), strict=True)}


def _rows_of(by_step: dict[int, np.ndarray], steps: Sequence[int]) -> np.ndarray:
    """The rows of `steps` in read order: the order a read restricted to those steps returns them in."""
    parts = [by_step[s] for s in steps if s in by_step]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def any_step_pieces(a: Any, b: Any, chunk_rows: int, ignore: Collection[str]) -> PairPlan:
    """Pieces of consecutive steps of `a`, each with the steps of `b` that hold its matches (module docstring).

    A piece holds at most `chunk_rows` rows of a plus the b steps it reads, unless one step of a with its b
    steps is larger (then it is a piece of its own: the worst case, an a step matched into every b step, reads
    all of b with it). Read whole (one piece): runs that fit in one piece, a step column that is not an integer
    or is null (`reads_whole`), and an ignored code whose rows the reader leaves out (`ROW_DROPPING_CODES`: the keys would pair rows the batch lacks).
    """

    whole = PairPlan([PairPiece(None)])
    if reads_whole(a) or reads_whole(b):
        return whole
    rows_a, rows_b = step_rows(a), step_rows(b)
    if sum(rows_a.values()) + sum(rows_b.values()) <= chunk_rows or set(ignore) & set(ROW_DROPPING_CODES):
        return whole
    try:
        keys_a, keys_b = sample_keys(a), sample_keys(b)
    except InvalidInputError:
        return whole  # a key column the reader refuses: one read reports it as before
    step_a, step_b = keys_a["step"].to_numpy(), keys_b["step"].to_numpy()
    matched = rank_join(_key_frame(keys_a, "ia"), _key_frame(keys_b, "ib"), ["hash"])
    ia, ib = matched["ia"].to_numpy(), matched["ib"].to_numpy()
    match_b = np.full(keys_a.height, -1, dtype=np.int64)  # (S_a,) row of b matched to each row of a
    match_b[ia] = ib
    counts = AnyStepKeys(
        keys_a.height,
        keys_b.height,
        int(ia.shape[0]),
        _first(step_a, keys_a["sample_id"], np.flatnonzero(match_b < 0)),
        _first(step_b, keys_b["sample_id"], np.setdiff1d(np.arange(keys_b.height), ib)),
        _span(step_a),
        _span(step_b),
    )
    needs: dict[int, set[int]] = {s: set() for s in rows_a}
    for s_a, s_b in pl.DataFrame({"a": step_a[ia], "b": step_b[ib]}).unique().iter_rows():
        needs[int(s_a)].add(int(s_b))
    groups: list[tuple[list[int], set[int]]] = []
    held = 0  # rows of a and b the last group reads
    for step in rows_a:  # ascending
        added = sum(rows_b[t] for t in needs[step] - groups[-1][1]) if groups else 0
        if groups and held + rows_a[step] + added <= chunk_rows:
            groups[-1][0].append(step)
            groups[-1][1].update(needs[step])
            held += rows_a[step] + added
            continue
        groups.append(([step], set(needs[step])))
        held = rows_a[step] + sum(rows_b[t] for t in needs[step])
    pieces: list[PairPiece] = []
    seen: set[int] = set()
    position_b = np.full(keys_b.height, -1, dtype=np.int64)  # row of b -> its row in the piece's b batch
    by_step_a, by_step_b = _rows_by_step(step_a), _rows_by_step(step_b)
    for steps, wanted in groups:
        fresh, again = tuple(sorted(wanted - seen)), tuple(sorted(wanted & seen))
        seen |= wanted
        rows_of_a = _rows_of(by_step_a, steps)
        rows_of_b = np.concatenate([_rows_of(by_step_b, fresh), _rows_of(by_step_b, again)])
        position_b[rows_of_b] = np.arange(rows_of_b.shape[0])
        partner = match_b[rows_of_a]
        local_a = np.flatnonzero(partner >= 0)
        local_b = position_b[partner[local_a]]
        position_b[rows_of_b] = -1
        pieces.append(
            PairPiece(
                tuple(steps),
                True,
                bool(wanted),
                fresh,
                again,
                (local_a, local_b),
                int(rows_of_a.shape[0]),
                int(rows_of_b.shape[0]),
            )
        )
    lone = {s: n for s, n in rows_b.items() if s not in seen}  # steps of b no sample of a matches
    for chunk in step_chunks(lone, chunk_rows) if lone else []:
        pieces.append(PairPiece(chunk, False, True, chunk, (), None, 0, sum(lone[s] for s in chunk)))
    if len(pieces) <= 1:
        return whole
    return PairPlan(pieces, counts)
