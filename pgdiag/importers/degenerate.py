"""Degenerate streams (W701/W702): a log-prob column that is exact zeros, or a copy of another, on its loss tokens.

What: `degenerate_holds(table, rule)` tells whether a preset's `DegenerateStream` rule holds on every loss
position of one step; the writer records it per step in a `DegenerateState`. `drop_degenerate(states, files)` then
judges over the whole import: a column that is degenerate on every step is dropped from every part written (with
its warning, and ``streams_dropped`` in each footer); one that is so on some steps only fails E206 (missing values
written as 0?).

Why apart: the judgement needs every step, so it runs after the last part is written and rewrites the parts,
while `pgdiag.importers.writer` handles one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pgdiag.data.flat import RowTable
from pgdiag.data.schema import decode_footer, stream_column
from pgdiag.data.validate import Issue
from pgdiag.data.writing import sequence_row_group_rows, write_parquet
from pgdiag.errors import Code, InvalidInputError
from pgdiag.importers.base import DegenerateStream
from pgdiag.importers.step_rows import stream_of


def _loss_values(table: RowTable, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(M,) values of `column` at the loss positions and (M,) their validity."""
    flat = table.lists[column]
    mask = table.lists["loss_mask"].values
    valid = np.ones(int(mask.sum()), dtype=bool) if flat.valid is None else flat.valid[mask]
    return flat.values[mask], valid


def degenerate_holds(table: RowTable, rule: DegenerateStream) -> bool:
    """Whether `rule` holds on every loss position of `table` (False when a column is absent)."""
    if rule.column not in table.lists:
        return False
    values, valid = _loss_values(table, rule.column)
    if values.size == 0:
        return False
    if rule.same_as is None:
        return bool(valid.all() and (values == 0.0).all())
    if rule.same_as not in table.lists:
        return False
    other, other_valid = _loss_values(table, rule.same_as)
    return bool(
        (valid == other_valid).all()
        and (
            values[valid].astype(np.float32).view(np.uint32)
            == other[valid].astype(np.float32).view(np.uint32)
        ).all()
    )


@dataclass
class DegenerateState:
    """The steps of the import on which one `DegenerateStream` rule held, and those on which it did not."""

    rule: DegenerateStream
    steps_holding: list[int] = field(default_factory=list)
    steps_failing: list[int] = field(default_factory=list)


def drop_degenerate(states: list[DegenerateState], files: list[Path]) -> tuple[list[str], list[Issue]]:
    """Drop from every part in `files` each column whose degenerate rule held on all its steps: returns the
    dropped columns and their warnings. E206 when a rule held on some steps only."""
    dropped: list[str] = []
    said: list[Issue] = []
    for state in states:
        if not state.steps_holding:
            continue
        rule = state.rule
        if state.steps_failing:
            raise InvalidInputError(
                Code.ZERO_FILLED,
                f"{rule.column}: {'exact 0.0' if rule.same_as is None else 'identical to ' + rule.same_as} on every "
                f"loss position of step {state.steps_holding[0]} but not of step {state.steps_failing[0]}; "
                "missing values written as 0?",
            )
        dropped.append(rule.column)
        said.append(Issue(rule.code, "warning", 1, f"{rule.message}; {stream_of(rule.column)} dropped"))
    if not dropped:
        return dropped, said
    for path in files:
        table = pq.read_table(path)
        keep = [c for c in table.column_names if c not in dropped]
        meta = decode_footer(table.schema.metadata)
        meta["streams"] = {k: v for k, v in meta["streams"].items() if stream_column(k) not in dropped}
        meta["streams_dropped"] = {
            stream_of(c): state.rule.message for c in dropped for state in states if state.rule.column == c
        }
        table = table.select(keep).replace_schema_metadata({})
        write_parquet(
            table,
            path,
            metadata=meta,
            row_group_rows=sequence_row_group_rows(table.num_rows, int(table.nbytes)),
        )
    return dropped, said
