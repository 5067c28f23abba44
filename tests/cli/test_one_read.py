"""Each command reads each run's rollouts once: the Parquet scans that polars collects are counted per run.

`metrics`, `check` and `compare` read a run in chunks of whole steps: they first scan the `step` column alone (one
projected column: rows per step, then null steps) to plan the chunks, then read each chunk;
sample_data's runs fit one chunk. Scans of one column are counted apart.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.cli.app import build_app

SAMPLE_DATA = SAMPLE_DATA
RUN_A, RUN_B = SAMPLE_DATA / "run_a", SAMPLE_DATA / "run_b"


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, Counter]:
    """(scans reading the rollouts, scans of one column) per run directory."""
    counted, one_column = Counter(), Counter()
    collect = pl.LazyFrame.collect

    def counting_collect(self: pl.LazyFrame, *args, **kwargs):  # type: ignore[no-untyped-def]
        plan = self.explain()
        for source, projected in re.findall(r"Parquet SCAN \[([^,\]]+)[^\n]*(?:\n\s*PROJECT (\d+)/)?", plan):
            for run in (RUN_A, RUN_B):
                if Path(source).resolve().is_relative_to(run):
                    (one_column if projected == "1" else counted)[run.name] += 1
        return collect(self, *args, **kwargs)

    monkeypatch.setattr(pl.LazyFrame, "collect", counting_collect)
    return counted, one_column


@pytest.mark.parametrize(
    ("args", "runs"),
    [
        (("check", RUN_A, RUN_B), ("run_a", "run_b")),
        (("metrics", RUN_A), ("run_a",)),
        (("compare", RUN_A, RUN_B), ("run_a", "run_b")),
        (("compare", RUN_A, RUN_B, "--metrics"), ("run_a", "run_b")),
        (("compare", RUN_A, "--metrics"), ("run_a",)),
    ],
    ids=["check", "metrics", "compare", "compare-metrics", "compare-one-run-metrics"],
)
def test_each_run_is_read_once(scans: tuple[Counter, Counter], args: tuple, runs: tuple) -> None:
    result = CliRunner().invoke(build_app(), [str(a) for a in args])
    assert result.exit_code in (0, 1), result.output
    reads, step_scans = scans
    assert dict(reads) == dict.fromkeys(runs, 1)
    # metrics, check and compare (--metrics too) plan their chunks from the step column: rows per step, and null
    # steps (no chunk holds those)
    assert dict(step_scans) == dict.fromkeys(runs, 2)


@pytest.mark.parametrize("one_run", [False, True], ids=["two-runs", "one-run"])
def test_compare_metrics_read_step_by_step_reads_each_piece_once(
    scans: tuple[Counter, Counter], one_run: bool
) -> None:
    """compare --metrics in pieces of one step (4 steps of 32 rows per run): each piece of each run is read once,
    its batch feeding both the parity pieces and the side-by-side metrics."""
    from pgdiag.compare.api import compare_runs
    from pgdiag.data.runs import read_run
    from pgdiag.metrics.settings import MetricSettings

    runs = ("run_a",) if one_run else ("run_a", "run_b")
    b = None if one_run else read_run(RUN_B)
    comparison = compare_runs(
        read_run(RUN_A), b, metrics=MetricSettings(), chunk_rows=32 * len(runs), join="id"
    )
    reads, step_scans = scans
    assert dict(reads) == dict.fromkeys(runs, 4)
    assert dict(step_scans) == dict.fromkeys(runs, 2)
    batch = comparison.report.summary.filter(pl.col("scope") == "batch")
    assert sorted(batch.filter(pl.col("breakdown") == "step")["bucket"].unique().to_list()) == [
        "0",
        "1",
        "2",
        "3",
    ]
