"""Schema helpers, seq_hash and the atomic writers."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pgdiag.data.schema import (
    cast_problem,
    check_rollouts_footer,
    decode_footer,
    encode_footer,
    entropy_column,
    stream_column,
)
from pgdiag.data.seqhash import input_fingerprint, seq_hash, seq_hashes
from pgdiag.data.writing import (
    atomic_write,
    sequence_row_group_rows,
    source_meta,
    stream_meta,
    write_json,
    write_parquet,
    write_rollouts,
)
from pgdiag.errors import InvalidInputError, UsageError


def test_seq_hash_known_answer() -> None:
    # ids [1, 2, 151645] as little-endian int32, hashed independently from a literal byte string
    literal = b"\x01\x00\x00\x00\x02\x00\x00\x00\x5d\x50\x02\x00"
    assert struct.pack("<3i", 1, 2, 151645) == literal
    expected = int.from_bytes(hashlib.blake2b(literal, digest_size=8).digest(), "little")
    assert seq_hash([1, 2, 151645]) == expected
    assert seq_hash(np.array([1, 2, 151645], dtype=np.int64)) == expected
    assert seq_hash([]) == int.from_bytes(hashlib.blake2b(b"", digest_size=8).digest(), "little")


def test_seq_hash_negative_id_is_twos_complement_and_range_checked() -> None:
    literal = b"\xff\xff\xff\xff"
    assert seq_hash([-1]) == int.from_bytes(hashlib.blake2b(literal, digest_size=8).digest(), "little")
    with pytest.raises(ValueError):
        seq_hash([2**31])


def test_seq_hashes_matches_per_row() -> None:
    rng = np.random.default_rng(1)
    lengths = np.array([3, 0, 5, 1])
    values = rng.integers(0, 1000, lengths.sum()).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    expected = [seq_hash(values[offsets[i] : offsets[i + 1]]) for i in range(4)]
    assert seq_hashes(values, offsets).tolist() == expected


def test_input_fingerprint_is_order_independent() -> None:
    keys = [(1, "a", 0, 5), (0, "b", 0, 7)]
    text = b"0,b,0,7\n1,a,0,5\n"
    expected = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    assert input_fingerprint(keys) == expected
    assert input_fingerprint(reversed(keys)) == expected


def test_footer_round_trip_and_names() -> None:
    meta = {"schema": "pgdiag.rollouts/v1", "pgdiag.streams": {"rollout": {"tempered": False}}}
    raw = encode_footer(meta)
    assert raw[b"pgdiag.schema"] == b'"pgdiag.rollouts/v1"'
    decoded = decode_footer({**raw, b"other": b"x", b"pgdiag.bad": b"not json"})
    assert decoded == {
        "schema": "pgdiag.rollouts/v1",
        "streams": {"rollout": {"tempered": False}},
        "bad": "not json",
    }
    assert stream_column("old") == "old_logprobs"
    assert entropy_column("rc_bf16_fp32") == "rc_bf16_fp32_entropy"


def test_footer_checks() -> None:
    check_rollouts_footer({"schema": "pgdiag.rollouts/v1", "alignment": "token"}, Path("f.parquet"))
    with pytest.raises(InvalidInputError) as e101:
        check_rollouts_footer({"schema": "pgdiag.rollouts/v0", "alignment": "token"}, Path("f.parquet"))
    assert e101.value.code == "E101" and "f.parquet" in e101.value.message and "v0" in e101.value.message
    with pytest.raises(InvalidInputError) as e104:
        check_rollouts_footer({"schema": "pgdiag.rollouts/v1", "alignment": "response"}, Path("f.parquet"))
    assert e104.value.code == "E104" and "'response'" in e104.value.message


def test_cast_problem() -> None:
    assert cast_problem("old_logprobs", pl.List(pl.Float64)) is None
    assert cast_problem("input_ids", pl.List(pl.Int64)) is None
    assert "old_logprobs" in cast_problem("old_logprobs", pl.List(pl.String))
    assert cast_problem("loss_mask", pl.List(pl.Int8)) is not None
    assert cast_problem("prompt_len", pl.Float64) is not None
    assert cast_problem("unknown_extra", pl.String) is None


def test_atomic_write_cleans_up_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out" / "x.json"

    def fail(tmp: Path) -> None:
        tmp.write_text("partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        atomic_write(target, fail)
    assert not target.exists()
    assert os.listdir(target.parent) == []
    write_json({"b": 1, "a": [1, 2]}, target)
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}
    assert os.listdir(target.parent) == ["x.json"]


def test_write_parquet_zstd_statistics_metadata(tmp_path: Path) -> None:
    path = write_parquet(
        pl.DataFrame({"step": [0, 1, 2], "x": [[1.0], [2.0], [3.0]]}),
        tmp_path / "t.parquet",
        metadata={"schema": "pgdiag.report/v1", "n": 3},
        row_group_rows=2,
    )
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 2
    column = meta.row_group(0).column(0)
    assert column.compression == "ZSTD"
    assert column.statistics.min == 0 and column.statistics.max == 1
    assert decode_footer(meta.metadata) == {"schema": "pgdiag.report/v1", "n": 3}


def test_row_group_rows_rule() -> None:
    assert sequence_row_group_rows(1000, 1000 * 1024) == 128 * 1024
    assert sequence_row_group_rows(10, 10) == 1_048_576
    assert sequence_row_group_rows(0, 0) == 1


def _frame(steps: list[int]) -> pl.DataFrame:
    n = len(steps)
    return pl.DataFrame(
        {
            "step": steps,
            "sample_id": [f"s{i}" for i in range(n)][::-1],
            "group_id": ["g"] * n,
            "input_ids": [[1, 2, 3]] * n,
            "prompt_len": [1] * n,
            "loss_mask": [[False, True, True]] * n,
            "rollout_logprobs": [[None, -0.5, -1.0]] * n,
        },
        schema_overrides={"input_ids": pl.List(pl.Int64), "rollout_logprobs": pl.List(pl.Float64)},
    )


def test_write_rollouts_layout_types_and_order(tmp_path: Path) -> None:
    out = write_rollouts(
        _frame([1, 0, 1]),
        tmp_path / "run",
        label="demo",
        source=source_meta("tests"),
        streams_meta={"rollout": stream_meta("x", tempered=False, logprobs_mode="raw")},
    )
    parts = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet"))
    assert parts == ["rollouts/step=0/part-00000.parquet", "rollouts/step=1/part-00000.parquet"]
    table = pq.read_table(out / "rollouts/step=1/part-00000.parquet")
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("rollout_logprobs").type == pa.list_(pa.float32())
    assert pa.types.is_dictionary(table.schema.field("run").type)
    assert table.column("sample_id").to_pylist() == ["s0", "s2"]  # sorted by (step, group_id, sample_id)
    assert table.column("seq_hash").to_pylist() == [seq_hash([1, 2, 3])] * 2
    footer = decode_footer(table.schema.metadata)
    assert footer["schema"] == "pgdiag.rollouts/v1" and footer["alignment"] == "token"
    sidecar = json.loads((out / "pgdiag.json").read_text())
    assert sidecar["n_samples"] == 3 and sidecar["n_loss_tokens"] == 6 and sidecar["steps"] == [0, 1]
    with pytest.raises(UsageError) as exists:
        write_rollouts(_frame([0]), out, label="demo", source={}, streams_meta={})
    assert exists.value.code == "E502"


def test_write_rollouts_single_step_and_file(tmp_path: Path) -> None:
    out = write_rollouts(_frame([3, 3]), tmp_path / "run", label="demo", source={}, streams_meta={})
    assert [p.relative_to(out).as_posix() for p in out.rglob("*.parquet")] == ["rollouts/part-00000.parquet"]
    single = write_rollouts(
        _frame([0, 1]), tmp_path / "one.parquet", label="demo", source={}, streams_meta={}
    )
    assert pq.read_table(single).num_rows == 2


def test_write_rollouts_requires_columns(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError) as e102:
        write_rollouts(_frame([0]).drop("group_id"), tmp_path / "run", label="x", source={}, streams_meta={})
    assert e102.value.code == "E102" and "group_id" in e102.value.message
    assert not (tmp_path / "run").exists()


def test_write_rollouts_refuses_float32_overflow(tmp_path: Path) -> None:
    frame = _frame([0]).with_columns(pl.Series("rollout_logprobs", [[None, -3e38, -1.0]]))
    frame = frame.with_columns(pl.col("rollout_logprobs").list.eval(pl.element() * 2))
    with pytest.raises(InvalidInputError) as e103:
        write_rollouts(frame, tmp_path / "run", label="x", source={}, streams_meta={})
    assert e103.value.code == "E103" and "rollout_logprobs" in e103.value.message
    assert not (tmp_path / "run" / "pgdiag.json").exists()
