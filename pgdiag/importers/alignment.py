"""Token alignment of per-token values, as flat numpy buffers (`pgdiag.data.flat.FlatList`).

Every per-token list pgdiag stores is token-aligned and full length: element ``i`` scores token ``i`` given
tokens ``< i``. Frameworks store four layouts; a preset turns its layout into that one with these helpers,
vectorised over the whole step (no Python loop over tokens):

* token-aligned, padded (NeMo-RL, prime-rl): `from_padded` cuts each row to its recorded length;
* response-aligned (verl, TRL, slime, PipelineRL actor): element ``j`` is token ``P + j``, ``P`` the unpadded
  prompt length: `response_aligned`;
* right-aligned response block (SkyRL): token ``P + j`` sits at column ``A - R + j`` of width ``A``, ``R`` the
  response length: `right_aligned_block`;
* next-token columns (OpenRLHF): column ``c`` scores token ``c + 1``: `next_token`; `shift` is the general
  ``--shift K`` move.

Padding is removed with recorded lengths, never by matching pad ids (the pad id is often EOS). Positions a
layout gives no value get a null (``valid`` false); the writer then nulls every stream and advantage off
``loss_mask`` ("masks, not values"), so presets need not mask values themselves. `to_series` turns a flat list
into a polars list column for `ImportedStep.rows`. Errors are E703 naming the file and field.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from pgdiag.data.flat import FlatList
from pgdiag.errors import Code, InvalidInputError
from pgdiag.importers.base import bad_layout


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """(R + 1,) int64 offsets of rows of the given (R,) lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    return offsets


def _positions(offsets: np.ndarray) -> np.ndarray:
    """(N,) position of every flat element inside its row."""
    lengths = np.diff(offsets)
    return np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)


def from_rows(rows: Sequence[Sequence[float] | np.ndarray], dtype: np.dtype | type = np.float32) -> FlatList:
    """A flat list from one sequence (list or array) per row; every element valid."""
    arrays = [np.asarray(row, dtype=dtype).reshape(-1) for row in rows]
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return FlatList(offsets_of(lengths), values, None, None)


def from_padded(
    block: np.ndarray,
    lengths: np.ndarray,
    *,
    start: np.ndarray | None = None,
    source: str = "",
    field: str = "",
) -> FlatList:
    """Row r = ``block[r, start[r] : start[r] + lengths[r]]`` of a padded (R, W) block (start 0 by default).

    Left padding: pass ``start = W - lengths``. A row running past the block's width is E703.
    """
    block = np.asarray(block)
    n_rows, width = block.shape
    lengths = np.asarray(lengths, dtype=np.int64)
    start = np.zeros(n_rows, dtype=np.int64) if start is None else np.asarray(start, dtype=np.int64)
    bad = np.flatnonzero((lengths < 0) | (start < 0) | (start + lengths > width))
    if bad.size:
        r = int(bad[0])
        raise bad_layout(
            source, field, f"columns {start[r]}..{start[r] + lengths[r]} inside width {width}", row=r
        )
    offsets = offsets_of(lengths)
    cols = np.repeat(start, lengths) + _positions(offsets)
    rows = np.repeat(np.arange(n_rows, dtype=np.int64), lengths)
    return FlatList(offsets, block[rows, cols], None, None)


def response_aligned(
    response: FlatList, prompt_lens: np.ndarray, seq_lens: np.ndarray, *, source: str = "", field: str = ""
) -> FlatList:
    """Place response-aligned row values (element j = token P + j) into full-length token-aligned rows.

    `response` holds R rows of any length <= T - P; `prompt_lens` (R,) P; `seq_lens` (R,) T. Positions before
    P and after the response are null. A response longer than T - P is E703.
    """
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    resp_lens = response.lengths
    bad = np.flatnonzero((prompt_lens < 0) | (prompt_lens + resp_lens > seq_lens))
    if bad.size:
        r = int(bad[0])
        raise bad_layout(
            source,
            field,
            f"at most {seq_lens[r] - prompt_lens[r]} response values (T {seq_lens[r]} - prompt {prompt_lens[r]}), "
            f"got {resp_lens[r]}",
            row=r,
        )
    offsets = offsets_of(seq_lens)
    values = np.zeros(offsets[-1], dtype=response.values.dtype)
    valid = np.zeros(offsets[-1], dtype=bool)
    dest = np.repeat(offsets[:-1] + prompt_lens, resp_lens) + _positions(response.offsets)
    values[dest] = response.values
    valid[dest] = True if response.valid is None else response.valid
    return FlatList(offsets, values, valid, None)


def right_aligned_block(
    block: np.ndarray, prompt_lens: np.ndarray, response_lens: np.ndarray, seq_lens: np.ndarray
) -> FlatList:
    """Full-length rows from a right-aligned response block (SkyRL): token ``P + j`` at column ``A - R + j``.

    `block` (R_rows, A); `prompt_lens` P, `response_lens` R, `seq_lens` T, each (R_rows,). Positions outside
    the response are null.
    """
    block = np.asarray(block)
    width = block.shape[1]
    response = from_padded(block, response_lens, start=width - np.asarray(response_lens, dtype=np.int64))
    return response_aligned(response, prompt_lens, seq_lens)


def next_token(block: np.ndarray, seq_lens: np.ndarray, *, source: str = "", field: str = "") -> FlatList:
    """Full-length rows from next-token columns (OpenRLHF): column c of `block` (R, A) scores token c + 1.

    Token 0 of each row is null; token i in 1..T-1 takes column i - 1. A row needing more than A columns is E703.
    """
    block = np.asarray(block)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    cols = from_padded(block, np.maximum(seq_lens - 1, 0), source=source, field=field)
    return response_aligned(cols, np.minimum(seq_lens, 1), seq_lens, source=source, field=field)


def shift(values: FlatList, seq_lens: np.ndarray, k: int, *, source: str = "", field: str = "") -> FlatList:
    """Move element i of each row to position i + k of a row of length T (``--shift``).

    A row may be T or T - |k| long. Elements moved past either end must be null or 0.0, else E201-like
    E703; positions left empty are null.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    lengths = values.lengths
    bad = np.flatnonzero((lengths != seq_lens) & (lengths != seq_lens - abs(k)))
    if bad.size:
        r = int(bad[0])
        raise bad_layout(
            source,
            field,
            f"length {seq_lens[r]} or {seq_lens[r] - abs(k)} to shift by {k}, got {lengths[r]}",
            row=r,
        )
    pos = _positions(values.offsets) + k
    row = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    inside = (pos >= 0) & (pos < seq_lens[row])
    valid_in = np.ones(values.values.shape[0], dtype=bool) if values.valid is None else values.valid
    dropped = ~inside & valid_in & (values.values != 0)
    if dropped.any():
        first = int(np.flatnonzero(dropped)[0])
        raise bad_layout(
            source,
            field,
            f"null or 0.0 where --shift {k} moves past the row's end (value {values.values[first]!r})",
            row=int(row[first]),
        )
    offsets = offsets_of(seq_lens)
    out = np.zeros(offsets[-1], dtype=values.values.dtype)
    valid = np.zeros(offsets[-1], dtype=bool)
    dest = offsets[row[inside]] + pos[inside]
    out[dest] = values.values[inside]
    valid[dest] = valid_in[inside]
    return FlatList(offsets, out, valid, None)


def null_off_mask(values: FlatList, loss_mask: FlatList) -> FlatList:
    """`values` with every element outside `loss_mask` null (both lists have the same offsets)."""
    valid = loss_mask.values.astype(bool, copy=False)
    if values.valid is not None:
        valid = valid & values.valid
    return FlatList(values.offsets, values.values, valid, values.row_valid)


_ARROW_OF_POLARS = {
    pl.Float32: (pa.float32(), np.float32),
    pl.Float64: (pa.float64(), np.float64),
    pl.Int32: (pa.int32(), np.int32),
    pl.Int64: (pa.int64(), np.int64),
    pl.Int8: (pa.int8(), np.int8),
    pl.Int16: (pa.int16(), np.int16),
    pl.UInt8: (pa.uint8(), np.uint8),
    pl.UInt32: (pa.uint32(), np.uint32),
    pl.UInt64: (pa.uint64(), np.uint64),
}


def _bitmap(bits: np.ndarray) -> pa.Buffer:
    return pa.py_buffer(np.packbits(bits, bitorder="little"))


def _refuse_wrap(name: str, values: np.ndarray, target: np.dtype) -> None:
    """E103 when integer `values` do not fit the narrower integer `target` (a cast would wrap them silently)."""
    if target.kind not in "iu" or values.dtype.kind not in "iu" or values.size == 0:
        return
    if np.can_cast(values.dtype, target, casting="safe"):
        return
    info = np.iinfo(target)
    lo, hi = int(values.min()), int(values.max())
    if lo < info.min or hi > info.max:
        worst = lo if lo < info.min else hi
        raise InvalidInputError(
            Code.LOSSY_CAST, f"{name}: value {worst} does not fit {target}", "ids must fit int32"
        )


def to_series(name: str, flat: FlatList, dtype: pl.DataType) -> pl.Series:
    """A polars list column from a flat list; elements whose `valid` is false are null.

    Built from Arrow buffers directly (no per-element Python work, no pandas import).
    """
    inner_dtype = dtype.inner  # type: ignore[union-attr]
    n = int(flat.values.shape[0])
    nulls = 0 if flat.valid is None else n - int(np.count_nonzero(flat.valid))
    validity = _bitmap(flat.valid) if nulls else None
    if inner_dtype == pl.Boolean:
        inner = pa.Array.from_buffers(
            pa.bool_(), n, [validity, _bitmap(flat.values.astype(bool, copy=False))], nulls
        )
    else:
        arrow_type, numpy_type = _ARROW_OF_POLARS[inner_dtype]
        _refuse_wrap(name, flat.values, np.dtype(numpy_type))
        values = np.ascontiguousarray(flat.values, dtype=numpy_type)
        inner = pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(values)], nulls)
    offsets = pa.py_buffer(np.ascontiguousarray(flat.offsets, dtype=np.int64))
    row_nulls = 0 if flat.row_valid is None else int(np.count_nonzero(~flat.row_valid))
    row_validity = _bitmap(flat.row_valid) if row_nulls else None
    array = pa.LargeListArray.from_buffers(
        pa.large_list(inner.type), len(flat.offsets) - 1, [row_validity, offsets], row_nulls, children=[inner]
    )
    return pl.Series(name, array)


def sequence_columns(
    input_ids: FlatList, loss_mask: FlatList, prompt_len: np.ndarray
) -> dict[str, pl.Series]:
    """The ``input_ids``, ``loss_mask`` and ``prompt_len`` (B,) columns of a step's rows, in their canonical types."""
    return {
        "input_ids": to_series("input_ids", input_ids, pl.List(pl.Int32)),
        "loss_mask": to_series("loss_mask", loss_mask, pl.List(pl.Boolean)),
        "prompt_len": pl.Series("prompt_len", prompt_len.astype(np.int32)),
    }
