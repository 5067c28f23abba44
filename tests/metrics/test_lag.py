"""`metrics --by lag` against a planted run: the policy and mismatch families per staleness bucket.

Steps 3 and 4 hold the same three samples (step 4's versions one higher, so every lag is the same); canonical
preset (offset 0): the proximal version is the step.
  s0  policy_version v     (lag 0)       rollout (−1, −1)  old (−1.5, −1)    new (−1.25, −2)
  s1  policy_version v − 2 (lag 2)       rollout (−2)      old (−1)          new (−0.5)
  s2  policy_version_tok v − 1, v − 2    rollout (−1, −1)  old (−1, −0.5)    new (−1, −0.5)   (lags 1 and 2)
with v the step. Policy pair d = new − old, mismatch pair Δ = old − rollout; k3(x) = e^x − 1 − x.
"""

from __future__ import annotations

import math

import polars as pl
import pytest

from pgdiag.data.runs import read_run
from pgdiag.metrics.api import StreamSettings, compute_metrics
from pgdiag.metrics.settings import MetricSettings
from tests.rollout_factory import response_row, write_rollouts_file

TYPES = {"policy_version": pl.Int64, "policy_version_tok": pl.List(pl.Int64)}


def k3(x: float) -> float:
    return math.exp(x) - 1.0 - x


def planted_rows(step: int) -> list[dict]:
    def row(sid, version, rollout, old, new, tok=None):
        return response_row(step, sid, rollout, old, new, policy_version=version, policy_version_tok=tok)

    v = step
    return [
        row("s0", v, [-1.0, -1.0], [-1.5, -1.0], [-1.25, -2.0]),
        row("s1", v - 2, [-2.0], [-1.0], [-0.5]),
        row("s2", v - 2, [-1.0, -1.0], [-1.0, -0.5], [-1.0, -0.5], tok=[-1, -1, v - 1, v - 2]),
    ]


def lag_rows(report) -> dict[tuple[str, str, str], float | None]:
    frame = report.summary.filter(pl.col("breakdown") == "lag")
    return {(r["bucket"], r["metric"], r["pair"]): r["value"] for r in frame.iter_rows(named=True)}


def run_of(tmp_path, preset: str | None = None, versions: bool = True):
    rows = planted_rows(3) + planted_rows(4)
    if not versions:
        rows = [{k: v for k, v in r.items() if not k.startswith("policy_version")} for r in rows]
    meta = {}
    if preset is not None:
        meta["source"] = {"framework": preset, "preset": preset, "retokenized": False, "unsafe_load": False}
    types = TYPES if versions else None
    return read_run(write_rollouts_file(tmp_path / "run.parquet", rows, raw_types=types, **meta))


POLICY, MISMATCH = "run:old vs run:new", "run:rollout vs run:old"


@pytest.mark.parametrize("max_rows", [None, 1])
def test_lag_buckets_of_a_planted_run(tmp_path, max_rows):
    run = run_of(tmp_path)
    report = compute_metrics(run, MetricSettings(by=("lag",)), stream=StreamSettings(max_rows=max_rows))
    got = lag_rows(report)
    label = run.label
    policy, mismatch = POLICY.replace("run", label), MISMATCH.replace("run", label)
    assert {b for b, _, _ in got} == {"0", "1", "2"}
    assert [got[(b, "count/tokens", policy)] for b in ("0", "1", "2")] == [4.0, 2.0, 4.0]  # both steps
    # lag 0: s0, d = (0.25, −1), Δ = (−0.5, 0)
    assert got[("0", "policy/logratio_abs_mean", policy)] == pytest.approx(0.625)
    assert got[("0", "policy/kl_k3", policy)] == pytest.approx((k3(0.25) + k3(-1.0)) / 2)
    assert got[("0", "mismatch/abs_mean", mismatch)] == pytest.approx(0.25)
    assert got[("0", "mismatch/kl_k3", mismatch)] == pytest.approx(k3(-0.5) / 2)
    # lag 1: s2's first token, d = Δ = 0
    assert got[("1", "policy/kl_k3", policy)] == 0.0
    assert got[("1", "mismatch/abs_mean", mismatch)] == 0.0
    # lag 2: s1 (d = 0.5, Δ = 1) and s2's second token (d = 0, Δ = 0.5)
    assert got[("2", "policy/logratio_abs_mean", policy)] == pytest.approx(0.25)
    assert got[("2", "policy/kl_k3", policy)] == pytest.approx(k3(0.5) / 2)
    assert got[("2", "mismatch/abs_mean", mismatch)] == pytest.approx(0.75)
    assert got[("2", "mismatch/kl_k3", mismatch)] == pytest.approx((k3(1.0) + k3(0.5)) / 2)
    edges = report.summary.filter((pl.col("breakdown") == "lag") & (pl.col("bucket") == "2"))
    assert set(edges["bucket_lo"].to_list()) == {2.0} and set(edges["bucket_hi"].to_list()) == {3.0}


def test_no_lag_rows_unless_asked(tmp_path):
    report = compute_metrics(run_of(tmp_path))
    assert report.summary.filter(pl.col("breakdown") == "lag").is_empty()


def test_slime_preset_trains_rollout_r_on_version_r_plus_1(tmp_path):
    # slime 624b824a: weight_version is pushed once before rollout 0, then after each rollout (offset −1)
    report = compute_metrics(run_of(tmp_path, "slime"), MetricSettings(by=("lag",)))
    got = lag_rows(report)
    counts = {b: v for (b, m, _), v in got.items() if m == "count/tokens"}
    assert counts == {"1": 4.0, "2": 2.0, "3": 4.0}


def test_pipelinerl_versions_give_no_lag(tmp_path):
    report = compute_metrics(run_of(tmp_path, "pipelinerl"), MetricSettings(by=("lag",)))
    counts = {b: v for (b, m, _), v in lag_rows(report).items() if m == "count/tokens"}
    assert counts == {"unknown": 10.0}
    assert any("count samples trained" in n for n in report.meta["notices"])


def test_a_run_without_versions_is_all_unknown(tmp_path):
    report = compute_metrics(run_of(tmp_path, versions=False), MetricSettings(by=("lag",)))
    counts = {b: v for (b, m, _), v in lag_rows(report).items() if m == "count/tokens"}
    assert counts == {"unknown": 10.0}
    assert any("no policy_version column" in n for n in report.meta["notices"])


def test_unknown_breakdown_is_a_usage_error():
    from pgdiag.errors import UsageError

    with pytest.raises(UsageError, match="--by 'step'"):
        MetricSettings(by=("step",))
