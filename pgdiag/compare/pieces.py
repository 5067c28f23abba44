"""Which rows a comparison reads together: pieces of whole steps (docs/compare.md, "Reading step by step").

What: `plan_pieces` lists the pieces `compare_runs` reads one at a time. By default a piece is a group of
consecutive steps of both runs under `CompareSettings.chunk_rows` rows (`step_pieces`). Under
``--join hash-any-step`` a sample of run a may match a sample of run b in any step, so a piece is a group of
consecutive steps of run a together with the steps of run b that hold their matches (`any_step_pieces`): the
samples are paired once, on the whole runs' key columns (step, sample_id, segment_idx, seq_hash: a few bytes
per sample, `pgdiag.data.runs.sample_keys`), exactly as one read pairs them (`align.rank_join`), and each piece
carries its own pairs as row indices into the batches it reads.
Why: memory then follows a piece (and, for hash-any-step, the steps of b its samples match), not the run, and
every number is the one-read number.
How: a run that fits one piece is read whole (bit-identical to a one-piece read). Under hash-any-step a step of
b matched from several pieces is read again with each (its reader checks are counted with its first read only:
`Piece.steps_b_again`), the steps of b no sample of a matches are read last, on their own, for their reader
checks, and the unmatched counts (E304, E306) come from the keys (`AnyStepKeys.deferred`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl

from pgdiag.compare.align import Deferred, rank_join
from pgdiag.data.batch import TokenBatch
from pgdiag.data.pieces import plan_step_pieces, reads_whole, step_chunks, step_rows
from pgdiag.data.runs import sample_keys
from pgdiag.errors import InvalidInputError

# Codes whose rows the reader leaves out when they are ignored: the batch then lacks rows the keys hold
ROW_DROPPING_CODES = ("E201", "E202", "E213")


@dataclass(frozen=True)
class Piece:
    """The steps of one piece, and whether each run has rows in it."""

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
    """The sample counts of a hash-any-step comparison, from the whole runs' keys (E304, E306)."""

    n_a: int
    n_b: int
    n_matched: int
    first_only_a: tuple[int, str] | None  # (step, sample_id) of the first sample of a without a match
    first_only_b: tuple[int, str] | None
    steps_a: tuple[int, int] | None  # (min, max) step
    steps_b: tuple[int, int] | None

    def deferred(self, pair_name: str, label_a: str, label_b: str) -> Deferred:
        """The `Deferred` counts a one-piece read would give (the mask counts come from the pieces)."""

        def first(where: tuple[int, str] | None, label: str) -> tuple[str, int, str] | None:
            return None if where is None else (f"step {where[0]}, sample {where[1]} of {label}", *where)

        n_only_a = self.n_a - self.n_matched
        n_only_b = self.n_b - self.n_matched
        return Deferred(
            pair_name,
            label_a,
            label_b,
            "hash-any-step",
            self.n_a,
            self.n_b,
            self.n_matched,
            n_only_a,
            n_only_b,
            first(self.first_only_a, label_a),
            first(self.first_only_b, label_b),
            self.steps_a,
            self.steps_b,
        )


@dataclass(frozen=True)
class Plan:
    """The pieces of one comparison; `keys` holds the sample counts when they come from the keys."""

    pieces: list[Piece]
    keys: AnyStepKeys | None = None


def plan_pieces(
    a: Any, b: Any, *, one_run: bool, whole: bool, join: str, chunk_rows: int, ignore: Collection[str]
) -> Plan:
    """The pieces of `compare_runs`: hash-any-step pieces for two runs joined across steps, else step pieces."""
    if whole:
        return Plan([Piece(None)])
    if join == "hash-any-step" and not one_run:  # one run: each sample matches itself, in its own step
        return any_step_pieces(a, b, chunk_rows, ignore)
    return Plan(step_pieces(a, b, one_run, chunk_rows))


def step_pieces(a: Any, b: Any, one_run: bool, chunk_rows: int) -> list[Piece]:
    """Consecutive steps of both runs under `chunk_rows` rows (a + b; `pgdiag.data.pieces.plan_step_pieces`);
    one whole piece when they fit in one."""
    planned = plan_step_pieces([a] if one_run else [a, b], chunk_rows).pieces
    return [Piece(p.steps, p.present[0], p.present[-1]) for p in planned]


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


def any_step_pieces(a: Any, b: Any, chunk_rows: int, ignore: Collection[str]) -> Plan:
    """Pieces of consecutive steps of `a`, each with the steps of `b` that hold its matches (module docstring).

    A piece holds at most `chunk_rows` rows of a plus the b steps it reads, unless one step of a with its b
    steps is larger (then it is a piece of its own: the worst case, an a step matched into every b step, reads
    all of b with it). Read whole (one piece): runs that fit in one piece, a step column that is not an integer
    or is null (`reads_whole`), and an ignored code whose rows the reader leaves out (`ROW_DROPPING_CODES`: the keys would pair rows the batch lacks).
    """

    whole = Plan([Piece(None)])
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
    pieces: list[Piece] = []
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
            Piece(
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
        pieces.append(Piece(chunk, False, True, chunk, (), None, 0, sum(lone[s] for s in chunk)))
    if len(pieces) <= 1:
        return whole
    return Plan(pieces, counts)


def checked_matches(piece: Piece, a: TokenBatch, b: TokenBatch) -> tuple[np.ndarray, np.ndarray] | None:
    """The piece's pairs (rows of `a`, rows of `b`), once its batches hold the rows its keys listed (a run
    rewritten between the key read and the piece read is E103, never a wrong pairing); None for step pieces."""
    if piece.matches is None:
        return None
    same = a.n_samples == piece.n_a and b.n_samples == piece.n_b
    rows_a, rows_b = piece.matches
    if same and rows_a.size:
        same = bool(np.array_equal(a.seq_hash[rows_a], b.seq_hash[rows_b]))
    if not same:
        raise InvalidInputError(
            "E103",
            f"{a.label}, {b.label}: the rows of steps {_steps_text(piece.steps)} differ from the keys read before "
            "them (a run changed while it was read?)",
            "run the comparison again on runs nobody writes to",
        )
    return piece.matches


def _steps_text(steps: tuple[int, ...] | None) -> str:
    return "all" if not steps else (f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}")


def concat_batches(first: TokenBatch, second: TokenBatch) -> TokenBatch:
    """The samples of `first` then those of `second` as one batch (two reads of the same run's columns)."""

    def cat(x: np.ndarray | None, y: np.ndarray | None) -> np.ndarray | None:
        return None if x is None or y is None else np.concatenate([x, y])

    names, codes = np.unique(
        np.concatenate([first.group_names[first.group], second.group_names[second.group]]),
        return_inverse=True,
    )
    offsets = np.concatenate([first.offsets, second.offsets[1:] + first.offsets[-1]])
    return replace(
        first,
        step=np.concatenate([first.step, second.step]),
        sample_id=np.concatenate([first.sample_id, second.sample_id]),
        segment_idx=np.concatenate([first.segment_idx, second.segment_idx]),
        group=codes.astype(np.int64),
        group_names=names.astype(object),
        prompt_len=np.concatenate([first.prompt_len, second.prompt_len]),
        seq_len=np.concatenate([first.seq_len, second.seq_len]),
        offsets=offsets,
        pos=np.concatenate([first.pos, second.pos]),
        token_id=np.concatenate([first.token_id, second.token_id]),
        streams={k: np.concatenate([v, second.streams[k]]) for k, v in first.streams.items()},
        entropy={k: np.concatenate([v, second.entropy[k]]) for k, v in first.entropy.items()},
        advantages=cat(first.advantages, second.advantages),
        reward=cat(first.reward, second.reward),
        env=cat(first.env, second.env),
        sample_row=cat(first.sample_row, second.sample_row),
        seq_hash=cat(first.seq_hash, second.seq_hash),
    )
