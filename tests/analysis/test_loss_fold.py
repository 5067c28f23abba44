"""`metrics --losses` and `compare --losses`: the loss parity of tests/analysis/test_losses.py, folded over a run.

Step 0 is test_losses.py's step: s0 two tokens with A = +1, s1 one token with A = −1 (one group); vanilla
f = −A = (−1, −1, 1); token_mean c = 1/3 each, sample_mean c = (1/4, 1/4, 1/2), so ‖g_A − g_B‖/‖g_A‖ = √(1/8)
all from the aggregation and ‖g_B‖/‖g_A‖ = √(9/8). Step 1: s0 and s1 one token each (A = +1, −1): token_mean
and sample_mean both give c = 1/2, so every distance is 0 there. The `losses` row is the maximum over the steps.
Token TIS at 2 on step 0: ratio old/rollout = 4 on s0's first token is truncated to 2, f_B = (−2, −1, 1):
‖c·(f_A − f_B)‖/‖g_A‖ = (1/3)/√(1/3) = √(1/3) (float32 storage moves the ratio 4 by 1e-7; truncated to 2 exactly).
"""

from __future__ import annotations

import math

import polars as pl
import pytest

from pgdiag.analysis.loss_fold import LossParitySettings, loss_parity_fold
from pgdiag.compare.api import compare_runs
from pgdiag.compare.settings import CompareSettings
from pgdiag.data.runs import read_run
from pgdiag.errors import UsageError
from pgdiag.metrics.api import StreamSettings, compute_metrics
from tests.rollout_factory import response_row, write_rollouts_file

LN4 = math.log(4.0)


def rows() -> list[dict]:
    return [
        response_row(0, "s0", [-2 * LN4, -1.0], [-LN4, -1.0], advantage=1.0),
        response_row(0, "s1", [-1.0], [-1.0], advantage=-1.0),
        response_row(1, "s0", [-1.0], [-1.0], advantage=1.0),
        response_row(1, "s1", [-1.0], [-1.0], advantage=-1.0),
    ]


def values(report, breakdown: str = "losses") -> dict[tuple[str, str], float | None]:
    frame = report.summary.filter(pl.col("breakdown") == breakdown)
    return {(r["bucket"], r["metric"]): r["value"] for r in frame.iter_rows(named=True)}


@pytest.fixture
def run(tmp_path):
    return read_run(write_rollouts_file(tmp_path / "run.parquet", rows()))


AGG = "vanilla@token_mean,vanilla@sample_mean"


@pytest.mark.parametrize("max_rows", [None, 2])
def test_metrics_losses_per_step_and_max(run, max_rows):
    fold = loss_parity_fold(run, LossParitySettings(AGG))
    report = compute_metrics(run, stream=StreamSettings(max_rows=max_rows), accumulators=[fold])
    step = values(report, "losses/step")
    label = "vanilla@token_mean vs vanilla@sample_mean"
    assert step[(f"{label}|0", "losses/rel_l2")] == pytest.approx(math.sqrt(1 / 8))
    assert step[(f"{label}|0", "losses/rel_l2_aggregation")] == pytest.approx(math.sqrt(1 / 8))
    assert step[(f"{label}|0", "losses/rel_l2_factor")] == pytest.approx(0.0)
    assert step[(f"{label}|1", "losses/rel_l2")] == pytest.approx(0.0)
    worst = values(report)
    assert worst[(label, "losses/rel_l2")] == pytest.approx(math.sqrt(1 / 8))
    assert worst[(label, "losses/grad_norm_ratio")] == pytest.approx(math.sqrt(9 / 8))
    n = report.summary.filter(pl.col("breakdown") == "losses")["n"].unique().to_list()
    assert n == [5]  # every loss token of both steps


def test_compare_losses_on_run_a(run):
    fold = loss_parity_fold(run, LossParitySettings("vanilla@token_mean,token_tis:2@token_mean"))
    comparison = compare_runs(run, None, CompareSettings(), accumulators=[fold])
    worst = values(comparison.report)
    label = "vanilla@token_mean vs token_tis:2@token_mean"
    assert worst[(label, "losses/rel_l2")] == pytest.approx(math.sqrt(1 / 3))
    assert worst[(label, "losses/rel_l2_factor")] == pytest.approx(math.sqrt(1 / 3))
    assert worst[(label, "losses/rel_l2_aggregation")] == pytest.approx(0.0)


def test_whatif_metrics_and_compare_agree(run):
    from pgdiag.analysis.settings import WhatifSettings
    from pgdiag.analysis.whatif import whatif

    by_whatif = values(whatif(run, WhatifSettings(rules=(), losses=AGG)))
    by_metrics = values(compute_metrics(run, accumulators=[loss_parity_fold(run, LossParitySettings(AGG))]))
    comparison = compare_runs(
        run, None, CompareSettings(), accumulators=[loss_parity_fold(run, LossParitySettings(AGG))]
    )
    assert by_whatif == pytest.approx(by_metrics) and by_metrics == pytest.approx(values(comparison.report))


def test_a_run_without_advantages_is_refused(tmp_path):
    plain = [{k: v for k, v in r.items() if k != "advantages"} for r in rows()]
    run = read_run(write_rollouts_file(tmp_path / "plain.parquet", plain))
    with pytest.raises(UsageError, match="needs advantages"):
        loss_parity_fold(run, LossParitySettings(AGG))


def cli(*args):
    from typer.testing import CliRunner

    from pgdiag.cli.app import build_app

    return CliRunner().invoke(build_app(), [str(a) for a in args])


def test_the_commands_print_and_write_the_same_numbers(run, tmp_path):
    import json

    metrics = cli("metrics", run.paths[0], "--losses", AGG, "--by", "lag", "--json")
    assert metrics.exit_code == 0, metrics.output
    label = "vanilla@token_mean vs vanilla@sample_mean"
    got = json.loads(metrics.stdout)
    assert got["losses"][label]["losses/rel_l2"] == pytest.approx(math.sqrt(1 / 8))
    assert list(got["lag"]) == ["unknown"] and got["lag"]["unknown"]["count/tokens"] == 5.0  # no versions
    compared = cli("compare", run.paths[0], "--losses", AGG, "--json")
    assert compared.exit_code in (0, 1), compared.output
    assert json.loads(compared.stdout)["losses"][label]["losses/rel_l2"] == pytest.approx(math.sqrt(1 / 8))
    shown = cli("metrics", run.paths[0], "--losses", AGG)
    assert "loss parity" in shown.stdout and "rel_l2_aggregation" in shown.stdout
    refused = cli("compare", run.paths[0], run.paths[0], run.paths[0], "--losses", AGG)
    assert refused.exit_code == 2 and "E521" in refused.output
