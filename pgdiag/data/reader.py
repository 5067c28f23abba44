"""The one reading loop: a run read in the pieces of whole steps the planner cuts (`pgdiag.data.pieces`), each with
the reader's checks, their messages merged and the run's first error raised once, after the last piece.

What: `PieceReader.planned(run, chunk_rows, read)` (or `PieceReader(pieces, read)` for pieces planned otherwise,
`metrics --docs-per-step`) is iterated for the pieces a stage folds (`PieceRead`: the piece's run and batch);
`finish()` then merges the pieces' checks (`merge_check_results`: counts added, examples
concatenated, the rules judged over the run judged on the merged counts) and raises the first error, as one read
of the run raises it. After a piece with an error the later pieces are read and validated only (not handed on),
so the message of the error is the run's. A run that fits one piece, or whose step column cannot be filtered,
is one read that raises its own first error. `RunsReader` is the loop itself, over the pieces of 1..N runs read
together (`compare`: two runs, one run's streams, N-way; `check`, which raises nothing), each run's checks merged
and its first error raised, run by run; `PieceReader` is it over one run.
Why: every stage reads the same pieces with the same checks, so a stage is a fold (`pgdiag.data.fold`) and only
adds pieces; merging and raising are written once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pgdiag.data.batch import TokenBatch
from pgdiag.data.issues import CheckResult, Issue, check_result, merge_check_results, raise_first_error
from pgdiag.data.load import LoadedBatch
from pgdiag.data.pieces import plan_step_pieces
from pgdiag.data.runs import Run, restrict_steps

# read(run of the piece, piece): one read with the reader's checks; `piece` True when the run is read in several
# pieces (nothing raises then: `read_token_batch(..., piece=True, raise_errors=False)`)
ReadPiece = Callable[[Run, bool], LoadedBatch]
# rules a stage applies to a read piece after the reader's (metrics' E206 pair rule): their issues
AfterRule = Callable[[LoadedBatch], list[Issue]]


@dataclass(frozen=True)
class PieceRead:
    """One piece as a stage folds it: its place in the plan, the run restricted to the piece's steps (the run
    itself when read whole), and its batch."""

    index: int
    run: Run
    batch: TokenBatch


class PieceReader:
    """The `pieces` of a run (each a `Run` restricted to whole steps, in order), read by `read` and checked by
    `after` (module docstring). Iterate once, then call `finish()`; `planned` plans the pieces first. The loop is
    `RunsReader`'s over one run, the `after` rules' issues kept as a second set of checks raised after the
    reader's."""

    def __init__(self, pieces: Sequence[Run], read: ReadPiece, *, after: AfterRule | None = None) -> None:
        self.pieces, self.read, self.after = list(pieces), read, after
        self.runs = RunsReader(
            self.pieces, self._read_piece, n_runs=2
        )  # the reader's checks, the after rules'

    @classmethod
    def planned(
        cls,
        run: Run,
        chunk_rows: int | Callable[[dict[int, int]], int],
        read: ReadPiece,
        *,
        after: AfterRule | None = None,
    ) -> PieceReader:
        """The reader of `run` in the pieces of whole steps `plan_step_pieces` cuts (at most `chunk_rows` rows
        each, or a function of the rows per step giving it; the run itself when it fits one or cannot be cut)."""
        plan = plan_step_pieces([run], chunk_rows)
        return cls(
            [run if p.steps is None else restrict_steps(run, p.steps) for p in plan.pieces], read, after=after
        )

    @property
    def n_pieces(self) -> int:
        return len(self.pieces)

    @property
    def checks(self) -> list[CheckResult]:
        """The reader's checks of each piece read so far."""
        return self.runs.checks[0]

    def _read_piece(self, run: Run, many: bool) -> tuple[tuple[Run, TokenBatch], list[CheckResult | None]]:
        loaded = self.read(run, many)
        found = self.after(loaded) if self.after is not None else []
        return (run, loaded.batch), [loaded.checks, check_result(found)]

    def __iter__(self) -> Iterator[PieceRead]:
        for piece in self.runs:
            run, batch = piece.read
            yield PieceRead(piece.index, run, batch)
            del piece, run, batch  # the piece's token arrays go before the next piece is read

    def finish(self) -> CheckResult:
        """The run's checks, merged over its pieces; the first error raised (InvalidInputError) as one read raises
        it: the reader's first, then the `after` rules' (whose issues are not in the result: the stage reports
        them its own way)."""
        merged = self.runs.finish()[0]
        return check_result([]) if merged is None else merged


# read(piece, many): what a stage folds for the piece, and the reader's checks of each run read for it (None
# where a run has no rows in the piece, is an in-memory batch, or is read again for rows whose checks were counted)
ReadRuns = Callable[[Any, bool], tuple[Any, Sequence[CheckResult | None]]]


@dataclass(frozen=True)
class RunsPieceRead:
    """One piece of several runs as a stage folds it: its place in the plan, the plan's piece and what was read."""

    index: int
    piece: Any
    read: Any


class RunsReader:
    """The reading loop of 2..N runs read together (`compare`: two runs, one run's streams, N-way), as
    `PieceReader` is that of one: `pieces` (a paired plan's pieces, `pgdiag.data.pieces`) read by `read`, each run's
    checks kept per piece; iterate once, then `finish()`. Pieces after one with an error are read and validated
    only (not handed on); `finish` merges each run's checks over the pieces and raises the first error of the
    first run that has one, as reading the runs whole one after the other raises it. `raises=False` (`check`,
    which reports errors as issues): every piece is handed on and nothing raises."""

    def __init__(self, pieces: Sequence[Any], read: ReadRuns, *, n_runs: int, raises: bool = True) -> None:
        self.pieces, self.read, self.raises = list(pieces), read, raises
        self.checks: list[list[CheckResult]] = [[] for _ in range(n_runs)]
        self.failed = False

    @property
    def n_pieces(self) -> int:
        return len(self.pieces)

    def __iter__(self) -> Iterator[RunsPieceRead]:
        many = len(self.pieces) > 1
        for index, piece in enumerate(self.pieces):
            payload, checks = self.read(piece, many)
            for held, found in zip(self.checks, checks, strict=True):
                if found is not None:
                    held.append(found)
                    self.failed = self.failed or any(
                        i.severity == "error" and i.pooled is None for i in found.found
                    )
            if not (self.failed and self.raises):
                yield RunsPieceRead(index, piece, payload)
            del payload  # the piece's token arrays go before the next piece is read

    def finish(self) -> list[CheckResult | None]:
        """Each run's checks merged over its pieces (None for a run never read from disk); the first error of the
        first run that has one raised (InvalidInputError) unless `raises` is False."""
        merged = [merge_check_results(held) if held else None for held in self.checks]
        for result in merged:
            if result is not None and self.raises:
                raise_first_error(result.found)
        return merged
