"""`loss_view`: every float column of a `RowTable` gathered at its loss positions once, for both validation and
`TokenBatch`, with the size of the recorded kept set at each (`data.kept`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pgdiag.data.flat import METADATA_LISTS, RowTable, row_of
from pgdiag.data.kept import position_sizes


@dataclass(frozen=True)
class LossView:
    """The loss positions of a structurally sound `RowTable`, with every float column gathered there.

    Computed once and shared by validation and `TokenBatch` building. Values stay float32 (half the memory
    while the list buffers are alive; the batch converts to float64); a null on a loss position is NaN in
    `values` and False in `valid`.
    """

    index: np.ndarray  # (M,) int64 flat index of every loss token
    row_start: np.ndarray  # (R + 1,) int64 loss-token offsets of each row
    values: dict[str, np.ndarray]  # column -> (M,) float32
    valid: dict[str, np.ndarray | None]  # column -> (M,) bool validity, None = no null on a loss position
    token_id: np.ndarray  # (M,) int32 input_ids at the loss positions
    seq_offsets: np.ndarray  # (R + 1,) int64 offsets of the rows in the flat input_ids
    kept_size: np.ndarray | None = (
        None  # (M,) int32 size of the recorded kept set (0 = none); None: no K read
    )

    def rows_of(self, loss_token: np.ndarray) -> np.ndarray:
        """(K,) row owning each of the given loss-token indices."""
        return row_of(self.row_start, loss_token)


def loss_view(table: RowTable) -> LossView:
    """Gather the loss positions of `table` (every row must be structurally sound)."""
    ids = table.lists["input_ids"]
    index = np.flatnonzero(table.lists["loss_mask"].values)  # (M,)
    row_start = np.searchsorted(index, ids.offsets).astype(np.int64)  # (R + 1,)
    values: dict[str, np.ndarray] = {}
    valid: dict[str, np.ndarray | None] = {}
    mask = table.lists["loss_mask"].values
    for column, flat in table.lists.items():
        if column in ("input_ids", "loss_mask", *METADATA_LISTS):
            continue
        gathered = flat.values[mask].astype(np.float32, copy=False)  # (M,) float32 until the batch
        column_valid = None
        if flat.valid is not None and np.count_nonzero(flat.valid & mask) != index.size:
            column_valid = flat.valid[index]
            gathered[~column_valid] = np.nan
        values[column], valid[column] = gathered, column_valid
    token_id = ids.values[mask].astype(np.int32, copy=False)
    kept_size = None
    if table.kept is not None:
        kept_size = position_sizes(table.kept, ids.offsets)[index].astype(np.int32)
    return LossView(index, row_start, values, valid, token_id, ids.offsets, kept_size)
