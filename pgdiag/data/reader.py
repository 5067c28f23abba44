"""The one reading loop: a run read in the pieces of whole steps the planner cuts (`pgdiag.data.pieces`), each with
the reader's checks, their messages merged and the run's first error raised once, after the last piece.

What: `PieceReader(run, chunk_rows, read)` is iterated for the pieces a stage folds (`PieceRead`: the piece's run
and batch); `finish()` then merges the pieces' checks (`merge_check_results`: counts added, examples
concatenated, the rules judged over the run judged on the merged counts) and raises the first error, as one read
of the run raises it. After a piece with an error the later pieces are read and validated only (not handed on),
so the message of the error is the run's. A run that fits one piece, or whose step column cannot be filtered,
is one read that raises its own first error.
Why: every stage reads the same pieces with the same checks, so a stage is a fold (`pgdiag.data.fold`) and only
adds pieces; merging and raising are written once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pgdiag.data.batch import TokenBatch
from pgdiag.data.issues import CheckResult, merge_check_results, raise_first_error
from pgdiag.data.load import LoadedBatch
from pgdiag.data.pieces import plan_step_pieces
from pgdiag.data.runs import Run, restrict_steps

# read(run of the piece, piece): one read with the reader's checks; `piece` True when the run is read in several
# pieces (nothing raises then: `read_token_batch(..., piece=True, raise_errors=False)`)
ReadPiece = Callable[[Run, bool], LoadedBatch]


@dataclass(frozen=True)
class PieceRead:
    """One piece as a stage folds it: the run restricted to the piece's steps (the run itself when read whole),
    and its batch."""

    run: Run
    batch: TokenBatch


class PieceReader:
    """The pieces of `run` (at most `chunk_rows` rows each, or a function of the rows per step giving it), read
    by `read` (module docstring). Iterate once, then call `finish()`."""

    def __init__(self, run: Run, chunk_rows: int | Callable[[dict[int, int]], int], read: ReadPiece) -> None:
        self.run, self.chunk_rows, self.read = run, chunk_rows, read
        self.checks: list[CheckResult] = []
        self.failed = False
        self.n_pieces = 0

    def __iter__(self) -> Iterator[PieceRead]:
        plan = plan_step_pieces([self.run], self.chunk_rows)
        many = len(plan.pieces) > 1
        self.n_pieces = len(plan.pieces)
        for piece in plan.pieces:
            run = self.run if piece.steps is None else restrict_steps(self.run, piece.steps)
            loaded = self.read(run, many)
            self.checks.append(loaded.checks)
            self.failed = self.failed or any(
                i.severity == "error" and i.pooled is None for i in loaded.checks.found
            )
            if not self.failed:
                yield PieceRead(run, loaded.batch)
            del loaded  # the piece's token arrays go before the next piece is read

    def finish(self) -> CheckResult:
        """The run's checks, merged over its pieces; the first error raised (InvalidInputError), as one read."""
        merged = merge_check_results(self.checks)
        raise_first_error(merged.found)
        return merged
