"""A `step` column that is not an integer, read step by step: every command gives the whole read's E103
(check reports it, the others raise it).

Reading in pieces filters the scan by step (`restrict_steps`); polars cannot compare a string or float column
with integer steps, so such a run is read whole, where the reader names the file and the column."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sample_paths import SAMPLE_DATA

import pgdiag
from pgdiag.checks.run import check_run
from pgdiag.compare.api import compare_runs
from pgdiag.compare.nway import compare_many
from pgdiag.compare.settings import CompareSettings
from pgdiag.errors import InvalidInputError
from pgdiag.metrics.api import StreamSettings

SAMPLES = SAMPLE_DATA


def _with_step_type(tmp_path: Path, name: str, step_type: pa.DataType) -> Path:
    """A copy of sample run_a whose `step` column is stored as `step_type` in every file."""
    root = tmp_path / name
    shutil.copytree(SAMPLES / "run_a", root)
    for path in sorted(root.glob("rollouts/step=*/*.parquet")):
        table = pq.read_table(path)
        index = table.schema.get_field_index("step")
        column = table.column("step").cast(step_type)
        table = table.set_column(index, pa.field("step", step_type), column)
        pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path)
    return root


PIECES = CompareSettings(chunk_rows=1)  # one step per piece: the run would be read in pieces


@pytest.mark.parametrize("step_type", [pa.string(), pa.float64()], ids=["string", "float64"])
@pytest.mark.parametrize(
    "command",
    ["check", "check-two", "metrics", "compare-one", "compare-two", "compare-hash-any-step", "compare-nway"],
)
def test_a_step_column_of_another_type_is_e103_naming_file_and_column(
    tmp_path: Path, step_type: pa.DataType, command: str
) -> None:
    bad = pgdiag.read_run(_with_step_type(tmp_path, "bad", step_type))
    good = pgdiag.read_run(SAMPLES / "run_b")
    calls: dict[str, Callable[[], Any]] = {
        "check": lambda: check_run(bad, chunk_rows=1),
        "check-two": lambda: check_run(good, bad, chunk_rows=1),
        "metrics": lambda: pgdiag.compute_metrics(bad, stream=StreamSettings(max_rows=1)),
        "compare-one": lambda: compare_runs(bad, None, PIECES),
        "compare-two": lambda: compare_runs(good, bad, PIECES),
        "compare-hash-any-step": lambda: compare_runs(
            bad, good, CompareSettings(chunk_rows=1, join="hash-any-step")
        ),
        "compare-nway": lambda: compare_many([good, bad, good], PIECES),
    }
    if command.startswith("check"):  # check reports what it finds instead of raising
        found = [i for i in calls[command]().found if i.code == "E103"]
        assert len(found) == 1 and found[0].severity == "error"
        code, message = found[0].code, found[0].message
    else:
        with pytest.raises(InvalidInputError) as caught:
            calls[command]()
        code, message = caught.value.code, str(caught.value)
    assert code == "E103"
    assert "step" in message and "bad/rollouts/step=" in message and "\n" not in message
