"""Index arithmetic over the flat token layout of a `TokenBatch`: gather samples, intersect loss positions.

What: `token_take(offsets, rows)` gives the token indices and new offsets of samples `rows` (None when `rows` is
every sample in order: no gather, no copy); `gather` and `token_indices` apply such indices; `position_keys`
keys the (sample, pos) loss positions of both sides of a matched pair, once; `intersect_positions` pairs those
present on both sides and `first_mask_difference` finds the first one present on one side only (E303/W303).

Why apart: pure numpy on (M,) arrays with no knowledge of runs or issues; `pgdiag.compare.align` uses it for
every matched sample.
"""

from __future__ import annotations

import numpy as np


def token_take(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Token indices of samples `rows` (in that order) and the offsets of the gathered layout.

    The indices are None when `rows` is every sample in order (the common case: no gather, no copy).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape[0] == offsets.shape[0] - 1 and np.array_equal(rows, np.arange(rows.shape[0])):
        return None, np.asarray(offsets, dtype=np.int64)
    starts = offsets[rows]
    counts = offsets[rows + 1] - starts
    new_offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    take = np.repeat(starts - new_offsets[:-1], counts) + np.arange(new_offsets[-1], dtype=np.int64)
    return take, new_offsets


def gather(values: np.ndarray, take: np.ndarray | None) -> np.ndarray:
    """values[take], or `values` itself when take is None (identity)."""
    return values if take is None else values[take]


def token_indices(take: np.ndarray | None, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) if take is None else take


def position_keys(
    pos_a: np.ndarray,
    take_a: np.ndarray,
    off_a: np.ndarray,
    pos_b: np.ndarray,
    take_b: np.ndarray,
    off_b: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(M_a,) and (M_b,) int64 keys ``row << 32 | pos`` of the gathered loss positions of both sides (sorted within
    each matched row, unique), so that set operations on them pair (sample, pos)."""
    rows = np.arange(off_a.shape[0] - 1, dtype=np.int64)
    key_a = (np.repeat(rows, np.diff(off_a)) << 32) | pos_a[take_a].astype(np.int64)
    key_b = (np.repeat(rows, np.diff(off_b)) << 32) | pos_b[take_b].astype(np.int64)
    return key_a, key_b


def intersect_positions(
    key_a: np.ndarray, key_b: np.ndarray, take_a: np.ndarray, take_b: np.ndarray, n_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token indices into a and b of the (sample, pos) present on both sides (`position_keys`), and the (n_rows + 1,)
    offsets of the matched rows."""
    _, ja, jb = np.intersect1d(key_a, key_b, assume_unique=True, return_indices=True)  # sorted by (row, pos)
    counts = np.bincount(key_a[ja] >> 32, minlength=n_rows)
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return take_a[ja], take_b[jb], offsets


def first_mask_difference(key_a: np.ndarray, key_b: np.ndarray) -> tuple[int, int]:
    """(matched row, pos) of the first loss position present on one side only (`position_keys`)."""
    first = int(np.setxor1d(key_a, key_b, assume_unique=True).min())
    return first >> 32, first & 0xFFFFFFFF
