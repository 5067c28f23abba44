"""Arrow arrays made from numpy buffers directly, without `pyarrow.array`.

What: `numeric_array(values, arrow_type, null=None)` (a fixed-width column, null where `null` is True),
`string_array(strings)` (utf-8, no nulls) and `list_array(offsets, values)`; the same arrays `pa.array` gives for
these inputs (tests/data/test_arrow_build.py checks them against it).

Why: `pa.array` (and `pa.table` of a dict) asks whether its input is a pandas object, and that question imports
pandas (0.25-0.3 s) the first time; `pgdiag logprobs` paid it at its first part written, inside its start-up
(docs/benchmarks.md, "Start-up: the warm fixed cost"). Nothing in the recompute needs pandas.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

_NUMPY_OF = {
    pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
    pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
    pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64,
}  # fmt: skip


def numeric_array(values: np.ndarray, arrow_type: pa.DataType, null: np.ndarray | None = None) -> pa.Array:
    """(n,) `values` cast to `arrow_type` (a fixed-width integer or float type); null where `null` (n,) is True."""
    data = np.ascontiguousarray(np.asarray(values), dtype=_NUMPY_OF[arrow_type])  # (n,)
    validity = None
    if null is not None and bool(np.any(null)):
        validity = pa.py_buffer(np.packbits(~np.asarray(null, dtype=bool), bitorder="little"))
    return pa.Array.from_buffers(arrow_type, len(data), [validity, pa.py_buffer(data)])


def string_array(strings: Sequence[str]) -> pa.Array:
    """utf-8 strings (no nulls) as an Arrow string array."""
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)  # (n+1,)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


def list_array(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
    """A list array of `values` cut at int32 `offsets` (n+1,)."""
    return pa.ListArray.from_arrays(numeric_array(offsets, pa.int32()), values)
