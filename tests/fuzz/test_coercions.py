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

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data"


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
