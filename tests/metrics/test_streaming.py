"""`compute_metrics` reading a run in chunks of steps gives the numbers of a whole-run read.

The run has the structure of a real one at small scale: steps in shuffled file order, samples of 5 to 300
tokens, GRPO groups, the policy pair, a rollout stream for the mismatch family, a reference stream, a recompute
tag with entropy, and a few non-finite tokens (ignored E207). A budget of one row per chunk reads one step at a
time; a budget of a billion rows reads one chunk; `metrics_report` on the whole batch is the whole-run engine.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal
from rollout_factory import write_logprobs_part, write_rollouts_file

from pgdiag.checks.run import check_run
from pgdiag.data.load import read_token_batch
from pgdiag.data.runs import read_run
from pgdiag.data.seqhash import seq_hash
from pgdiag.data.validate import CheckSettings, Issue, check_result, merge_check_results
from pgdiag.errors import InvalidInputError
from pgdiag.metrics.api import (
    StreamSettings,
    compute_metrics,
    metric_streams,
    metrics_report,
    resolve_streams,
)
from pgdiag.metrics.pooled import QuantileSettings
from pgdiag.metrics.settings import MetricSettings

N_STEPS = 7
CHECKS = CheckSettings(ignore=("E207",))
QUANTILE_KEYS = (
    "policy/logratio_p",
    "mismatch/abs_p",
    "mismatch/abs_dprob_p99",
    "entropy/p",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(7)
    root = tmp_path_factory.mktemp("stream") / "run"
    tag_dir = root / "logprobs" / "rc"
    tag_dir.mkdir(parents=True)
    (tag_dir / "_manifest.json").write_text(json.dumps({"tag": "rc", "complete": True}))
    for file_index, step in enumerate(rng.permutation(N_STEPS).tolist()):
        rows, recompute = [], []
        for i in range(int(rng.integers(20, 60))):
            n = int(rng.integers(5, 300))
            prompt = 3
            ids = rng.integers(10, 1000, n + prompt).tolist()
            old = -rng.exponential(1.0, n)
            new = old + rng.standard_t(3, n) * 0.05
            rollout = old + rng.normal(0, 0.01, n)
            ref = old + rng.normal(0, 0.2, n)
            if rng.random() < 0.05:
                new[int(rng.integers(0, n))] = math.nan  # an invalid token (E207, ignored)
            pad = [None] * prompt
            advantage = float(rng.normal())
            rows.append(
                dict(
                    step=step,
                    sample_id=f"s{step}_{i}",
                    group_id=f"g{i // 4}",
                    input_ids=ids,
                    prompt_len=prompt,
                    loss_mask=[False] * prompt + [True] * n,
                    old_logprobs=pad + old.tolist(),
                    new_logprobs=pad + np.minimum(new, -1e-4).tolist(),
                    rollout_logprobs=pad + np.minimum(rollout, -1e-4).tolist(),
                    ref_logprobs=pad + np.minimum(ref, -1e-4).tolist(),
                    advantages=pad + [advantage] * n,
                    reward=float(rng.integers(0, 2)),
                )
            )
            recompute.append(
                dict(
                    step=step,
                    sample_id=f"s{step}_{i}",
                    segment_idx=0,
                    seq_hash=seq_hash(ids),
                    logprobs=pad + (old - 0.01).tolist(),
                    entropy=pad + rng.exponential(1.0, n).tolist(),
                )
            )
        write_rollouts_file(root / "rollouts" / f"part-{file_index:05d}.parquet", rows)
        write_logprobs_part(tag_dir / f"part-{file_index:05d}.parquet", recompute)
    return root


SETTINGS = MetricSettings.from_options(new="new", old="old", ref="ref", entropy="rc", divisor=512.0)


def _whole_run_report(run_dir) -> pl.DataFrame:
    run = read_run(run_dir)
    settings = resolve_streams(run, SETTINGS)
    loaded = read_token_batch(
        run, streams=metric_streams(settings), entropy=["rc"], ignore=CHECKS.ignore, max_examples=5
    )
    return metrics_report(loaded.batch, settings, run=run).summary


def test_chunked_equals_one_chunk_equals_the_whole_run_read(run_dir) -> None:
    run = read_run(run_dir)
    many = compute_metrics(run, SETTINGS, checks=CHECKS, stream=StreamSettings(max_rows=1))
    one = compute_metrics(run, SETTINGS, checks=CHECKS, stream=StreamSettings(max_rows=10**9))
    assert many.meta["chunks"] == N_STEPS and one.meta["chunks"] == 1
    assert many.meta["pooled_quantiles"]["exact"] is True
    keys = set(many.summary["metric"].to_list())
    assert {"entropy/p50", "mismatch/abs_p99", "policy/ref_kl_k3", "policy/logratio_p999"} <= keys
    assert (
        many.summary.filter(pl.col("metric") == "count/tokens_invalid", pl.col("bucket") == "all")[
            "value"
        ].item()
        > 0
    )  # the invalid tokens are there and counted
    # every row, the pooled `all` row included, is bit-identical: per-sample tables are the same arrays and
    # the exact quantiles see the same concatenation
    assert_frame_equal(many.summary, one.summary, check_exact=True)
    assert_frame_equal(many.summary, _whole_run_report(run_dir), check_exact=True)
    assert many.checks.height == one.checks.height  # one row per code, counts added over the chunks
    assert many.checks["count"].to_list() == one.checks["count"].to_list()


def test_sketched_all_row_quantiles_stay_within_the_bound_and_nothing_else_moves(run_dir) -> None:
    run = read_run(run_dir)
    alpha = 1e-3
    sketch = StreamSettings(max_rows=1, quantiles=QuantileSettings(exact_limit=1000, relative_error=alpha))
    sketched = compute_metrics(run, SETTINGS, checks=CHECKS, stream=sketch)
    exact = compute_metrics(run, SETTINGS, checks=CHECKS, stream=StreamSettings(max_rows=1))
    assert sketched.meta["pooled_quantiles"] == {"exact": False, "exact_limit": 1000, "relative_error": alpha}
    assert any("sketched" in n for n in sketched.meta["notices"])
    per_step = pl.col("breakdown") == "step"
    assert_frame_equal(sketched.summary.filter(per_step), exact.summary.filter(per_step), check_exact=True)
    got = sketched.summary.filter(pl.col("bucket") == "all")
    want = exact.summary.filter(pl.col("bucket") == "all")
    quantile = pl.any_horizontal([pl.col("metric").str.starts_with(k) for k in QUANTILE_KEYS])
    assert_frame_equal(got.filter(~quantile), want.filter(~quantile), check_exact=True)
    moved = 0
    for key, value, reference in zip(
        want.filter(quantile)["metric"],
        got.filter(quantile)["value"],
        want.filter(quantile)["value"],
        strict=True,
    ):
        # each order statistic within α of its value; between two of them, within α of the larger magnitude
        # (this run's quantiles are far from a sign change, so α·|q| with a 2x margin for the interpolation)
        assert abs(value - reference) <= 2 * alpha * abs(reference) + 1e-300, key
        moved += value != reference
    assert moved > 0  # the sketch did answer these quantiles


def test_checks_of_chunks_merge_per_code_and_rule() -> None:
    def zeros(column: str, n: int, step: int) -> Issue:
        return Issue("W216", "warning", n, f"{column}: {n} exact 0.0", step=step, rule=f"{column}: exact 0.0")

    first = check_result([zeros("old_logprobs", 3, 0)])
    second = check_result(
        [
            Issue("E204", "error", 1, "null", step=1, sample_id="b", pos=2),
            zeros("old_logprobs", 2, 1),
            zeros("new_logprobs", 4, 1),  # the same code on another column: its own row
        ]
    )
    merged = merge_check_results([first, check_result([]), second]).issues
    assert merged.select("code", "count", "message", "step").rows() == [
        ("E204", 1, "null", 1),
        ("W216", 5, "old_logprobs: 3 exact 0.0 [+2 in later steps]", 0),
        ("W216", 4, "new_logprobs: 4 exact 0.0", 1),
    ]
    assert merge_check_results([]).issues.height == 0


def test_key_style_steps_are_read_in_chunks_and_pooled_from_the_step_rows(run_dir) -> None:
    run = read_run(run_dir)
    settings = MetricSettings.from_options(new="new", old="old", key_style="verl", divisor=512.0)
    many = compute_metrics(run, settings, checks=CHECKS, stream=StreamSettings(max_rows=1))
    one = compute_metrics(run, settings, checks=CHECKS, stream=StreamSettings(max_rows=10**9))
    assert many.meta["chunks"] == N_STEPS
    assert_frame_equal(many.summary, one.summary, check_exact=True)
    resolved = resolve_streams(run, settings)
    loaded = read_token_batch(run, streams=metric_streams(resolved), ignore=CHECKS.ignore)
    whole = metrics_report(loaded.batch, resolved, run=run).summary
    steps = pl.col("breakdown") == "step"
    assert_frame_equal(many.summary.filter(steps), whole.filter(steps), check_exact=True)
    assert many.summary.filter(pl.col("bucket") == "all").height > 0


def test_metrics_refuses_a_zero_filled_pair_as_check_does(tmp_path) -> None:
    rng = np.random.default_rng(3)
    rows = []
    for step in range(3):
        for i in range(8):
            n = 30
            old = -rng.exponential(1.0, n) - 1.5  # every token below −1
            rollout = old.copy()
            if step == 2 and i == 5:
                rollout[7] = 0.0  # one zero-filled token: below the 1 % share the reader tests alone
            rows.append(
                dict(
                    step=step,
                    sample_id=f"s{step}_{i}",
                    input_ids=list(range(10, 12 + n)),
                    prompt_len=2,
                    loss_mask=[False, False] + [True] * n,
                    old_logprobs=[None, None, *old.tolist()],
                    rollout_logprobs=[None, None, *rollout.tolist()],
                    advantages=[None, None] + [1.0] * n,
                )
            )
    write_rollouts_file(tmp_path / "zf.parquet", rows)
    run = read_run(tmp_path / "zf.parquet")
    found = check_run(run, streams=["rollout", "old"])
    assert "E206" in found.issues["code"].to_list()
    with pytest.raises(InvalidInputError) as refused:
        compute_metrics(run, new="old", stream=StreamSettings(max_rows=1))
    assert refused.value.code == "E206"
    assert "rollout_logprobs 0.0 where old_logprobs < -1 on 1 tokens" in refused.value.message
    assert "step 2, sample s2_5, pos 9" in refused.value.message
    report = compute_metrics(run, new="old", checks=CheckSettings(ignore=("E206",)))
    assert report.meta["chunks"] == 1


def test_a_row_with_a_null_step_is_not_left_out_of_the_chunks(tmp_path) -> None:
    rows = [
        dict(
            step=step,
            sample_id=f"s{i}",
            input_ids=[1, 2, 3, 4],
            prompt_len=2,
            loss_mask=[False, False, True, True],
            old_logprobs=[None, None, -0.5, -1.5],
            advantages=[None, None, 1.0, 1.0],
        )
        for i, step in enumerate([0, 0, 1, None, 1])
    ]
    write_rollouts_file(tmp_path / "nulls.parquet", rows)
    run = read_run(tmp_path / "nulls.parquet")
    with pytest.raises(InvalidInputError) as refused:
        compute_metrics(run, new="old", stream=StreamSettings(max_rows=1))
    assert refused.value.code == "E213"
    ignored = compute_metrics(run, new="old", checks=CheckSettings(ignore=("E213",)))
    assert ignored.meta["inputs"]["n_samples"] == 4  # read whole, the null-step row dropped as before
