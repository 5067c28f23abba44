"""Write small canonical rollouts files from Python lists, for tests (importable by every test module).

`write_rollouts_file(path, rows, **meta)` writes one pgdiag.rollouts/v1 Parquet file exactly as given: no
sorting and no repair, so tests can craft invalid files. Columns take their canonical types unless
listed in `raw_types`; `seq_hash` is computed from `input_ids` when a row lacks it (and its ids are numbers); `run` defaults to "t" and
`group_id` to "g0". Footer entries come from `meta` (``schema=None`` drops a key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pgdiag.data.schema import ROLLOUTS_SCHEMA, encode_footer
from pgdiag.data.seqhash import seq_hash

_FLOAT_LIST = pl.List(pl.Float32)
POLARS_TYPES: dict[str, pl.DataType] = {
    "run": pl.String,
    "step": pl.Int64,
    "sample_id": pl.String,
    "segment_idx": pl.Int32,
    "routed_experts": pl.List(pl.Int16),
    "group_id": pl.String,
    "seq_hash": pl.UInt64,
    "input_ids": pl.List(pl.Int32),
    "prompt_len": pl.Int32,
    "loss_mask": pl.List(pl.Boolean),
    "advantage": pl.Float32,
    "reward": pl.Float32,
    "env": pl.String,
    "temperature": pl.Float32,
    "temperature_tok": pl.List(pl.Float32),
}


def default_footer() -> dict[str, Any]:
    return {
        "schema": ROLLOUTS_SCHEMA,
        "alignment": "token",
        "created_by": "pgdiag tests",
        "source": {"framework": "tests", "preset": "canonical", "retokenized": False, "unsafe_load": False},
        "streams": {},
    }


def _polars_type(column: str) -> pl.DataType | None:
    if column in POLARS_TYPES:
        return POLARS_TYPES[column]
    if column.endswith("_logprobs") or column in ("advantages", "logprobs", "entropy"):
        return _FLOAT_LIST
    return None


def rollouts_frame(
    rows: list[dict[str, Any]], *, raw_types: dict[str, pl.DataType] | None = None
) -> pl.DataFrame:
    """A polars frame of `rows` with canonical column types (defaults filled as the module docstring says)."""
    filled = []
    for row in rows:
        row = dict(row)
        row.setdefault("run", "t")
        row.setdefault("group_id", "g0")
        ids = row.get("input_ids")
        if "seq_hash" not in row and isinstance(ids, list) and all(isinstance(i, int | float) for i in ids):
            row["seq_hash"] = seq_hash(ids)  # ids of another type (a fuzzed file) leave it null
        filled.append(row)
    columns = list(dict.fromkeys(c for row in filled for c in row))
    schema = {}
    for column in columns:
        dtype = (raw_types or {}).get(column) or _polars_type(column)
        schema[column] = dtype if dtype is not None else pl.String
    data = {c: [row.get(c) for row in filled] for c in columns}
    return pl.DataFrame(data, schema=schema)


def valid_rows() -> list[dict[str, Any]]:
    """Two steps x one group of two samples; position 0-1 prompt, loss on the response (one masked span)."""
    rows = []
    for step in (0, 1):
        rows.append(
            {
                "step": step,
                "sample_id": f"{step}:0",
                "group_id": f"g{step}",
                "input_ids": [11, 12, 13, 14, 15, 16],
                "prompt_len": 2,
                "loss_mask": [False, False, True, False, True, True],
                "rollout_logprobs": [None, None, -0.5, None, -1.25, -0.125],
                "old_logprobs": [None, None, -0.5, None, -1.0, -0.25],
                "advantages": [None, None, 1.0, None, 1.0, 1.0],
                "reward": 1.0,
                "env": "math",
            }
        )
        rows.append(
            {
                "step": step,
                "sample_id": f"{step}:1",
                "group_id": f"g{step}",
                "input_ids": [11, 12, 21, 22],
                "prompt_len": 2,
                "loss_mask": [False, False, True, True],
                "rollout_logprobs": [None, None, -2.0, -0.75],
                "old_logprobs": [None, None, -2.5, -0.5],
                "advantages": [None, None, -1.0, -1.0],
                "reward": 0.0,
                "env": "code",
            }
        )
    return rows


def response_row(
    step: int,
    sample_id: str,
    rollout: list[float],
    old: list[float],
    new: list[float] | None = None,
    advantage: float = 1.0,
    **columns: Any,
) -> dict[str, Any]:
    """One sample of a two-token prompt and a response whose every token is in the loss: the streams given per
    response token (`new` defaults to `old`), one advantage on every token, reward 1, plus any other `columns`
    (``policy_version=...``)."""
    n = len(rollout)
    return {
        "step": step,
        "sample_id": sample_id,
        "input_ids": [1, 2, *range(10, 10 + n)],
        "prompt_len": 2,
        "loss_mask": [False, False] + [True] * n,
        "rollout_logprobs": [None, None, *rollout],
        "old_logprobs": [None, None, *old],
        "new_logprobs": [None, None, *(old if new is None else new)],
        "advantages": [None, None] + [advantage] * n,
        "reward": 1.0,
        **columns,
    }


def write_rollouts_file(
    path: str | Path,
    rows: list[dict[str, Any]],
    *,
    raw_types: dict[str, pl.DataType] | None = None,
    row_group_rows: int | None = None,
    **meta: Any,
) -> Path:
    """Write `rows` to `path` as one Parquet file with a pgdiag footer (see the module docstring); one row group,
    or row groups of `row_group_rows` rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    footer = default_footer()
    for key, value in meta.items():
        if value is None:
            footer.pop(key, None)
        else:
            footer[key] = value
    table = rollouts_frame(rows, raw_types=raw_types).to_arrow()
    table = table.replace_schema_metadata(encode_footer(footer))
    pq.write_table(table, path, compression="zstd", row_group_size=row_group_rows)
    return path


def write_logprobs_part(path: str | Path, rows: list[dict[str, Any]], **meta: Any) -> Path:
    """Write a pgdiag.logprobs/v1 part (step, sample_id, segment_idx, seq_hash, logprobs[, entropy])."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pl.DataFrame(
        {c: [row.get(c) for row in rows] for c in dict.fromkeys(c for row in rows for c in row)},
        schema={c: _polars_type(c) or pl.String for c in dict.fromkeys(c for row in rows for c in row)},
    )
    footer = {
        "schema": "pgdiag.logprobs/v1",
        "recompute": {"settings": {"dtype": "bf16", "head_dtype": "fp32"}},
    }
    footer.update(meta)
    table: pa.Table = frame.to_arrow().replace_schema_metadata(encode_footer(footer))
    pq.write_table(table, path, compression="zstd")
    return path
