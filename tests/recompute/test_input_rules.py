"""`pgdiag logprobs` reads and checks the rollouts with the rules every other command runs (docs/recompute.md).

Before, it had checks of its own and accepted float token ids (truncated), string steps, duplicate rows and a
wrong seq_hash, and a run whose files mix int32 and int64 input_ids exited 101. Each case here failed then.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_logprobs import make_checkpoint, make_rows, read_stream, write_run
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.recompute.jobs import recompute_logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(directory)
    return directory


def logprobs_cli(run: Path, ckpt: Path, *extra: str):
    args = ["logprobs", str(run), "--model", str(ckpt), "--device", "cpu", "--dtype", "fp32", *extra]
    return CliRunner().invoke(build_app(), args)


def rewrite_column(path: Path, name: str, values: pa.Array) -> None:
    """Replace column `name` of the Parquet file `path` by `values`, keeping the footer."""
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table.replace_schema_metadata(table.schema.metadata), path)


def one_error_line(result, code: str) -> str:
    """The error line of a refused command, after asserting the contract: one line, exit 3, no traceback."""
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error[")]
    assert len(lines) == 1 and lines[0].startswith(f"error[{code}] "), result.output
    return lines[0]


@pytest.mark.parametrize("defect", ["float_ids", "string_steps", "duplicate_row", "wrong_seq_hash"])
def test_rows_other_commands_refuse_are_refused_before_anything_is_written(
    defect: str, ckpt: Path, tmp_path: Path
) -> None:
    rows = make_rows(seed=4, n_steps=1, groups=1, per_group=3)
    if defect == "duplicate_row":
        rows.append(dict(rows[1]))
    if defect == "wrong_seq_hash":
        rows[1]["seq_hash"] = 12345
    run = write_run(tmp_path / "run", rows)
    path = run / "rollouts" / "part-00000.parquet"
    table = pq.read_table(path)
    if defect == "float_ids":  # 41.5 was read as token 41
        ids = [[t + 0.5 for t in row] for row in table["input_ids"].to_pylist()]
        rewrite_column(path, "input_ids", pa.array(ids, type=pa.list_(pa.float64())))
    if defect == "string_steps":
        rewrite_column(path, "step", pa.array([str(s) for s in table["step"].to_pylist()]))
    codes = {"float_ids": "E103", "string_steps": "E103", "duplicate_row": "E210", "wrong_seq_hash": "E212"}
    line = one_error_line(logprobs_cli(run, ckpt), codes[defect])
    assert str(path) in line
    if defect == "float_ids":
        assert "input_ids: type List(Float64) cannot be cast losslessly" in line
    if defect == "string_steps":
        assert "step: type String cannot be cast losslessly" in line
    if defect in ("duplicate_row", "wrong_seq_hash"):
        assert f"sample {rows[1]['sample_id']}" in line
    assert not (run / "logprobs").exists()
    # the same rule, the same line: `check` reports it too
    check = CliRunner().invoke(build_app(), ["check", str(run)])
    assert line in check.output


def test_files_mixing_int32_and_int64_ids_are_widened_losslessly(ckpt: Path, tmp_path: Path) -> None:
    rows = make_rows(seed=6, n_steps=2, groups=1, per_group=3)
    one_file = write_run(tmp_path / "one", rows)
    table = pq.read_table(one_file / "rollouts" / "part-00000.parquet")
    split = tmp_path / "split"
    for step, width in ((0, pa.int32()), (1, pa.int64())):
        part = table.filter(pc.equal(table["step"], step))
        ids = part["input_ids"].cast(pa.list_(width))
        part = part.set_column(part.schema.get_field_index("input_ids"), "input_ids", ids)
        (split / "rollouts" / f"step={step}").mkdir(parents=True)
        pq.write_table(
            part.replace_schema_metadata(table.schema.metadata),
            split / "rollouts" / f"step={step}" / "part-00000.parquet",
        )
    result = logprobs_cli(split, ckpt, "-q")
    assert result.exit_code == 0, result.output  # was exit 101 (polars SchemaError)
    check = CliRunner().invoke(build_app(), ["check", str(split)])
    assert check.exit_code == 0, check.output  # was E103
    reference = recompute_logprobs(one_file, ckpt, dtype="fp32", device="cpu")
    a, b = read_stream(reference.path), read_stream(split / "logprobs" / "rc_fp32_fp32")
    assert a.height == len(rows) and a["sample_id"].to_list() == b["sample_id"].to_list()
    x = np.array(a["logprobs"].explode().fill_null(np.nan).to_list(), dtype=float)
    y = np.array(b["logprobs"].explode().fill_null(np.nan).to_list(), dtype=float)
    assert np.array_equal(x, y, equal_nan=True) and np.isfinite(x).sum() > 50
