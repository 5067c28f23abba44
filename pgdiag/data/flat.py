"""Flat buffers of rollout rows: list columns as offsets + values + validity, and their loss positions.

Why: per-token rules and metrics must run as vectorised numpy over millions of tokens, never as Python loops,
and list columns are ragged. How: `flat_list` turns a polars list column into one `FlatList` through Arrow,
zero-copy for the values and with validity bitmaps unpacked by numpy; a `RowTable` holds a selection of rows
(scalar columns as a polars frame, list columns flattened); `subset_rows` drops rows and re-flattens.
`data.loss_view` gathers every float column at the loss positions once, for both validation and `TokenBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa

if TYPE_CHECKING:
    from pgdiag.data.kept import KeptColumns


@dataclass(frozen=True)
class FlatList:
    """A list column of R rows as flat buffers: row r owns ``values[offsets[r]:offsets[r + 1]]``."""

    offsets: np.ndarray  # (R + 1,) int64, offsets[0] == 0
    values: np.ndarray  # (N,)
    valid: np.ndarray | None  # (N,) bool element validity; None = no null element
    row_valid: np.ndarray | None  # (R,) bool; None = no null list

    @property
    def lengths(self) -> np.ndarray:
        """(R,) int64 list lengths (0 for a null list)."""
        return np.diff(self.offsets)


@dataclass(frozen=True)
class RowTable:
    """Rows loaded for validation: scalar columns in `frame` (plus ``__file``), list columns flattened."""

    frame: pl.DataFrame  # (R rows) scalar columns and "__file"
    lists: dict[str, FlatList]  # column -> flat list (input_ids, loss_mask, streams, advantages, entropy)
    stream_columns: tuple[str, ...]  # log-prob columns among `lists` (E205/E206/W216 apply to them)
    kept: KeptColumns | None = (
        None  # the kept sets of the sampling stream (CSR, not token-aligned), when read
    )

    @property
    def n_rows(self) -> int:
        return self.frame.height


# Per-token metadata lists read by `check` for their rules alone (E201 length, E207 non-finite): no loss
# positions are gathered for them and the value rules of streams do not apply.
METADATA_LISTS = ("temperature_tok", "policy_version_tok")


def row_of(offsets: np.ndarray, flat_index: np.ndarray) -> np.ndarray:
    """(K,) row owning each flat index (`offsets`: the (R + 1,) CSR offsets of a list column)."""
    return np.searchsorted(offsets, flat_index, side="right") - 1


def subset_rows(table: RowTable, keep: np.ndarray) -> RowTable:
    """The rows `keep` ((K,) int64 indices, in the order given) of `table`, every list column re-flattened."""
    keep = np.asarray(keep, dtype=np.int64)
    lists = {}
    for column, flat in table.lists.items():
        lengths = flat.lengths[keep]
        offsets = np.zeros(keep.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        take = np.repeat(flat.offsets[:-1][keep] - offsets[:-1], lengths) + np.arange(
            offsets[-1], dtype=np.int64
        )
        lists[column] = FlatList(
            offsets,
            flat.values[take],
            None if flat.valid is None else flat.valid[take],
            None if flat.row_valid is None else flat.row_valid[keep],
        )
    kept = None if table.kept is None else table.kept.take(keep)
    return RowTable(table.frame[keep.tolist()], lists, table.stream_columns, kept)


def _bits(buffer: pa.Buffer, offset: int, length: int) -> np.ndarray:
    """(length,) bool from an Arrow bitmap buffer starting at bit `offset`."""
    packed = np.frombuffer(buffer, dtype=np.uint8)
    return np.unpackbits(packed, bitorder="little", count=offset + length)[offset:].view(np.bool_)


def _numpy_dtype(arrow_type: pa.DataType) -> np.dtype:
    """The numpy dtype of a fixed-width Arrow type, without pyarrow's pandas shim (importing pandas costs 0.3 s)."""
    for kind, dtype in _NUMPY_DTYPES:
        if arrow_type == kind:
            return np.dtype(dtype)
    return np.dtype(arrow_type.to_pandas_dtype())


_NUMPY_DTYPES = (
    (pa.float32(), np.float32),
    (pa.float64(), np.float64),
    (pa.int32(), np.int32),
    (pa.int64(), np.int64),
    (pa.int16(), np.int16),
    (pa.int8(), np.int8),
    (pa.uint64(), np.uint64),
    (pa.uint32(), np.uint32),
)


def flat_list(series: pl.Series) -> FlatList:
    """Flatten a polars list (or fixed-size `Array`) column into offsets, values (native dtype, zero-copy) and element/row validity."""
    arrow = series.to_arrow()
    if isinstance(arrow, pa.ChunkedArray):
        arrow = arrow.combine_chunks()
    if pa.types.is_fixed_size_list(arrow.type):  # a polars `Array` column: the same values as a list
        arrow = arrow.cast(pa.list_(arrow.type.value_field))
    offset_dtype = np.int64 if pa.types.is_large_list(arrow.type) else np.int32
    raw_offsets = np.frombuffer(arrow.buffers()[1], dtype=offset_dtype, count=arrow.offset + len(arrow) + 1)
    offsets = raw_offsets[arrow.offset :].astype(np.int64)
    start, stop = int(offsets[0]), int(offsets[-1])
    child = arrow.values.slice(start, stop - start)
    row_valid = None if arrow.null_count == 0 else arrow.is_valid().to_numpy(zero_copy_only=False)
    validity, data = child.buffers()[0], child.buffers()[1]
    valid = None if child.null_count == 0 else _bits(validity, child.offset, len(child))
    if pa.types.is_boolean(child.type):
        values = _bits(data, child.offset, len(child))
        if valid is not None:
            values = values & valid
    else:
        raw = np.frombuffer(data, dtype=_numpy_dtype(child.type), count=child.offset + len(child))
        values = raw[child.offset :]
    return FlatList(offsets - start, values, valid, row_valid)
