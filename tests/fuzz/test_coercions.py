"""The reader's safe coercions (docs/schema.md, "Coercions when reading"), each on a file written by pyarrow with
that exact Arrow type, run through `check`, `metrics` and `compare`: the values equal those of the same rows
written with the canonical types. The unsafe ones are one E103 line naming the file and the column.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from clean_error import error_code, run_cli
from sample_paths import SAMPLE_DATA

SAMPLE = SAMPLE_DATA


def _sample_table() -> pa.Table:
    """Every step of sample_data/run_a in one table, with its footer."""
    parts = sorted((SAMPLE / "run_a" / "rollouts").rglob("*.parquet"))
    tables = [pq.read_table(p) for p in parts]
    return pa.concat_tables(tables).replace_schema_metadata(tables[0].schema.metadata)


def _retyped(table: pa.Table, column: str, arrow_type: pa.DataType) -> pa.Table:
    index = table.schema.get_field_index(column)
    return table.set_column(index, pa.field(column, arrow_type), table.column(column).cast(arrow_type))


def _signed_seq_hash(table: pa.Table) -> pa.Table:
    """seq_hash as int64 holding the same 64 bits (hashes >= 2^63 become negative)."""
    signed = pc.cast(table.column("seq_hash"), pa.int64(), safe=False)
    assert pc.any(pc.less(signed, 0)).as_py()  # the sample has hashes above 2^63: the bits matter
    return table.set_column(table.schema.get_field_index("seq_hash"), "seq_hash", signed)


COERCIONS: dict[str, Callable[[pa.Table], pa.Table]] = {
    **{
        f"step {t}": (lambda table, t=t: _retyped(table, "step", t))
        for t in (pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64())
    },
    "seq_hash int64": _signed_seq_hash,
    **{
        f"{c} large_list": (
            lambda table, c=c: _retyped(table, c, pa.large_list(table.schema.field(c).type.value_type))
        )
        for c in ("input_ids", "loss_mask", "old_logprobs", "advantages")
    },
    **{
        f"{c} large_string": (lambda table, c=c: _retyped(table, c, pa.large_string()))
        for c in ("sample_id", "group_id", "env", "run")
    },
    **{
        f"{c} dictionary": (lambda table, c=c: _retyped(table, c, pa.dictionary(pa.int16(), pa.string())))
        for c in ("sample_id", "group_id", "env", "run")
    },
    "group_id dictionary of large_string": lambda table: _retyped(
        table, "group_id", pa.dictionary(pa.int8(), pa.large_string())
    ),
}


def _results(path: Path) -> dict[str, object]:
    """What check, metrics and compare (against run_b) say about `path`: exit codes and the JSON summaries."""
    out: dict[str, object] = {}
    check = run_cli(["check", path, "--json"])
    out["check"] = (check.exit_code, json.loads(check.output.strip().splitlines()[-1])["checks"])
    for name, args in (("metrics", ["metrics", path]), ("compare", ["compare", path, SAMPLE / "run_b"])):
        result = run_cli([*args, "--json"])
        assert result.exit_code == 0, result.output
        out[name] = json.loads(result.output.strip().splitlines()[-1])["summary"]
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = tmp_path_factory.mktemp("plain") / "run.parquet"
    pq.write_table(_sample_table(), path)
    results = _results(path)
    assert results["check"][0] == 0
    return results


@pytest.mark.parametrize("coercion", sorted(COERCIONS))
def test_safe_coercion_reads_the_same_values(tmp_path: Path, plain: dict[str, object], coercion: str) -> None:
    table = COERCIONS[coercion](_sample_table())
    path = tmp_path / "run.parquet"
    pq.write_table(table, path)
    column = coercion.split()[0]
    written = pq.read_schema(path).field(column).type
    assert written != _sample_table().schema.field(column).type
    assert _results(path) == plain


@pytest.mark.parametrize(
    ("column", "values", "arrow_type", "said"),
    [
        (
            "step",
            lambda n: [2**63 + i for i in range(n)],
            pa.uint64(),
            "uint64 value 9223372036854775808 does not fit int64",
        ),
        (
            "sample_id",
            lambda n: [i + 0.5 for i in range(n)],
            pa.float64(),
            "sample_id: type Float64 cannot be cast",
        ),
        (
            "group_id",
            lambda n: [float(i) for i in range(n)],
            pa.float64(),
            "group_id: type Float64 cannot be cast",
        ),
        (
            "seq_hash",
            lambda n: [float(i) for i in range(n)],
            pa.float64(),
            "seq_hash: type Float64 cannot be cast",
        ),
    ],
)
def test_unsafe_type_is_e103_naming_file_and_column(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, column: str, values, arrow_type, said: str
) -> None:
    table = _sample_table()
    table = table.set_column(
        table.schema.get_field_index(column),
        pa.field(column, arrow_type),
        pa.array(values(table.num_rows), arrow_type),
    )
    path = tmp_path / "run.parquet"
    pq.write_table(table, path)
    monkeypatch.setenv(
        "COLUMNS", "1000"
    )  # check's verdict line (not an error line) wraps at the terminal width
    for args in (
        ["check", path],
        ["metrics", path],
        ["compare", path, SAMPLE / "run_b"],
        ["compare", SAMPLE / "run_b", path],
    ):
        result = run_cli(args)
        assert error_code(result, check=args[0] == "check") == "E103", result.output
        assert str(path) in result.output and said in result.output, result.output


def _equal_length_run(path: Path) -> Path:
    """A run whose samples all have 8 tokens (so every list column fits a fixed-size list), written canonically."""
    import numpy as np
    import polars as pl

    from pgdiag.data.writing import source_meta, stream_meta, write_rollouts

    rng = np.random.default_rng(0)
    n, length = 12, 8
    rows = pl.DataFrame(
        {
            "step": np.repeat([0, 1, 2], 4),
            "sample_id": [f"s{i}" for i in range(n)],
            "group_id": [f"g{i // 4}" for i in range(n)],
            "prompt_len": [2] * n,
            "input_ids": rng.integers(0, 50, (n, length)).tolist(),
            "loss_mask": [[False, False] + [True] * (length - 2)] * n,
            "rollout_logprobs": [[None, None, *(-rng.random(length - 2)).tolist()] for _ in range(n)],
            "old_logprobs": [[None, None, *(-rng.random(length - 2) - 0.01).tolist()] for _ in range(n)],
        }
    )
    streams = {"rollout": stream_meta("rollout"), "old": stream_meta("old")}
    return write_rollouts(rows, path, label="r", source=source_meta("tests"), streams_meta=streams)


def _fixed_size(table: pa.Table) -> pa.Table:
    """Every list column of `table` as a fixed-size list (a polars `Array`) of the same values."""
    for column in ("input_ids", "loss_mask", "rollout_logprobs", "old_logprobs"):
        field = table.schema.field(column)
        table = _retyped(table, column, pa.list_(field.type.value_type, 8))
    return table


def _json_summaries(path: Path, other: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, args in (
        ("check", ["check", path]),
        ("metrics", ["metrics", path, "--new", "old", "--old", "rollout"]),
        ("compare", ["compare", path, other]),
        ("compare reversed", ["compare", other, path]),
    ):
        result = run_cli([*args, "--json"])
        assert result.exit_code in (0, 1), result.output
        found = json.loads(result.output.strip().splitlines()[-1])
        out[name] = (result.exit_code, found["checks"] if name == "check" else found["summary"])
    return out


def test_fixed_size_list_columns_read_as_lists(tmp_path: Path) -> None:
    """A run whose list columns are fixed-size lists (polars `Array`): check, metrics and compare read the same
    values as from the list columns (it exited 101 in `pgdiag import` and `write_rollouts`)."""
    plain = _equal_length_run(tmp_path / "plain.parquet")
    fixed = tmp_path / "fixed.parquet"
    pq.write_table(_fixed_size(pq.read_table(plain)), fixed)
    assert pa.types.is_fixed_size_list(pq.read_schema(fixed).field("input_ids").type)
    assert _json_summaries(fixed, plain) == _json_summaries(plain, plain)


def test_fixed_size_array_columns_are_imported_and_written(tmp_path: Path) -> None:
    """`write_rollouts` (API) and `pgdiag import --preset canonical` (CLI) take `Array` columns as lists."""
    import polars as pl

    from pgdiag.data.runs import read_run
    from pgdiag.data.writing import source_meta, write_rollouts

    plain = pl.read_parquet(_equal_length_run(tmp_path / "plain.parquet"))
    fixed = plain.with_columns(
        pl.col(c).cast(pl.Array(plain.schema[c].inner, 8))
        for c in ("input_ids", "loss_mask", "rollout_logprobs", "old_logprobs")
    )
    written = write_rollouts(
        fixed.drop("seq_hash"), tmp_path / "api", label="r", source=source_meta("tests"), streams_meta={}
    )
    read = read_run(written).collect(["input_ids", "loss_mask", "old_logprobs"])
    assert read.schema["input_ids"] == pl.List(pl.Int32)
    assert read.equals(plain.select("input_ids", "loss_mask", "old_logprobs"))
    source = tmp_path / "source.parquet"
    fixed.drop("seq_hash", "run").write_parquet(source)
    result = run_cli(["import", "--preset", "canonical", source, tmp_path / "cli"])
    assert result.exit_code == 0, result.output
    imported = (
        read_run(tmp_path / "cli").collect(["sample_id", "input_ids", "old_logprobs"]).sort("sample_id")
    )
    assert imported.equals(plain.select("sample_id", "input_ids", "old_logprobs").sort("sample_id"))


def test_logprobs_reads_fixed_size_list_columns(tmp_path: Path) -> None:
    """`pgdiag logprobs` on a run of fixed-size list columns recomputes the values it gives on list columns."""
    import polars as pl

    plain = _equal_length_run(tmp_path / "plain.parquet")
    fixed = tmp_path / "fixed.parquet"
    pq.write_table(_fixed_size(pq.read_table(plain)), fixed)
    tiny = SAMPLE / "tiny-qwen"
    values = []
    for run in (plain, fixed):
        out = tmp_path / f"out-{run.stem}"
        args = ["logprobs", run, "--model", tiny, "--device", "cpu", "--dtype", "fp32", "-q", "--out", out]
        result = run_cli(args)
        assert result.exit_code == 0, result.output
        parts = sorted(out.rglob("*.parquet"))
        values.append(pl.concat([pl.read_parquet(p) for p in parts]).sort("step", "sample_id"))
    assert values[0].height == 12 and values[0].equals(values[1])
