"""Pack rollout samples into token-budget batches for teacher-forced recompute, and own the next-token shift.

What: `plan_batches` cuts a list of samples into batches whose total token count stays within a budget
(`--batch-tokens`), and `pack_samples` turns one batch into the flat tensors a varlen forward takes:
``input_ids (N,)``, ``position_ids (N,)`` restarting at 0 per sample, and ``cu_seqlens (D+1,)`` so attention
never crosses a sample boundary (document masking). No padding is ever added.

Why: recompute cost is dominated by the forward over every token; sorting by length and packing keeps each
forward full without padding waste, and one varlen layout serves every batch shape.

The shift lives here and nowhere else: the hidden state at position ``t - 1`` predicts token ``t``, so for
every loss position ``t`` (``loss_mask[t]`` true, ``t >= 1``) `pack_samples` emits
``hidden_index = start + t - 1`` and ``targets = input_ids[start + t]``. Callers gather
``hidden[hidden_index]`` and never reason about offsets themselves.

`plan_micro_batches` instead cuts a fixed number of samples per forward, to mimic a trainer's batch shape.

How: ``batches = plan_batches(lengths, 32768)`` then ``pack_samples(ids, masks, batches[0])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

PackOrder = Literal["length", "source"]


@dataclass(frozen=True)
class PackedBatch:
    """One forward's worth of samples laid end to end (N tokens, D samples, K loss positions)."""

    sample_index: np.ndarray  # (D,) int64, index of each packed sample in the caller's list
    input_ids: torch.Tensor  # (N,) int64
    position_ids: torch.Tensor  # (N,) int64, 0 at the first token of every sample
    cu_seqlens: torch.Tensor  # (D+1,) int32, sample d owns tokens cu_seqlens[d]:cu_seqlens[d+1]
    hidden_index: torch.Tensor  # (K,) int64, packed position whose hidden state predicts the target
    targets: torch.Tensor  # (K,) int64, token id at each loss position
    target_sample: np.ndarray  # (K,) int64, caller's sample index owning each target
    target_pos: np.ndarray  # (K,) int64, position of each target inside its sample

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_targets(self) -> int:
        return int(self.targets.shape[0])


def plan_batches(
    lengths: Sequence[int], batch_tokens: int, *, order: PackOrder = "length"
) -> list[np.ndarray]:
    """Group sample indices into batches of at most `batch_tokens` tokens; every index appears exactly once.

    ``order="length"``: first-fit decreasing (longest first, each sample into the first batch with room),
    which fills batches tightly. ``order="source"``: samples kept in input order, a new batch opened when the
    next one does not fit. A sample longer than the budget forms a batch of its own (it cannot be split:
    attention needs the whole prefix). Ties keep input order, so the plan is deterministic.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    lens = np.asarray(lengths, dtype=np.int64)  # (S,)
    if order == "source":
        return _next_fit(lens, batch_tokens)
    if order != "length":
        raise ValueError(f"order must be 'length' or 'source', got {order!r}")
    by_length = np.argsort(-lens, kind="stable")  # (S,) longest first, ties in input order
    batches: list[list[int]] = []
    room: list[int] = []
    for idx in by_length.tolist():
        n = int(lens[idx])
        slot = next((b for b, free in enumerate(room) if free >= n), None)
        if slot is None:
            batches.append([idx])
            room.append(batch_tokens - n)
        else:
            batches[slot].append(idx)
            room[slot] -= n
    return [np.asarray(b, dtype=np.int64) for b in batches]


def plan_micro_batches(
    lengths: Sequence[int], micro_batch: int, *, order: PackOrder = "length"
) -> list[np.ndarray]:
    """Batches of exactly `micro_batch` samples (the last may be smaller), ignoring the token budget.

    Mimics a trainer that feeds a fixed number of samples per forward (``--micro-batch``): samples are taken
    longest first (``order="length"``, ties in input order) or in input order, and cut into consecutive chunks.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    lens = np.asarray(lengths, dtype=np.int64)  # (S,)
    if order == "length":
        ordered = np.argsort(-lens, kind="stable")
    elif order == "source":
        ordered = np.arange(lens.shape[0], dtype=np.int64)
    else:
        raise ValueError(f"order must be 'length' or 'source', got {order!r}")
    return [ordered[i : i + micro_batch] for i in range(0, ordered.shape[0], micro_batch)]


def _next_fit(lens: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Source-order batching: open a new batch whenever the next sample would overflow the current one."""
    batches: list[list[int]] = []
    used = batch_tokens + 1  # forces a first batch
    for idx, n in enumerate(lens.tolist()):
        if used + n > batch_tokens:
            batches.append([])
            used = 0
        batches[-1].append(idx)
        used += n
    return [np.asarray(b, dtype=np.int64) for b in batches]


def pack_samples(
    input_ids: Sequence[np.ndarray], loss_mask: Sequence[np.ndarray], sample_index: np.ndarray
) -> PackedBatch:
    """Lay the samples `sample_index` end to end and compute the shifted targets at their loss positions.

    `input_ids[i]` (T_i,) integer ids and `loss_mask[i]` (T_i,) bool of sample i. Position 0 of a sample has
    no context, so a loss position there is a caller error (validation reports it as E203 first).
    """
    sample_index = np.asarray(sample_index, dtype=np.int64)
    ids = [np.asarray(input_ids[i]) for i in sample_index.tolist()]
    masks = [np.asarray(loss_mask[i], dtype=bool) for i in sample_index.tolist()]
    lens = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=len(ids))  # (D,)
    if np.any(lens < 1):
        raise ValueError("cannot pack an empty sample")
    if any(m.shape[0] != n for m, n in zip(masks, lens.tolist(), strict=True)):
        raise ValueError("loss_mask and input_ids differ in length")
    if any(bool(m[0]) for m in masks):
        raise ValueError("loss position 0 has no context")
    starts = np.zeros(lens.shape[0] + 1, dtype=np.int64)  # (D+1,)
    np.cumsum(lens, out=starts[1:])
    flat_ids = np.concatenate(ids).astype(np.int64)  # (N,)
    flat_mask = np.concatenate(masks)  # (N,)
    doc = np.repeat(np.arange(lens.shape[0], dtype=np.int64), lens)  # (N,) local sample of each token
    positions = np.arange(flat_ids.shape[0], dtype=np.int64) - starts[doc]  # (N,)

    # the next-token shift: the hidden state at t - 1 predicts token t (t >= 1 by the check above)
    loss_flat = np.flatnonzero(flat_mask)  # (K,) packed position of each loss token
    hidden_index = loss_flat - 1  # (K,)
    return PackedBatch(
        sample_index=sample_index,
        input_ids=torch.from_numpy(flat_ids),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(starts.astype(np.int32)),
        hidden_index=torch.from_numpy(hidden_index),
        targets=torch.from_numpy(flat_ids[loss_flat]),
        target_sample=sample_index[doc[loss_flat]],
        target_pos=positions[loss_flat],
    )
