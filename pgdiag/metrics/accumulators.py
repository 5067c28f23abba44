"""Accumulators a caller hands a stage: `RowFold`, fed every piece's `TokenBatch` beside the stage's own fold.

What: an object with the streams it needs, `add(batch)` per piece of whole steps and `finish() -> rows`; the
stage reads those streams too, feeds each piece it reads and adds the rows to its report. `metrics --losses`
and `compare --losses` hand `analysis.loss_fold.LossParityFold` this way.
Why: a computation of a stage above this one (the loss forms of `analysis`) joins the one reading loop of a run
without the stage importing it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pgdiag.data.batch import TokenBatch
from pgdiag.report.report import ReportRow


@runtime_checkable
class RowFold(Protocol):
    """Report rows folded over the pieces of a run (`pgdiag.data.fold.Fold` with `TokenBatch` pieces)."""

    @property
    def streams(self) -> tuple[str, ...]:
        """Streams each piece must hold, besides the stage's own."""
        ...

    def add(self, batch: TokenBatch, /) -> object:
        """Fold one piece of whole steps in."""
        ...

    def finish(self) -> list[ReportRow]:
        """The rows over every piece added."""
        ...
