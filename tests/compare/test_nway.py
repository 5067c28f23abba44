"""N-way compare: each pair equals the two-run compare on the common samples; the matrix holds every pair."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal
from sample_paths import SAMPLE_DATA

import pgdiag
from pgdiag.compare.api import compare_runs
from pgdiag.compare.nway import MATRIX_STATISTIC, compare_many
from pgdiag.compare.settings import CompareSettings
from pgdiag.errors import UsageError

SAMPLES = SAMPLE_DATA


@pytest.fixture
def three_runs(tmp_path: Path) -> list[Path]:
    """run_a, run_b and run_c: run_a's first three steps only, imported under the label run_c."""
    partial = tmp_path / "partial"
    shutil.copytree(SAMPLES / "run_a" / "rollouts", partial)
    shutil.rmtree(partial / "step=3")
    frame = pl.read_parquet(sorted(partial.glob("step=*/*.parquet")), hive_partitioning=False)
    frame = frame.with_columns(pl.lit("run_c").alias("run")).drop("seq_hash")
    pgdiag.write_run(frame, tmp_path / "run_c", label="run_c")
    return [SAMPLES / "run_a", SAMPLES / "run_b", tmp_path / "run_c"]


def _pair_rows(report: pgdiag.Report, pair: str) -> pl.DataFrame:
    return report.summary.filter(pl.col("pair") == pair).sort("scope", "breakdown", "bucket", "metric")


def test_each_pair_equals_the_two_run_compare_on_the_common_samples(three_runs: list[Path]) -> None:
    nway = compare_many([pgdiag.read_run(p) for p in three_runs], CompareSettings(by=("step", "position")))
    common = [0, 1, 2]  # run_c holds steps 0-2 only
    expected = {
        ("run_a", "run_b"): compare_runs(
            pgdiag.read_run(three_runs[0], steps=common),
            pgdiag.read_run(three_runs[1], steps=common),
            CompareSettings(by=("step", "position")),
        ),
        ("run_a", "run_c"): compare_runs(
            pgdiag.read_run(three_runs[0], steps=common),
            pgdiag.read_run(three_runs[2]),
            CompareSettings(by=("step", "position")),
        ),
    }
    assert [c.report.meta["pairs"][0] for c in nway.comparisons] == [
        "run_a:new vs run_b:new",
        "run_a:new vs run_c:new",
    ]
    for comparison, ((la, lb), want) in zip(nway.comparisons, expected.items(), strict=True):
        name = f"{la}:new vs {lb}:new"
        assert_frame_equal(_pair_rows(nway.report, name), _pair_rows(want.report, name), check_exact=True)
        assert comparison.pair.n_samples == want.pair.n_samples == 96  # 3 steps x 32 samples
    # run_c is run_a on steps 0-2: identical streams, zero deltas
    assert nway.report.value("mismatch/abs_max", pair="run_a:new vs run_c:new", scope="token") == 0.0


def test_matrix_holds_every_pair_once_and_equals_the_pairwise_statistic(three_runs: list[Path]) -> None:
    nway = compare_many([pgdiag.read_run(p) for p in three_runs], baseline=1)
    pairs = [(r["run_a"], r["run_b"]) for r in nway.matrix.iter_rows(named=True)]
    assert sorted(pairs) == [("run_a", "run_c"), ("run_b", "run_a"), ("run_b", "run_c")]
    b_vs_c = compare_runs(
        pgdiag.read_run(three_runs[1], steps=[0, 1, 2]), pgdiag.read_run(three_runs[2])
    ).report.value(MATRIX_STATISTIC, scope="token")
    b_vs_a = nway.matrix.filter((pl.col("run_a") == "run_b") & (pl.col("run_b") == "run_a"))["value"][0]
    b_vs_c_matrix = nway.matrix.filter((pl.col("run_a") == "run_b") & (pl.col("run_b") == "run_c"))["value"][
        0
    ]
    assert b_vs_c_matrix == b_vs_c and b_vs_a == b_vs_c  # run_c equals run_a on the common samples
    a_vs_c = nway.matrix.filter(pl.col("run_a") == "run_a")["value"][0]
    assert a_vs_c == 0.0
    matrix_rows = nway.report.summary.filter(pl.col("breakdown") == "matrix")
    assert matrix_rows.height == 3 and set(matrix_rows["metric"]) == {MATRIX_STATISTIC}


def test_two_runs_only_options_and_bad_baseline_are_refused(three_runs: list[Path]) -> None:
    runs = [pgdiag.read_run(p) for p in three_runs]
    with pytest.raises(UsageError, match="--baseline 3"):
        compare_many(runs, baseline=3)
    with pytest.raises(UsageError, match="two runs"):
        compare_many(runs, CompareSettings(model=Path("ckpt")))


def test_cli_three_runs_reports_each_pair_the_matrix_and_gates_per_pair(
    three_runs: list[Path], tmp_path: Path
) -> None:
    import json

    from typer.testing import CliRunner

    from pgdiag.cli.app import build_app

    args = ["compare", *map(str, three_runs), "--baseline", "run_b", "--json", "--fail-on", "abs_max>1e-9"]
    args += ["--out", str(tmp_path / "nway")]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 1, (
        result.stderr
    )  # run_b differs from run_a and run_c: both pairs fail the gate
    payload = json.loads(result.stdout)
    assert payload["pairs"] == ["run_b:new vs run_a:new", "run_b:new vs run_c:new"]
    assert {g["pair"] for g in payload["gates"]} == set(payload["pairs"])
    assert all(g["status"] == "fail" for g in payload["gates"])
    assert len(payload["matrix"]) == 3 and "between every pair" in result.stderr
    saved = pgdiag.load_report(tmp_path / "nway" / "compare.parquet")
    assert saved.summary.filter(pl.col("breakdown") == "matrix").height == 3


@pytest.mark.parametrize("option", ["--tokens-out", "--html"])
def test_cli_two_run_outputs_are_refused_for_three_runs_before_any_write(
    three_runs: list[Path], tmp_path: Path, option: str
) -> None:
    from typer.testing import CliRunner

    from pgdiag.cli.app import build_app

    target = tmp_path / ("tokens.parquet" if option == "--tokens-out" else "page.html")
    result = CliRunner().invoke(build_app(), ["compare", *map(str, three_runs), option, str(target)])
    assert result.exit_code == 2
    assert "error[E521]" in result.stderr and option in result.stderr
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["partial", "run_c"]
