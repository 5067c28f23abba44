"""Checks of a run read in pieces say what one read says: the messages that count their own cases state the
run's totals (`MessageParts`), and the rules judged over the run (E206's 1 % share of exact 0.0, E302 by nulls,
E302's medians) give the one-read verdict for `check`, `metrics` and `compare`, however the run is cut.

Each run is built so that the pieces alone would judge otherwise: a share of 0.0 above 1 % in one step only
(the run's share is below: W216), or E302 pairs too few in every piece for the medians (>= 200 pairs) but
enough in the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from rollout_factory import write_rollouts_file

from pgdiag.checks.run import check_run
from pgdiag.compare.api import compare_runs
from pgdiag.data.runs import read_run
from pgdiag.data.seqhash import seq_hash
from pgdiag.data.validate import CheckSettings
from pgdiag.errors import InvalidInputError
from pgdiag.metrics.api import StreamSettings, compute_metrics
from pgdiag.metrics.settings import MetricSettings

N_STEPS = 6
PER_STEP = 5
RESPONSE = 20  # loss tokens per sample: 100 a step, 600 in the run


def _rows(seed: int = 0) -> list[dict[str, Any]]:
    """Six steps of five samples: prompt of 3 tokens, 20 loss tokens, rollout and old log-probs in [-0.9, -0.1]."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(N_STEPS):
        for k in range(PER_STEP):
            ids = rng.integers(0, 50, 3 + RESPONSE).tolist()
            rollout = rng.uniform(-0.9, -0.1, RESPONSE)
            old = np.clip(rollout + rng.normal(0.0, 0.01, RESPONSE), -0.95, -0.05)
            rows.append(
                {
                    "run": "r",
                    "step": step,
                    "sample_id": f"s{step}-{k}",
                    "group_id": f"g{step}",
                    "input_ids": ids,
                    "seq_hash": seq_hash(ids),
                    "prompt_len": 3,
                    "loss_mask": [False] * 3 + [True] * RESPONSE,
                    "rollout_logprobs": [None] * 3 + rollout.tolist(),
                    "old_logprobs": [None] * 3 + old.tolist(),
                }
            )
    return rows


def _sample(rows: list[dict[str, Any]], step: int, k: int) -> dict[str, Any]:
    return rows[step * PER_STEP + k]


def _write(path: Path, rows: list[dict[str, Any]]):
    # a row group per step: the piece planner may then cut between any two steps (it keeps a row group whole)
    write_rollouts_file(path, rows, row_group_rows=PER_STEP)
    return read_run(path)


def _same(one, many) -> None:
    assert one.issues.equals(many.issues), (one.issues.to_dicts(), many.issues.to_dicts())
    assert one.hints == many.hints and one.exit_code == many.exit_code


def test_messages_that_count_their_cases_state_the_run_totals(tmp_path: Path) -> None:
    rows = _rows(1)
    for step in (1, 4):  # one of each in two pieces
        sample = _sample(rows, step, 2)
        sample["loss_mask"] = [*sample["loss_mask"][:-1], False]  # a value off the loss mask: W214
        sample["old_logprobs"][5] = float("nan")  # E207
        sample["old_logprobs"][6] = 0.3 + step  # E205, its maximum in the later piece
        sample["old_logprobs"][7] = 1e-7  # W216: in (0, 1e-6]
        _sample(rows, step, 0)["group_id"] = ""  # E211 (and W217: groups of unequal size in the step)
        empty = _sample(rows, step, 3)
        empty["loss_mask"] = [False] * len(empty["loss_mask"])  # W215
        empty["rollout_logprobs"] = empty["old_logprobs"] = [None] * len(empty["loss_mask"])
        against = _sample(rows, step, 4)  # E206 of the pair: old exactly 0.0 where rollout < -1
        against["rollout_logprobs"][8], against["old_logprobs"][8] = -3.0, 0.0
    run = _write(tmp_path / "r.parquet", rows)
    one = check_run(run, ignore=["W409"])
    for chunk_rows in (1, 10, 16):
        _same(one, check_run(run, ignore=["W409"], chunk_rows=chunk_rows))
    messages = dict(zip(one.issues["code"].to_list(), one.issues["message"].to_list(), strict=True))
    for code, said in {
        "W214": "old_logprobs set on 2 non-loss positions (ignored) (step 1, sample s1-2, pos 22; step 4,",
        "E207": "old_logprobs: 2 NaN, 0 +inf, 0 -inf (step 1, sample s1-2, pos 5; step 4, sample s4-2, pos 5)",
        "E205": "old_logprobs: 2 positive values (max 4.3) (step 1, sample s1-2, pos 6; step 4, sample s4-2",
        "E211": "2 samples without group_id (step 1, sample s1-0; step 4, sample s4-0)",
        "W215": "loss_mask: 2 samples with no loss tokens (step 1, sample s1-3; step 4, sample s4-3)",
        "W217": "group_id: groups of unequal size within a step (step 1: sizes 1 to 4); steps 1, 4",
        "E206": "old_logprobs 0.0 where rollout_logprobs < -1 on 2 tokens: zero-filled? (step 1, sample s1-4",
    }.items():
        assert said in messages[code], (code, messages[code])
    assert "2 exact 0.0 and 2 in (0, 1e-6]" in one.issues.filter(pl.col("code") == "W216")["message"].item()


def _zero_filled(rows: list[dict[str, Any]], per_step: dict[int, int]) -> list[dict[str, Any]]:
    """`rows` with old_logprobs exactly 0.0 on the first n loss tokens of step s's first sample."""
    for step, n in per_step.items():
        sample = _sample(rows, step, 0)
        for j in range(n):
            sample["old_logprobs"][3 + j] = 0.0
    return rows


METRICS = MetricSettings(new="old", old="rollout")


@pytest.mark.parametrize(
    ("per_step", "verdict", "said"),
    [
        # 4 % of step 2 (above 1 % in its piece), 4 of 600 in the run: 0.7 %, below: W216 as one read says
        ({2: 4}, "W216", "old_logprobs: 4 exact 0.0 and 0 in (0, 1e-6]"),
        # under 1 % in steps 0-4 (1 zero of 100 each), 2 % in step 5: 7 of 600 = 1.2 % in the run, E206
        ({0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2}, "E206", "old_logprobs: 1.2 % exact 0.0 on loss positions"),
    ],
)
def test_zero_fill_share_is_judged_over_the_run(
    tmp_path: Path, per_step: dict[int, int], verdict: str, said: str
) -> None:
    run = _write(tmp_path / "r.parquet", _zero_filled(_rows(2), per_step))
    # check: one verdict, whatever the pieces
    one = check_run(run, ignore=["W409"])
    for chunk_rows in (1, 5, 12):
        _same(one, check_run(run, ignore=["W409"], chunk_rows=chunk_rows))
    found = one.issues.filter(pl.col("code").is_in(["E206", "W216"]))
    assert found["code"].to_list() == [verdict] and said in found["message"].item()
    # metrics: the same verdict, raised after the last chunk (E206) or the same report (W216)
    checks = CheckSettings(ignore=("W409",))
    if verdict == "E206":
        messages = []
        for max_rows in (None, 5, 10**6):
            with pytest.raises(InvalidInputError) as caught:
                compute_metrics(run, METRICS, checks=checks, stream=StreamSettings(max_rows=max_rows))
            assert caught.value.code == "E206"
            messages.append(caught.value.message)
        assert messages[0] == messages[1] == messages[2] and said in messages[0]
    else:
        many = compute_metrics(run, METRICS, checks=checks, stream=StreamSettings(max_rows=5))
        whole = compute_metrics(run, METRICS, checks=checks, stream=StreamSettings(max_rows=10**6))
        assert many.meta["chunks"] == N_STEPS and whole.meta["chunks"] == 1
        assert many.summary.equals(whole.summary) and many.checks.equals(whole.checks)
        assert said in many.checks.filter(pl.col("code") == "W216")["message"].item()
    # compare (the zero-filled run as side b): the same verdict
    other = _write(tmp_path / "a.parquet", _rows(2))
    if verdict == "E206":
        messages = []
        for chunk_rows in (10**6, 5):
            with pytest.raises(InvalidInputError) as caught:
                compare_runs(other, run, ignore=["W409"], chunk_rows=chunk_rows)
            assert caught.value.code == "E206"
            messages.append(caught.value.message)
        assert messages[0] == messages[1] and said in messages[0]
    else:
        one_cmp = compare_runs(other, run, ignore=["W409"])
        many_cmp = compare_runs(other, run, ignore=["W409"], chunk_rows=5)
        w216 = [
            c.report.checks.filter(pl.col("code") == "W216")["message"].to_list() for c in (one_cmp, many_cmp)
        ]
        assert w216[0] == w216[1] and said in w216[0][0]


def _shifted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """old_logprobs of every sample moved one position later (element i holds token i - 1's value)."""
    for row in rows:
        values = row["rollout_logprobs"][3:]
        spread = np.linspace(-4.0, -0.05, RESPONSE)  # values far apart: |Δ| at offset 0 is large
        rng = np.random.default_rng(len(row["sample_id"]) + row["step"])
        values = rng.permutation(spread).tolist()
        row["rollout_logprobs"] = [None] * 3 + values
        row["old_logprobs"] = [None] * 3 + [values[0], *values[:-1]]
    return rows


def test_shift_medians_pool_over_pieces_too_small_alone(tmp_path: Path) -> None:
    # 6 steps x 5 samples x 19 pairs = 570 pairs in the run, 95 a step: no piece of one step reaches the 200
    # pairs the medians need, the run does
    run = _write(tmp_path / "r.parquet", _shifted(_rows(3)))
    one = check_run(run, ignore=["W409"])
    e302 = one.issues.filter(pl.col("code") == "E302").row(0, named=True)
    assert e302["count"] == N_STEPS * PER_STEP * (RESPONSE - 1)
    assert "old_logprobs looks shifted by +1 vs rollout_logprobs" in e302["message"]
    for chunk_rows in (1, 5, 10):
        many = check_run(run, ignore=["W409"], chunk_rows=chunk_rows)
        assert many.issues.filter(pl.col("code") == "E302").equals(
            one.issues.filter(pl.col("code") == "E302")
        )
    # compare: rollout of run a against the shifted old of run b, one read and pieces of one step
    run_b = _write(
        tmp_path / "b.parquet", [dict(r, rollout_logprobs=r["old_logprobs"]) for r in _shifted(_rows(3))]
    )
    messages = []
    for chunk_rows in (10**6, 1):
        with pytest.raises(InvalidInputError) as caught:
            compare_runs(run, run_b, stream_a="rollout", stream_b="rollout", chunk_rows=chunk_rows)
        assert caught.value.code == "E302"
        messages.append(caught.value.message)
    assert messages[0] == messages[1] and "looks shifted by +1" in messages[0]


def _null_shifted(rows: list[dict[str, Any]], steps: range) -> list[dict[str, Any]]:
    """old_logprobs set just before each loss span and null on the last loss token, in `steps`."""
    for row in rows:
        if row["step"] in steps:
            values = row["old_logprobs"]
            row["old_logprobs"] = [None, None, values[3], *values[3:-1], None][: len(values)]
    return rows


@pytest.mark.parametrize(("steps", "flagged"), [(range(3), False), (range(N_STEPS), True)])
def test_null_pattern_shift_is_judged_over_the_run(tmp_path: Path, steps: range, flagged: bool) -> None:
    # in half the steps only: each of those pieces alone shows the pattern, the run does not
    run = _write(tmp_path / "r.parquet", _null_shifted(_rows(4), steps))
    one = check_run(run, ignore=["W409"])
    for chunk_rows in (1, 5, 15):
        _same(one, check_run(run, ignore=["W409"], chunk_rows=chunk_rows))
    e302 = one.issues.filter(pl.col("code") == "E302")
    assert e302.height == int(flagged)
    if flagged:
        assert e302["count"].item() == N_STEPS * PER_STEP and "looks shifted by -1" in e302["message"].item()


def test_stale_recompute_and_incomplete_recompute_read_as_one_read_says(tmp_path: Path) -> None:
    """E305 counts the run's stale samples; W504 (said by every piece) is one finding of count 1."""
    import json

    from rollout_factory import write_logprobs_part

    rows = _rows(5)
    path = tmp_path / "r.parquet"
    write_rollouts_file(path, rows)
    attached = tmp_path / "out" / "rc_x"
    attached.mkdir(parents=True)
    (attached / "_manifest.json").write_text(json.dumps({"tag": "rc_x", "complete": True}))
    parts = []
    for row in rows:
        stale = row["step"] in (1, 4) and row["sample_id"].endswith("-1")
        parts.append(
            {
                "step": row["step"],
                "sample_id": row["sample_id"],
                "segment_idx": 0,
                "seq_hash": 12345 if stale else seq_hash(row["input_ids"]),
                "logprobs": row["rollout_logprobs"],
                "entropy": [None if v is None else 0.25 for v in row["rollout_logprobs"]],
            }
        )
    write_logprobs_part(attached / "part-00000.parquet", parts)
    run = read_run(path, attach=[attached])
    one = check_run(run, streams=["rollout", "rc_x"], ignore=["W409"])
    for chunk_rows in (1, 10):
        _same(one, check_run(run, streams=["rollout", "rc_x"], ignore=["W409"], chunk_rows=chunk_rows))
    e305 = one.issues.filter(pl.col("code") == "E305").row(0, named=True)
    assert e305["count"] == 2 and "rc_x was computed on other rollouts: 2 samples" in e305["message"]
    assert "(first: step 1, sample s1-1)" in e305["message"]
    # an unfinished recompute beside the run: every piece warns, the run says it once
    run_dir = tmp_path / "run"
    (run_dir / "rollouts").mkdir(parents=True)
    write_rollouts_file(run_dir / "rollouts" / "part-00000.parquet", rows)
    (run_dir / "logprobs" / "t1").mkdir(parents=True)
    (run_dir / "logprobs" / "t1" / "_manifest.json").write_text("[1, 2]", encoding="utf-8")
    run = read_run(run_dir)
    one = check_run(run, ignore=["W409"])
    _same(one, check_run(run, ignore=["W409"], chunk_rows=1))
    assert one.issues.filter(pl.col("code") == "W504")["count"].to_list() == [1]
