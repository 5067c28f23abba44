"""Staleness in whatif against a planted run: lag buckets, the three-policy split, AReaL's log-linear error.

Step 3, proximal version 3 (canonical: offset 0), v_θ = 4 for AReaL's α = (v_prox − v_μ)/(v_θ − v_μ):
  s0  policy_version 3 (lag 0)  rollout (−1, −1)  old (−1.5, −1)    new (−1.25, −2)
  s1  policy_version 1 (lag 2)  rollout (−2)      old (−1)          new (−0.5)
  s2  policy_version_tok 2, 1   rollout (−1, −1)  old (−1, −0.5)    new (−1, −0.5)   (lags 1 and 2)
"""

from __future__ import annotations

import polars as pl
import pytest

from pgdiag.analysis.settings import CorrectionRule, WhatifSettings
from pgdiag.analysis.whatif import whatif
from pgdiag.data.runs import read_run
from tests.rollout_factory import response_row, write_rollouts_file

TYPES = {"policy_version": pl.Int64, "policy_version_tok": pl.List(pl.Int64)}


def planted_rows() -> list[dict]:
    def row(sid, version, rollout, old, new, tok=None):
        return response_row(3, sid, rollout, old, new, policy_version=version, policy_version_tok=tok)

    return [
        row("s0", 3, [-1.0, -1.0], [-1.5, -1.0], [-1.25, -2.0]),
        row("s1", 1, [-2.0], [-1.0], [-0.5]),
        row("s2", 1, [-1.0, -1.0], [-1.0, -0.5], [-1.0, -0.5], tok=[-1, -1, 2, 1]),
    ]


def lag_value(report, metric, bucket, pair="t:rollout vs t:old"):
    frame = report.summary.filter(
        (pl.col("breakdown") == "lag")
        & (pl.col("bucket") == bucket)
        & (pl.col("metric") == metric)
        & (pl.col("pair") == pair)
    )
    return frame["value"].item()


def test_lag_buckets_split_and_loglinear_error(tmp_path):
    path = write_rollouts_file(tmp_path / "run.parquet", planted_rows(), raw_types=TYPES)
    rules = (CorrectionRule("token_tis", 1.5),)
    report = whatif(read_run(path), WhatifSettings(rules=rules))
    assert report.meta["settings"]["lag"] == {
        "preset": "canonical", "offset": 0, "offset_verified": True, "per_token_versions": True,
        "unknown_reason": None,
    }  # fmt: skip
    assert [lag_value(report, "whatif/lag_tokens", b) for b in ("0", "1", "2")] == pytest.approx(
        [0.4, 0.2, 0.4]
    )
    assert lag_value(report, "whatif/lag_abs_log_ratio", "0") == pytest.approx(0.25)
    assert lag_value(report, "whatif/lag_abs_log_ratio", "1") == pytest.approx(0.0)
    assert lag_value(report, "whatif/lag_abs_log_ratio", "2") == pytest.approx(0.75)
    # proximal→θ side of the split: |new − old| = (0.25, 1.0) at lag 0, 0 at lag 1, (0.5, 0) at lag 2
    later = "t:old vs t:new"
    assert lag_value(report, "whatif/lag_abs_log_ratio", "0", later) == pytest.approx(0.625)
    assert lag_value(report, "whatif/lag_abs_log_ratio", "2", later) == pytest.approx(0.25)
    # α = 0 at lag 0 (error |μ − old|), 1/2 at lag 1, 2/3 at lag 2: −2 + 2/3·1.5 = −1 (exact), −1 + 2/3·0.5
    assert lag_value(report, "whatif/lag_loglinear_abs_error", "0") == pytest.approx(0.25)
    assert lag_value(report, "whatif/lag_loglinear_abs_error", "1") == pytest.approx(0.0)
    assert lag_value(report, "whatif/lag_loglinear_abs_error", "2") == pytest.approx((0.0 + 1 / 6) / 2)
    # token TIS at 1.5 hits e^1 and e^0.5: both lag-2 tokens
    hit = report.summary.filter(pl.col("breakdown") == "threshold/lag")
    values = dict(zip(hit["bucket"].to_list(), hit["value"].to_list(), strict=True))
    assert values == {"token_tis:1.5|0": 0.0, "token_tis:1.5|1": 0.0, "token_tis:1.5|2": 1.0}


def test_verl_preset_removes_its_off_by_one(tmp_path):
    meta = {"source": {"framework": "verl", "preset": "verl", "retokenized": False, "unsafe_load": False}}
    path = write_rollouts_file(tmp_path / "run.parquet", planted_rows(), raw_types=TYPES, **meta)
    report = whatif(read_run(path), WhatifSettings(rules=(CorrectionRule("token_tis", 2.0),)))
    assert report.meta["settings"]["lag"]["offset"] == 1
    # proximal version 3 − 1 = 2: s0 at −1, s1 at 1, s2's tokens at 0 and 1
    assert lag_value(report, "whatif/lag_tokens", "<0") == pytest.approx(0.4)
    assert lag_value(report, "whatif/lag_tokens", "0") == pytest.approx(0.2)
    assert lag_value(report, "whatif/lag_tokens", "1") == pytest.approx(0.4)


def test_lag_rows_of_pieces_are_those_of_one_read(tmp_path):
    """Two steps (the planted step 3, and a step 4 sampled one version later), read in pieces of one step and
    whole: the lag buckets, the three-policy split and the where-tables add up to the same rows."""
    later = [
        r | {"step": 4, "sample_id": f"{r['sample_id']}b", "policy_version": r["policy_version"] + 1}
        for r in planted_rows()
    ]
    path = write_rollouts_file(tmp_path / "run.parquet", planted_rows() + later, raw_types=TYPES)
    settings = WhatifSettings(rules=(CorrectionRule("token_tis", 1.5), CorrectionRule("seq_tis", 1.2)))
    whole = whatif(read_run(path), settings)
    pieces = whatif(read_run(path), settings, max_rows=1)
    assert (whole.meta["pieces"], pieces.meta["pieces"]) == (1, 2)
    assert whole.meta["settings"] == pieces.meta["settings"]
    assert whole.summary["bucket"].to_list() == pieces.summary["bucket"].to_list()
    assert whole.summary["n"].to_list() == pieces.summary["n"].to_list()
    for a, b in zip(whole.summary["value"].to_list(), pieces.summary["value"].to_list(), strict=True):
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-12, abs=1e-15)
    # step 4 (proximal 4): s0 at lag 0, s1 at 2, s2's per-token versions (2, 1) at lags 2 and 3; of 10 tokens
    shares = [lag_value(pieces, "whatif/lag_tokens", b) for b in ("0", "1", "2", "3")]
    assert shares == pytest.approx([0.4, 0.1, 0.4, 0.1])


def test_pipelinerl_versions_are_not_a_lag(tmp_path):
    # PipelineRL 58d39345 counts samples trained (finetune_loop.py), the preset's step is a sampling version
    meta = {
        "source": {
            "framework": "pipelinerl",
            "preset": "pipelinerl",
            "retokenized": False,
            "unsafe_load": False,
        }
    }
    path = write_rollouts_file(tmp_path / "run.parquet", planted_rows(), raw_types=TYPES, **meta)
    report = whatif(read_run(path), WhatifSettings(rules=(CorrectionRule("token_tis", 2.0),)))
    assert "count samples trained" in report.meta["settings"]["lag"]["unknown_reason"]
    assert lag_value(report, "whatif/lag_tokens", "unknown") == pytest.approx(1.0)
