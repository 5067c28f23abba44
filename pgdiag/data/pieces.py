"""Which rows a command reads together: pieces of whole steps over 1..N runs (the one piece planner).

What: `plan_step_pieces` cuts the steps of one or more runs into pieces of consecutive whole steps, at most
`chunk_rows` rows of all the runs together, each piece saying which runs have rows in it; `check`, `metrics`,
`compare` (two runs, one run's streams, N-way) read their runs piece by piece in that order. A run that cannot
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl
import pyarrow.parquet as pq

from pgdiag.errors import InvalidInputError

if TYPE_CHECKING:
    from pgdiag.data.runs import Run

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
            "E103", f"{run.display_path(run.paths[0])}, column step: cannot be read as integers ({exc})"
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
