"""An instrumented reader: `compare RUN_A` (two streams of one run) reads each step file of the run once.

Every read of a run's token columns goes through `pgdiag.data.load.load_rows` (one polars collect of the files
of its piece: all of them for a whole read, the ``step=N/`` files of its steps for a piece). The test wraps it,
records the files each call reads, and checks that every step file was read exactly once: by the CLI (one
piece), by the library in pieces of one step, and with `--metrics` (the run's own metric set fed from the same
pieces).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

import pgdiag.data.load
from pgdiag.cli.app import build_app
from pgdiag.compare.api import compare_runs
from pgdiag.compare.settings import CompareSettings
from pgdiag.data.runs import read_run
from pgdiag.metrics.settings import MetricSettings

RUN_A = SAMPLE_DATA / "run_a"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How many times `load_rows` read each rollouts file."""
    counts: Counter = Counter()
    load_rows = pgdiag.data.load.load_rows

    def counting(run, **kwargs):  # type: ignore[no-untyped-def]
        for path in run.paths:
            step = int(Path(path).parent.name.removeprefix("step="))
            if run.step_subset is None or step in run.step_subset:
                counts[Path(path).resolve()] += 1
        return load_rows(run, **kwargs)

    monkeypatch.setattr(pgdiag.data.load, "load_rows", counting)
    return counts


def _step_files() -> set[Path]:
    return {p.resolve() for p in (RUN_A / "rollouts").glob("step=*/*.parquet")}


def test_compare_one_run_cli_reads_each_step_file_once(opened: Counter) -> None:
    result = CliRunner().invoke(build_app(), ["compare", str(RUN_A), "--json", "-q"])
    assert result.exit_code in (0, 1), result.output
    assert len(_step_files()) == 4 and dict(opened) == dict.fromkeys(_step_files(), 1)


@pytest.mark.parametrize("metrics", [None, MetricSettings()], ids=["parity", "with-metrics"])
def test_compare_one_run_in_pieces_reads_each_step_file_once(opened: Counter, metrics) -> None:
    comparison = compare_runs(read_run(RUN_A), None, CompareSettings(chunk_rows=1, metrics=metrics))
    assert comparison.pair is None  # read in pieces (4 steps of 32 samples)
    assert dict(opened) == dict.fromkeys(_step_files(), 1)
