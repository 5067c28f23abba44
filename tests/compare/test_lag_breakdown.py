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
