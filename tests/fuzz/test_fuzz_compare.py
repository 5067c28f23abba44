"""Malformed runs for `pgdiag compare` (docs/reliability.md): one side damaged as the other fuzz tests damage a
run (a footer entry of any JSON shape, a column of another type), and two sides that are each valid but do not
fit together (rows dropped, ids, steps, tokens, masks or log-probs changed on one side).

Contract: exit 0/1, or one ``error[CODE]`` line with the code's exit code, no traceback, no ``internal error``,
nothing written to ``--out``; through the API (`compare_runs`, also read step by step with `--metrics` and a token
table), a report or a `PgdiagError` and no token table. Examples per test:
4 by default, 400 with ``pytest --slow``.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path

import polars as pl
from clean_error import error_code, files_under, run_cli
from hypothesis import given
from hypothesis import strategies as st
from rollout_factory import rollouts_frame, valid_rows, write_rollouts_file
from test_fuzz_inputs import COLUMN_TYPES, FOOTER_KEYS, JSON_VALUES, fuzz_settings

import pgdiag
from pgdiag.errors import PgdiagError


def assert_compare_contract(run_a: Path, run_b: Path, out: Path) -> None:
    """compare in both orders (with --out) and through the API: exit 0/1, or the clean-error contract."""
    for first, second in ((run_a, run_b), (run_b, run_a)):
        shutil.rmtree(out, ignore_errors=True)
        result = run_cli(["compare", first, second, "--out", out, "--overwrite"])
        if result.exit_code in (0, 1):
            continue
        error_code(result)
        assert files_under(out) == set(), result.output
    with contextlib.suppress(PgdiagError):
        pgdiag.compare_runs(pgdiag.read_run(run_a), pgdiag.read_run(run_b))
    # read step by step (a piece per step), with the token table and each run's own metrics: the same contract,
    # and no token table (nor its temp file) after an error
    tokens = out.parent / "api_tokens"
    shutil.rmtree(tokens, ignore_errors=True)
    try:
        pgdiag.compare_runs(
            pgdiag.read_run(run_a),
            pgdiag.read_run(run_b),
            metrics=pgdiag.MetricSettings(),
            tokens_out=tokens / "t.parquet",
            chunk_rows=1,
        )
    except PgdiagError:
        assert files_under(tokens) == set()


def test_compare_side_with_footer_of_any_shape(tmp_path: Path, fuzz_examples: int) -> None:
    good = write_rollouts_file(tmp_path / "good.parquet", valid_rows())

    @fuzz_settings(fuzz_examples)
    @given(key=st.sampled_from(FOOTER_KEYS), value=JSON_VALUES)
    def case(key: str, value: object) -> None:
        bad = write_rollouts_file(tmp_path / "bad.parquet", valid_rows(), **{key: value})
        assert_compare_contract(good, bad, tmp_path / "out")

    case()


def test_compare_side_with_a_column_of_another_type(tmp_path: Path, fuzz_examples: int) -> None:
    good = write_rollouts_file(tmp_path / "good.parquet", valid_rows())

    @fuzz_settings(fuzz_examples)
    @given(column=st.sampled_from(sorted(COLUMN_TYPES)), data=st.data())
    def case(column: str, data: st.DataObject) -> None:
        dtype = data.draw(st.sampled_from(COLUMN_TYPES[column]))
        try:
            frame = rollouts_frame(valid_rows())  # seq_hash computed from the canonical ids, before the cast
            rows = frame.with_columns(pl.col(column).cast(dtype, strict=False)).to_dicts()
        except pl.exceptions.PolarsError:
            return  # polars cannot even build this file
        bad = write_rollouts_file(tmp_path / "bad.parquet", rows, raw_types={column: dtype})
        assert_compare_contract(good, bad, tmp_path / "out")

    case()


def _drop(rows: list[dict], index: int, value: object) -> None:
    del rows[index % len(rows)]


def _set(field: str):
    def change(rows: list[dict], index: int, value: object) -> None:
        rows[index % len(rows)][field] = value

    return change


def _token(field: str):
    def change(rows: list[dict], index: int, value: object) -> None:
        row = rows[index % len(rows)]
        values = list(row[field])
        values[(index // len(rows)) % len(values)] = value
        row[field] = values
        row.pop("seq_hash", None)

    return change


ROW_CHANGES = {
    "drop a row": (_drop, st.none()),
    "sample_id": (_set("sample_id"), st.sampled_from(["0:0", "1:1", "x", "", "0:0\n"])),
    "step": (_set("step"), st.integers(-3, 3)),
    "group_id": (_set("group_id"), st.sampled_from(["g0", "g1", "", None])),
    "prompt_len": (_set("prompt_len"), st.integers(-1, 7)),
    "input_ids token": (_token("input_ids"), st.integers(-1, 40)),
    "loss_mask position": (_token("loss_mask"), st.booleans()),
    "old log-prob": (_token("old_logprobs"), st.none() | st.floats(-1e6, 1.0) | st.just(float("nan"))),
    "rollout log-prob": (
        _token("rollout_logprobs"),
        st.none() | st.floats(allow_nan=True, allow_infinity=True),
    ),
    "advantage": (_token("advantages"), st.none() | st.floats(allow_nan=True)),
}


def test_compare_sides_that_do_not_fit(tmp_path: Path, fuzz_examples: int) -> None:
    good = write_rollouts_file(tmp_path / "good.parquet", valid_rows())

    @fuzz_settings(fuzz_examples)
    @given(
        changes=st.lists(
            st.sampled_from(sorted(ROW_CHANGES)).flatmap(
                lambda name: st.tuples(st.just(name), st.integers(0, 15), ROW_CHANGES[name][1])
            ),
            min_size=1,
            max_size=3,
        )
    )
    def case(changes: list[tuple[str, int, object]]) -> None:
        rows = copy.deepcopy(valid_rows())
        for name, index, value in changes:
            if rows:
                ROW_CHANGES[name][0](rows, index, value)
        if not rows:
            return
        bad = write_rollouts_file(tmp_path / "bad.parquet", rows)
        assert_compare_contract(good, bad, tmp_path / "out")

    case()
