"""Which chunks `compute_metrics` reads: pieces of whole steps, or read-order chunks under `--docs-per-step`.

What: `plan_chunks` gives the chunks of a run (each a `Run` restricted to its steps), how many steps the report
has and, under `--docs-per-step`, the feeder that cuts steps of N documents across them. Pieces of whole steps
come from the one piece planner (`pgdiag.data.pieces.plan_step_pieces`); under `--docs-per-step` the same
planner reads the key columns first and cuts pieces of real steps in read order (`plan_read_order_pieces`), and
`metrics.docsteps` cuts the steps of N documents across them. None: read the run whole (a step
column that is null or not an integer; the whole read reports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pgdiag.data.pieces import plan_read_order_pieces, plan_step_pieces
from pgdiag.data.runs import Run, restrict_steps
from pgdiag.metrics.settings import MetricSettings

if TYPE_CHECKING:
    from pgdiag.metrics.docsteps import DocStepFeeder
    from pgdiag.metrics.engine import NativeStream
    from pgdiag.metrics.styles.steps import StyleStream


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks `compute_metrics` reads (each with its row count under `--docs-per-step`, else None), the
    steps it reports and the feeder that cuts steps of N documents."""

    chunks: list[tuple[Run, int | None]]
    n_steps: int
    feeder: DocStepFeeder | None = None


def plan_chunks(
    run: Run,
    settings: MetricSettings,
    budget: Callable[[dict[int, int]], int],
    engine: NativeStream | StyleStream,
) -> ChunkPlan | None:
    """The chunks of `run`: pieces of whole steps (`pgdiag.data.pieces`), or under `--docs-per-step` chunks of
    real steps in read order; None when the run must be read whole (null or non-integer steps)."""
    from pgdiag.metrics.docsteps import DocStepFeeder, plan_doc_steps

    if settings.docs_per_step is None:  # chunks of consecutive steps, in step order
        pieces = plan_step_pieces([run], budget)
        if not pieces.by_step:
            return None
        chunks: list[tuple[Run, int | None]] = [  # none for a run without rows
            (run if p.steps is None else restrict_steps(run, p.steps), None)
            for p in (pieces.pieces if pieces.rows_per_step else [])
        ]
        return ChunkPlan(chunks, len(pieces.rows_per_step))
    planned = plan_read_order_pieces(run, budget)
    if planned is None:  # the whole read says what is wrong (E213, E102, ...)
        return None
    keys, pieces = planned  # keys: (R,) rows: step, sample_id, group_id
    cut = plan_doc_steps(keys, settings.docs_per_step)
    chunks = [(restrict_steps(run, c), hi - lo) for c, lo, hi in pieces]
    return ChunkPlan(chunks, cut.n_steps, DocStepFeeder(cut, engine))
