"""Sample ids, group ids and prompt lengths derived when a source has none.

* `row_sample_ids`: ``"{step}:{row}"``, row the 0-based position in the source's stated order.
* `contiguous_group_ids`: rows kN .. kN+N-1 form group ``"c{step}:{k}"`` (``--group-by contiguous:N``).
* `range_group_ids`: row ranges the source gives as groups (SkyRL prompt boundaries), also ``"c{step}:{k}"``.
* `prompt_group_ids`: ``"p"`` + BLAKE2b-64 hex digest of ``input_ids[:prompt_len]`` as little-endian int32
  (``--group-by prompt``): identical prompts in one step share a group.
* `first_loss_positions`: ``prompt_len`` as the first loss position (multi-turn rows: the first sampled token).
"""

from __future__ import annotations

import hashlib

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList


def row_sample_ids(step: int, n_rows: int, *, first_row: int = 0) -> pl.Series:
    """``"{step}:{row}"`` for rows `first_row` .. `first_row + n_rows - 1`."""
    rows = pl.int_range(first_row, first_row + n_rows, eager=True).cast(pl.String)
    return (f"{step}:" + rows).alias("sample_id")


def contiguous_group_ids(step: int, n_rows: int, size: int) -> pl.Series:
    """``"c{step}:{row // size}"`` for each of `n_rows` rows (the last group may be smaller: W217 shows it)."""
    groups = (pl.int_range(0, n_rows, eager=True) // size).cast(pl.String)
    return (f"c{step}:" + groups).alias("group_id")


def range_group_ids(step: int, boundaries: np.ndarray) -> pl.Series:
    """``"c{step}:{k}"`` for rows ``boundaries[k] .. boundaries[k + 1] - 1`` (`boundaries` (G + 1,), from 0)."""
    sizes = np.diff(np.asarray(boundaries, dtype=np.int64))
    groups = np.repeat(np.arange(len(sizes)), sizes)
    return (f"c{step}:" + pl.Series(groups).cast(pl.String)).alias("group_id")


def prompt_group_ids(input_ids: FlatList, prompt_lens: np.ndarray) -> pl.Series:
    """``"p" + blake2b(input_ids[:prompt_len] as int32 LE, digest_size=8).hexdigest()`` per row."""
    data = np.ascontiguousarray(input_ids.values, dtype="<i4")
    view = memoryview(data).cast("B")
    starts = (np.asarray(input_ids.offsets[:-1], dtype=np.int64) * 4).tolist()
    ends = ((input_ids.offsets[:-1] + np.asarray(prompt_lens, dtype=np.int64)) * 4).tolist()
    ids = [
        "p" + hashlib.blake2b(view[s:e], digest_size=8).hexdigest() for s, e in zip(starts, ends, strict=True)
    ]
    return pl.Series("group_id", ids, dtype=pl.String)


def first_loss_positions(loss_mask: FlatList) -> np.ndarray:
    """(R,) int32 first true position of each row's mask; a row with none gets its length (W215 later)."""
    starts, ends = loss_mask.offsets[:-1], loss_mask.offsets[1:]
    true_at = np.flatnonzero(loss_mask.values)  # (M,) flat positions of true elements
    if true_at.size == 0:
        return loss_mask.lengths.astype(np.int32)
    first_flat = true_at[np.minimum(np.searchsorted(true_at, starts), true_at.size - 1)]
    has = (first_flat >= starts) & (first_flat < ends)
    return np.where(has, first_flat - starts, loss_mask.lengths).astype(np.int32)
