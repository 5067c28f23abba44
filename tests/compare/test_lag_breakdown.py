"""`compare --by lag` against the planted run of tests/metrics/test_lag.py (two steps, lags 0, 1, 2).

One run's streams, rollout vs old (Δ = old − rollout): lag 0 holds s0's tokens (Δ = −0.5, 0) of both steps, lag 1
s2's first token (Δ = 0), lag 2 s1 (Δ = 1) and s2's second token (Δ = 0.5). The slime preset moves every lag
up by one (slime 624b824a trains rollout r on weight version r + 1).
"""

from __future__ import annotations

import math

import polars as pl
import pytest

from pgdiag.compare.api import compare_runs
from pgdiag.compare.settings import CompareSettings
from tests.metrics.test_lag import run_of


def lag_table(comparison, metric: str, column: str = "value") -> dict[str, float]:
    frame = comparison.report.summary.filter(
        (pl.col("breakdown") == "lag")
        & (pl.col("metric") == f"mismatch/{metric}")
        & (pl.col("scope") == "token")
    )
    return dict(zip(frame["bucket"].to_list(), frame[column].to_list(), strict=True))


def tokens(comparison) -> dict[str, int]:
    return lag_table(comparison, "abs_mean", "n")


@pytest.mark.parametrize("chunk_rows", [None, 1])
def test_lag_buckets_of_one_runs_streams(tmp_path, chunk_rows):
    run = run_of(tmp_path)
    options = {"by": ("lag",), **({"chunk_rows": chunk_rows} if chunk_rows else {})}
    comparison = compare_runs(run, None, CompareSettings.from_options(**options))
    assert tokens(comparison) == {"0": 4, "1": 2, "2": 4}
    abs_mean = lag_table(comparison, "abs_mean")
    assert abs_mean["0"] == pytest.approx(0.25)
    assert abs_mean["1"] == 0.0
    assert abs_mean["2"] == pytest.approx(0.75)
    k3 = lag_table(comparison, "kl_k3")
    assert k3["2"] == pytest.approx((math.exp(1.0) - 2.0 + math.exp(0.5) - 1.5) / 2)


def test_slime_preset_shifts_the_buckets(tmp_path):
    comparison = compare_runs(run_of(tmp_path, "slime"), None, CompareSettings(by=("lag",)))
    assert tokens(comparison) == {"1": 4, "2": 2, "3": 4}


def test_lag_is_not_a_default_breakdown(tmp_path):
    comparison = compare_runs(run_of(tmp_path), None, CompareSettings())
    assert comparison.report.summary.filter(pl.col("breakdown") == "lag").is_empty()


def test_a_run_without_versions_is_unknown(tmp_path):
    comparison = compare_runs(run_of(tmp_path, versions=False), None, CompareSettings(by=("lag",)))
    assert tokens(comparison) == {"unknown": 10}


def test_the_command_shows_the_lag_table_and_refuses_it_for_n_way(tmp_path):
    from typer.testing import CliRunner

    from pgdiag.cli.app import build_app

    path = str(run_of(tmp_path).paths[0])
    shown = CliRunner().invoke(build_app(), ["compare", path, "--by", "lag", "-v"], env={"COLUMNS": "160"})
    assert shown.exit_code in (0, 1), shown.output
    assert "by lag" in shown.stdout
    refused = CliRunner().invoke(build_app(), ["compare", path, path, path, "--by", "lag"])
    assert refused.exit_code == 2 and "E521" in refused.output


def test_two_runs_take_side_as_versions(tmp_path):
    """Run b holds run a's rows in reverse order with its rollout stream moved by s0's old − rollout: the lag
    buckets come from run a's versions whatever b's row order, and Δ = b − a per bucket is that move."""
    from pgdiag.data.runs import read_run
    from tests.metrics.test_lag import TYPES, planted_rows
    from tests.rollout_factory import write_rollouts_file

    rows = planted_rows(3)
    run_a = read_run(write_rollouts_file(tmp_path / "a.parquet", rows, raw_types=TYPES))
    moved = []
    for row in reversed(rows):
        shift = 0.5 if row["sample_id"] == "s1" else 0.0  # s1 is the lag-2 sample
        rollout = [None if v is None else v + shift for v in row["rollout_logprobs"]]
        moved.append({**row, "rollout_logprobs": rollout, "policy_version": 99, "policy_version_tok": None})
    run_b = read_run(write_rollouts_file(tmp_path / "b.parquet", moved, raw_types=TYPES))
    comparison = compare_runs(run_a, run_b, CompareSettings(stream_a="rollout", by=("lag",)))
    assert tokens(comparison) == {"0": 2, "1": 1, "2": 2}
    bias = lag_table(comparison, "bias")
    assert bias["0"] == 0.0 and bias["1"] == 0.0
    assert bias["2"] == pytest.approx(0.25)  # s1's token moved by 0.5, s2's second token by 0
