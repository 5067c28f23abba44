"""`pgdiag.data.arrow_build`: the arrays equal `pa.array`'s for the same inputs, and building and writing them
imports no pandas (what they are for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pgdiag.data.arrow_build import list_array, numeric_array, string_array


@pytest.mark.parametrize(
    ("dtype", "arrow_type"),
    [(np.int64, pa.int64()), (np.int32, pa.int32()), (np.uint64, pa.uint64()), (np.float32, pa.float32())],
)
def test_numeric_equals_pa_array(dtype: type, arrow_type: pa.DataType) -> None:
    values = (np.arange(11) * 7 - 20).astype(np.float64)
    values = values if np.issubdtype(dtype, np.floating) else np.abs(values).astype(dtype)
    built = numeric_array(values, arrow_type)
    assert built.equals(pa.array(values, type=arrow_type))
    assert built.null_count == 0


def test_nulls_where_asked() -> None:
    values = np.array(
        [0.5, -1.0, 2.0, 3.0, -4.0, 5.0, 6.0, 7.0, 8.0], dtype=np.float32
    )  # 9: a second bitmap byte
    null = np.array([True, False, False, True, False, False, False, False, True])
    built = numeric_array(values, pa.float32(), null)
    assert built.equals(pa.array(values, type=pa.float32(), mask=null))
    assert built.to_pylist() == [None, -1.0, 2.0, None, -4.0, 5.0, 6.0, 7.0, None]
    assert numeric_array(values, pa.float32(), np.zeros(9, dtype=bool)).null_count == 0


def test_strings_and_lists() -> None:
    names = ["s0", "", "prompt-é", "x" * 40]
    assert string_array(names).equals(pa.array(names, type=pa.string()))
    assert string_array([]).to_pylist() == []
    offsets = np.array([0, 2, 2, 5], dtype=np.int64)
    values = numeric_array(
        np.arange(5, dtype=np.float32), pa.float32(), np.array([0, 1, 0, 0, 1], dtype=bool)
    )
    built = list_array(offsets, values)
    assert built.to_pylist() == [[0.0, None], [], [2.0, 3.0, None]]
    assert built.type == pa.list_(pa.float32())


def test_building_and_writing_imports_no_pandas(tmp_path: Path) -> None:
    code = f"""
import sys
import numpy as np, pyarrow as pa
from pgdiag.data.arrow_build import list_array, numeric_array, string_array
from pgdiag.data.writing import write_parquet
offsets = np.array([0, 2, 3])
columns = [numeric_array(np.array([1, 2]), pa.int64()), string_array(["a", "b"]),
           list_array(offsets, numeric_array(np.ones(3), pa.float32(), np.array([0, 1, 0], dtype=bool)))]
write_parquet(pa.Table.from_arrays(columns, names=["step", "id", "lp"]), {str(tmp_path / "p.parquet")!r},
              metadata={{"x": 1}})
print("pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert pq.read_table(tmp_path / "p.parquet").column("lp").to_pylist() == [[1.0, None], [1.0]]
