"""Hypothesis-driven malformed inputs for every reading command and the Python API (docs/reliability.md).

Each example damages a valid run (a footer entry replaced by JSON of any shape, a column's type changed, the
file's bytes truncated or overwritten) and asserts the clean-error contract: exit 0/1, or one
``error[CODE]`` line with the code's exit code, no traceback, no ``internal error``, nothing written to
``--out``; through the API, success or a `PgdiagError`, never another exception. Examples per test: 4 by
default, 400 with ``pytest --slow``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from clean_error import error_code, files_under, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import rollouts_frame, valid_rows, write_rollouts_file

import pgdiag
from pgdiag.errors import PgdiagError

FOOTER_KEYS = ("schema", "alignment", "source", "streams", "sampling", "tokenizer", "model", "import")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
COLUMN_TYPES = {
    "step": (pl.UInt64, pl.String, pl.Float64, pl.Int8),
    "seq_hash": (pl.Int64, pl.String, pl.Float64),
    "input_ids": (pl.List(pl.Int64), pl.List(pl.Float64), pl.List(pl.String), pl.String),
    "prompt_len": (pl.Float64, pl.String, pl.UInt8),
    "loss_mask": (pl.List(pl.Int8), pl.List(pl.String), pl.String),
    "old_logprobs": (pl.List(pl.Float64), pl.List(pl.String), pl.String, pl.Float32),
    "sample_id": (pl.Int64, pl.Categorical),
}
COMMANDS = (
    ("check",),
    ("metrics", "--new", "old", "--old", "rollout", "--out", "{out}", "--overwrite"),
)


def fuzz_settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def assert_contract(run: Path, out: Path) -> None:
    """Every command on `run`: exit 0/1, or the clean-error contract; a refused command writes nothing."""
    for command in COMMANDS:
        shutil.rmtree(
            out, ignore_errors=True
        )  # hypothesis reuses tmp_path: each example starts with no output
        result = run_cli([command[0], run, *(str(out) if a == "{out}" else a for a in command[1:])])
        if result.exit_code in (0, 1):
            continue
        error_code(result, check=command[0] == "check")
        assert files_under(out) == set(), result.output
    try:
        run_obj = pgdiag.read_run(run)
        pgdiag.check_run(run_obj)
    except PgdiagError:
        pass


def test_footer_of_any_json_shape(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(key=st.sampled_from(FOOTER_KEYS), value=JSON_VALUES)
    def case(key: str, value: object) -> None:
        run = write_rollouts_file(tmp_path / "run.parquet", valid_rows(), **{key: value})
        assert_contract(run, tmp_path / "out")

    case()


def test_column_of_another_type(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(column=st.sampled_from(sorted(COLUMN_TYPES)), data=st.data())
    def case(column: str, data: st.DataObject) -> None:
        dtype = data.draw(st.sampled_from(COLUMN_TYPES[column]))
        frame = rollouts_frame(valid_rows())  # seq_hash computed from the canonical ids, before the cast
        try:
            cast = frame.with_columns(pl.col(column).cast(dtype, strict=False))
        except pl.exceptions.PolarsError:
            return  # polars cannot even build this file
        rows = cast.to_dicts()
        run = write_rollouts_file(tmp_path / "run.parquet", rows, raw_types={column: dtype})
        assert_contract(run, tmp_path / "out")

    case()


def test_damaged_bytes(tmp_path: Path, fuzz_examples: int) -> None:
    good = write_rollouts_file(tmp_path / "good.parquet", valid_rows()).read_bytes()

    @fuzz_settings(fuzz_examples)
    @given(
        cut=st.integers(0, len(good)), noise=st.binary(min_size=0, max_size=64), at=st.integers(0, len(good))
    )
    def case(cut: int, noise: bytes, at: int) -> None:
        damaged = bytearray(good[:cut] if cut < len(good) - 8 else good)
        damaged[at : at + len(noise)] = noise
        run = tmp_path / "run.parquet"
        run.write_bytes(bytes(damaged))
        assert_contract(run, tmp_path / "out")

    case()


@pytest.mark.parametrize(
    "content",
    [b"", b"PAR1", b"[1, 2]", json.dumps({"schema": "x"}).encode(), b"\x00" * 4096],
)
def test_corpus_of_non_parquet_files(tmp_path: Path, content: bytes) -> None:
    run = tmp_path / "run.parquet"
    run.write_bytes(content)
    assert_contract(run, tmp_path / "out")
