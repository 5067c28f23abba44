"""Which rows a comparison reads together, from the one piece planner (`pgdiag.data.pieces`).

What: `plan_pieces` lists the pieces `compare_runs` reads one at a time: pieces of consecutive whole steps of both
runs (`step_pieces`, from `plan_step_pieces`), or under ``--join hash-any-step`` pieces of steps of run a with the
steps of run b that hold their matches (`pgdiag.data.pieces.any_step_pieces`: samples paired once on the whole
runs' key columns, each piece carrying its pairs as row indices). `checked_matches` checks a piece's pairs
against the batches read; `keys_deferred` gives the unmatched counts (E304, E306) from the keys; `concat_batches`
joins the two reads of side b a hash-any-step piece may need (docs/compare.md, "Reading step by step").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

import numpy as np

from pgdiag.compare.alignment_issues import Deferred
from pgdiag.data.batch import TokenBatch
from pgdiag.data.pieces import AnyStepKeys, PairPiece, PairPlan, any_step_pieces, plan_step_pieces
from pgdiag.errors import Code, InvalidInputError


def plan_pieces(
    a: Any, b: Any, *, one_run: bool, whole: bool, join: str, chunk_rows: int, ignore: Collection[str]
) -> PairPlan:
    """The pieces of `compare_runs`: hash-any-step pieces for two runs joined across steps, else step pieces."""
    if whole:
        return PairPlan([PairPiece(None)])
    if join == "hash-any-step" and not one_run:  # one run: each sample matches itself, in its own step
        return any_step_pieces(a, b, chunk_rows, ignore)
    return PairPlan(step_pieces(a, b, one_run, chunk_rows))


def step_pieces(a: Any, b: Any, one_run: bool, chunk_rows: int) -> list[PairPiece]:
    """Consecutive steps of both runs under `chunk_rows` rows (a + b; `pgdiag.data.pieces.plan_step_pieces`);
    one whole piece when they fit in one."""
    planned = plan_step_pieces([a] if one_run else [a, b], chunk_rows).pieces
    return [PairPiece(p.steps, p.present[0], p.present[-1]) for p in planned]


def checked_matches(piece: PairPiece, a: TokenBatch, b: TokenBatch) -> tuple[np.ndarray, np.ndarray] | None:
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
            Code.LOSSY_CAST,
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


def keys_deferred(keys: AnyStepKeys, pair_name: str, label_a: str, label_b: str) -> Deferred:
    """The `Deferred` counts a one-piece read gives, from a hash-any-step plan's keys (the mask counts come from
    the pieces)."""

    def first(where: tuple[int, str] | None, label: str) -> tuple[str, int, str] | None:
        return None if where is None else (f"step {where[0]}, sample {where[1]} of {label}", *where)

    n_only_a = keys.n_a - keys.n_matched
    n_only_b = keys.n_b - keys.n_matched
    return Deferred(
        pair_name,
        label_a,
        label_b,
        "hash-any-step",
        keys.n_a,
        keys.n_b,
        keys.n_matched,
        n_only_a,
        n_only_b,
        first(keys.first_only_a, label_a),
        first(keys.first_only_b, label_b),
        keys.steps_a,
        keys.steps_b,
    )
