"""The shape every stage reduces a run with: a fold over the pieces of `pgdiag.data.pieces`.

What: a `Fold` takes the pieces of a run one at a time (`add(piece)`: a piece is what the reader gives for one
planned `StepPiece`: a `TokenBatch`, an aligned pair, ...) and returns the stage's result once (`finish()`).
Why: a run is read once, in pieces of whole steps, and every stage (check, metrics, compare, drift, whatif) reduces the
same pieces, so a new metric, breakdown or cause is a new accumulator added to a fold, never a new loop over
the run.
How (the contract; docs/reliability.md, "Folds"):

* `add` is called once per piece, in step order; a piece holds whole steps, so a per-step result is final when
  its piece is added.
* A fold keeps state of the order of the number of steps (per-step rows, per-sample tables, fixed-size
  sketches or strided samples), never the pieces' token arrays.
* `finish` is called once, after the last piece, and gives what the same fold gives on the run read whole: exact
  for counts, maxima, per-step rows and worst-K; sums pooled in another order agree to rounding (relative
  1e-12); a pooled quantile is exact from per-step buffers up to its documented limit, then carries its sketch's
  documented relative error.
* Errors: a fold never raises on bad data in `add`; the reader's checks of each piece are merged
  (`pgdiag.data.validate.merge_check_results`) and the run's first error is raised once, after the last piece:
  `pgdiag.data.reader.PieceReader` does both for the stages that read one run (metrics, drift, whatif),
  `pgdiag.data.reader.RunsReader` for those that read 2..N runs together (compare: two runs, one run's streams,
  N-way; check, which reports the errors as issues and raises none). A fold whose result includes the reader's
  checks takes them merged: `finish(reader checks)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar, runtime_checkable

PieceT = TypeVar("PieceT", contravariant=True)
ResultT = TypeVar("ResultT", covariant=True)


@runtime_checkable
class Fold(Protocol[PieceT, ResultT]):
    """A reduction of a run's pieces: `add` each piece in step order, then `finish` once (module docstring)."""

    def add(self, piece: PieceT, /) -> object:
        """Fold one piece in (what it returns, if anything, is the fold's own business, e.g. finished steps)."""
        ...

    def finish(self) -> ResultT:
        """The result over every piece added."""
        ...


def fold(accumulator: Fold[PieceT, ResultT], pieces: Iterable[PieceT]) -> ResultT:
    """`accumulator` fed every piece of `pieces` in order, then finished: the loop every stage runs."""
    for piece in pieces:
        accumulator.add(piece)
    return accumulator.finish()
