"""Generators the fuzz suite lacked before issue 22 (docs/reliability.md): data columns whose names collide with
the reader's own, per-token metadata of the wrong length, non-finite metadata, and option values of the wrong
sign. Each example asserts the clean-error contract (exit 0/1, or one ``error[CODE]`` line with its exit code)
and, where the input is invalid, the documented code."""

from __future__ import annotations

from pathlib import Path

import pytest
from clean_error import error_code, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import valid_rows, write_rollouts_file
from sample_paths import SAMPLE_DATA

import pgdiag
from pgdiag.cli import run
from pgdiag.data.runs import FILE_COLUMN
from pgdiag.errors import PgdiagError

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RUN = str(SAMPLE_DATA / "run_a")


def fuzz_settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def test_columns_named_like_the_readers_own(tmp_path: Path, fuzz_examples: int) -> None:
    # the reader adds its own columns (the file path); a data column of that name, of any type, is ignored
    @fuzz_settings(fuzz_examples)
    @given(
        name=st.sampled_from((FILE_COLUMN, "__index_level_0__", "file", "__FILE")),
        value=st.none() | st.integers(-5, 5) | st.text(max_size=8) | st.floats(allow_nan=True),
    )
    def case(name: str, value: object) -> None:
        rows = valid_rows()
        for row in rows:
            row[name] = value
        try:
            run = write_rollouts_file(tmp_path / "run.parquet", rows)
        except Exception:
            return
        result = run_cli(["check", run])
        assert result.exit_code == 0, result.output
        assert pgdiag.check_run(pgdiag.read_run(run)).exit_code == 0

    case()


WRONG_SIGN = (  # (command line, option): every one must be >= 0 (or > 0)
    (["metrics", SAMPLE_RUN], "--identity-tol"),
    (["metrics", SAMPLE_RUN], "--zero-std-atol"),
    (["metrics", SAMPLE_RUN], "--divisor"),
    (["metrics", SAMPLE_RUN], "--eps-low"),
    (["metrics", SAMPLE_RUN], "--eps-high"),
    (["metrics", SAMPLE_RUN], "--docs-per-step"),
    (["compare", SAMPLE_RUN, SAMPLE_RUN], "--worst-k"),
    (["drift", SAMPLE_RUN, "--new", "new"], "--cp-threshold"),
    (["whatif", SAMPLE_RUN], "--divisor"),
    (["check", SAMPLE_RUN], "--max-examples"),
    (["import", "--preset", "canonical", SAMPLE_RUN, "{out}"], "--temperature"),
    (["import", "--preset", "canonical", SAMPLE_RUN, "{out}"], "--top-p"),
    (["import", "--preset", "canonical", SAMPLE_RUN, "{out}"], "--min-p"),
)


def test_option_values_of_the_wrong_sign(
    tmp_path: Path, fuzz_examples: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # through `pgdiag.cli.run`, the console script's entry: Typer's own range checks become E503 there too
    @fuzz_settings(fuzz_examples * 3)
    @given(
        case_index=st.integers(0, len(WRONG_SIGN) - 1),
        value=st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False) | st.just(float("-inf")),
    )
    def case(case_index: int, value: float) -> None:
        command, option = WRONG_SIGN[case_index]
        if option in ("--docs-per-step", "--worst-k", "--max-examples"):
            text = str(int(max(min(value, -1), -1e18)))
        else:
            text = repr(value)
        out = tmp_path / "out"
        args = [str(out) if a == "{out}" else a for a in command]
        capsys.readouterr()
        exit_code = run([*args, option, text])
        output = capsys.readouterr().err
        lines = output.splitlines()
        assert exit_code == 2 and len(lines) in (1, 2), output
        assert lines[0].startswith("error[E503] "), output
        assert not out.exists()

    case()


def test_per_token_metadata_of_the_wrong_length(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples * 2)
    @given(
        column=st.sampled_from(("temperature_tok", "policy_version_tok")),
        length=st.integers(0, 12).filter(lambda n: n != 6),
    )
    def case(column: str, length: int) -> None:
        rows = valid_rows()  # row 0: 6 tokens
        for row in rows:
            n = len(row["input_ids"])
            row[column] = [0.7 if column == "temperature_tok" else 3] * n
        rows[0][column] = rows[0][column][:1] * length
        run = write_rollouts_file(tmp_path / "run.parquet", rows, raw_types=_raw(column))
        assert error_code(run_cli(["check", run]), check=True) == "E201"
        try:
            issues = pgdiag.check_run(pgdiag.read_run(run)).issues
        except PgdiagError:
            return
        assert "E201" in issues["code"].to_list()

    case()


def test_non_finite_metadata(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples * 2)
    @given(
        column=st.sampled_from(("temperature", "temperature_tok", "reward", "advantage")),
        value=st.sampled_from((float("nan"), float("inf"), float("-inf"))),
    )
    def case(column: str, value: float) -> None:
        rows = valid_rows()
        for row in rows:
            n = len(row["input_ids"])
            row[column] = [0.7] * n if column == "temperature_tok" else 0.5
        if column == "temperature_tok":
            rows[1][column][3] = value
        else:
            rows[1][column] = value
        run = write_rollouts_file(tmp_path / "run.parquet", rows, raw_types=_raw(column))
        code = error_code(run_cli(["check", run]), check=True)
        assert code in ("E207", "E219"), code

    case()


def _raw(column: str) -> dict:
    import polars as pl

    return {"policy_version_tok": pl.List(pl.Int64)} if column == "policy_version_tok" else {}
