"""`--docs-per-step` over a run read in chunks: steps of N documents cut over the whole run, fed whole.

What: `--docs-per-step N` ignores the `step` column and cuts the rows, in their read order, into consecutive
steps of N documents (consecutive rows sharing a `sample_id` are one document; docs/metrics.md). This module
lets `compute_metrics` read such a run in chunks of whole real steps instead of at once.

Why this way: the cut needs the whole run (document k of the run is counted from its first row, and a prompt
group straddles a cut only as seen over all steps), but only per row, not per token. So the key columns
(step, sample_id, group_id) are read first (`data.runs.row_keys`, a few bytes a sample) and give every row's
cut step, the run-wide group codes and the straddling groups (`DocStepPlan`) before any token is read. The
chunks are sets of real steps whose reads, one after the other, give the rows in the read order of a whole
read (`read_order_chunks`); a document may run on across a real step (two consecutive rows of different steps
sharing a sample_id), so a cut step is whole only once its last row is read: `DocStepFeeder` holds the rows of
the cut step a chunk ends in until the next chunk completes it. Memory is one chunk plus one cut step.

How: ``plan = plan_doc_steps(keys, N)``; for ``steps, lo, hi`` of the planner's read-order pieces
(`pgdiag.data.pieces.plan_read_order_pieces`, the one piece planner) read
the rows of ``steps`` (rows lo..hi of the read order) and ``feeder.add(batch)``; then ``feeder.finish()``. The
engine (`NativeStream` or `StyleStream`) sees batches of whole cut steps with a `StepCut`, so every step row
is the one a whole read gives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch, concat_batches
from pgdiag.metrics.engine import NativeStream, StepCut, documents_by_sample_id, straddling_groups
from pgdiag.metrics.styles.steps import StyleStream


@dataclass(frozen=True)
class DocStepPlan:
    """The cut of a whole run into steps of N documents, from its key columns (R rows in read order)."""

    step: np.ndarray  # (R,) int64 cut step of every row, ascending
    group: np.ndarray  # (R,) int64 run-wide group codes into `group_names`
    group_names: np.ndarray  # (G,) object, sorted: the codes a whole read gives
    split_groups: np.ndarray  # (P_split,) codes of the groups in more than one cut step
    partial: bool  # the last cut step holds fewer than N documents

    @property
    def n_rows(self) -> int:
        return int(self.step.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.step[-1]) + 1 if self.n_rows else 0


def plan_doc_steps(keys: pl.DataFrame, docs_per_step: int) -> DocStepPlan:
    """The cut of the run whose `keys` (`data.runs.row_keys`: step, sample_id, group_id in read order) are given,
    exactly as the engine cuts a whole read (`engine.split_steps`)."""
    sample_id = keys["sample_id"].to_numpy().astype(object)  # (R,)
    group_names, group = np.unique(keys["group_id"].to_numpy().astype(object), return_inverse=True)
    group = group.astype(np.int64).reshape(-1)  # (R,)
    documents = documents_by_sample_id(sample_id)  # (R,)
    step = documents // docs_per_step
    partial = bool(documents.shape[0]) and (int(documents[-1]) + 1) % docs_per_step != 0
    return DocStepPlan(step, group, group_names, straddling_groups(group, step), partial)


class DocStepFeeder:
    """Feeds the chunks of a run, in read order, to an engine as batches of whole cut steps (`DocStepPlan`).

    `add(batch)` takes the next rows of the read order: it relabels them (cut step, run-wide group codes),
    hands on every cut step whose rows are all read and holds the rows of the one the chunk ends in; `finish()`
    checks that every row came.
    """

    def __init__(self, plan: DocStepPlan, engine: NativeStream | StyleStream) -> None:
        self.plan = plan
        self.engine = engine
        self._held: list[TokenBatch] = []  # rows of the cut step the next chunk continues
        self._next_row = 0  # first row of the read order not read yet

    def add(self, batch: TokenBatch) -> None:
        """The next `batch.n_samples` rows of the read order (a chunk of `read_order_chunks`)."""
        plan = self.plan
        start, end = self._next_row, self._next_row + batch.n_samples
        if end > plan.n_rows:
            raise ValueError(f"DocStepFeeder: rows {start}..{end} past the run's {plan.n_rows} rows")
        batch = self._relabel(batch, start)
        self._next_row = end
        if plan.n_rows == 0:  # an empty run: its one empty batch, as a whole read gives
            self._feed(batch, end)
            return
        # rows before `complete` are in cut steps whose every row is read; the rest wait for the next chunk
        complete = end if end == plan.n_rows else int(np.searchsorted(plan.step, plan.step[end], side="left"))
        if complete <= start:  # the chunk lies inside the held cut step
            self._held.append(batch)
            return
        head = start
        if self._held:  # the held cut step ends in this chunk: its rows in one batch
            head = int(np.searchsorted(plan.step, plan.step[start], side="right"))
            self._feed(concat_batches([*self._held, batch.slice(0, head - start)]), head)
        # a copy, not a view: a view would keep the whole chunk's arrays alive until the next chunk is read
        held = np.arange(complete - start, end - start, dtype=np.int64)
        self._held = [batch.select(held)] if held.shape[0] else []
        if complete > head:  # the cut steps that begin and end within the chunk
            self._feed(batch.slice(head - start, complete - start), complete)

    def finish(self) -> None:
        """Check that the chunks held every row of the plan (the last one completes every held step)."""
        if self._next_row != self.plan.n_rows or self._held:
            raise ValueError(f"DocStepFeeder: {self._next_row} of {self.plan.n_rows} rows read")

    def _relabel(self, batch: TokenBatch, start: int) -> TokenBatch:
        """`batch`, rows start.. of the read order, with its cut steps and the run-wide group codes."""
        rows = slice(start, start + batch.n_samples)
        return replace(
            batch,
            step=self.plan.step[rows],
            group=self.plan.group[rows],
            group_names=self.plan.group_names,
            sample_row=None if batch.sample_row is None else batch.sample_row + start,
        )

    def _feed(self, batch: TokenBatch, end: int) -> None:
        """Hand whole cut steps, ending at row `end` of the read order, to the engine."""
        last = end == self.plan.n_rows
        self.engine.add(batch, StepCut(self.plan.split_groups, partial_last=last and self.plan.partial))
