"""Breakdown buckets: labels, edges and per-bucket values on hand-built pairs; worst-K tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from batch_factory import make_batch

from pgdiag.compare import breakdowns as bd
from pgdiag.compare.align import align_batches
from pgdiag.compare.api import compare_runs
from pgdiag.compare.worst import worst_seqs, worst_tokens, worst_trace


def _sample(
    sid: str, step: int, lp_a: list[float], delta: list[float], *, env: str = "math", prompt_len: int = 2
):
    n = len(lp_a)
    lp_b = [a + d for a, d in zip(lp_a, delta, strict=True)]
    return {
        "step": step,
        "sample_id": sid,
        "input_ids": list(range(100, 100 + prompt_len + n)),
        "prompt_len": prompt_len,
        "loss": list(range(prompt_len, prompt_len + n)),
        "streams": {"a": np.array(lp_a), "b": np.array(lp_b)},
        "entropy": {"b": np.linspace(0.0, 3.0, n)},
        "reward": 1.0,
        "env": env,
    }


def _batch():
    samples = [
        _sample("x", 0, [-0.6, -0.15, -1.0, -3.0, -0.4], [0.4, 0.1, -0.1, 0.0, 0.2]),
        _sample("y", 1, [-0.5, -2.0, -0.0001], [-0.2, 0.3, 0.0], env="code"),
    ]
    return make_batch(samples, label="r")


def _pair():
    batch = _batch()
    return align_batches(batch, batch, stream_a="a", stream_b="b")


def test_position_buckets_and_values() -> None:
    pair = _pair()
    b = bd.assign(pair, "position")
    assert b.labels[:4] == ("0", "1", "[2,4)", "[4,8)")
    assert b.codes.tolist() == [0, 1, 2, 2, 3, 0, 1, 2]
    report = compare_runs(_batch(), stream_a="a", stream_b="b", by=["position"]).report
    first = report.value("mismatch/abs_mean", scope="token", breakdown="position", bucket="0")
    assert first == pytest.approx((0.4 + 0.2) / 2, abs=1e-12)
    bucket_2_4 = report.value("mismatch/bias", scope="token", breakdown="position", bucket="[2,4)")
    assert bucket_2_4 == pytest.approx((-0.1 + 0.0 + 0.0) / 3, abs=1e-12)
    rows = report.summary.filter(report.summary["breakdown"] == "position")
    assert set(rows["bucket"]) == {"0", "1", "[2,4)", "[4,8)"}  # empty buckets are not reported
    assert rows.filter(rows["bucket"] == "[4,8)")["n"][0] == 1


def test_prob_entropy_length_step_env_buckets() -> None:
    pair = _pair()
    prob = bd.assign(pair, "prob_bucket")
    # p_a = e^lp_a: 0.549, 0.861, 0.368, 0.0498, 0.670, 0.607, 0.135, 0.9999
    assert [prob.labels[c] for c in prob.codes] == [
        "[0.5,0.9)", "[0.5,0.9)", "[0.1,0.5)", "[0.01,0.1)", "[0.5,0.9)", "[0.5,0.9)", "[0.1,0.5)", "[0.999,1]",
    ]  # fmt: skip
    entropy = bd.assign(pair, "entropy_bucket")
    assert entropy.labels[entropy.codes[0]] == "[0,0.01)" and entropy.labels[entropy.codes[4]] == "[2,4)"
    length = bd.assign(pair, "length")
    assert [length.labels[c] for c in length.codes] == ["[4,8)"] * 5 + ["[2,4)"] * 3
    step = bd.assign(pair, "step")
    assert step.labels == ("0", "1") and step.lo.tolist() == [0.0, 1.0]
    env = bd.assign(pair, "env")
    assert env.labels == ("code", "math") and env.codes.tolist() == [1] * 5 + [0] * 3
    assert bd.available(pair) == ("position", "prob_bucket", "entropy_bucket", "length", "step", "env")


def test_worst_tables_rank_and_locate() -> None:
    pair = _pair()
    tokens = worst_tokens(pair, 3, decode=lambda ids: " ".join(str(i) for i in ids))
    assert tokens["dlogp"].to_list() == pytest.approx([0.4, 0.3, 0.2])
    assert tokens["sample_id"].to_list() == ["x", "y", "x"]  # |Δ| = 0.2 tie: x's token comes first
    assert tokens["pos"].to_list() == [2, 3, 6] and tokens["resp_pos"].to_list() == [0, 1, 4]
    assert tokens["context"][0] == "102 103 104 105 106"  # the loss tokens of x within ±8
    assert tokens["token_text"].to_list() == ["102", "103", "106"]  # each worst token alone: id 100 + pos
    seqs = worst_seqs(pair, 5)
    assert seqs["sample_id"].to_list() == ["x", "y"]
    assert seqs["dlogp_sum"].to_list() == pytest.approx([0.6, 0.1])
    assert seqs["dlogp_mean"].to_list() == pytest.approx([0.12, 0.1 / 3])
    assert seqs["abs_dlogp_max"].to_list() == pytest.approx([0.4, 0.3])
    assert seqs["env"].to_list() == ["math", "code"]
    trace = worst_trace(pair)
    assert trace["sample_id"].unique().to_list() == ["x"] and trace.height == 5
    assert (trace["lp_b"] - trace["lp_a"]).to_list() == pytest.approx([0.4, 0.1, -0.1, 0.0, 0.2])
    assert math.isclose(trace["lp_a"][3], -3.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64, np.int32])
def test_bucket_codes_equal_the_clipped_binary_search(dtype: type) -> None:
    """`_bucket_codes` counts inner edges by comparison; it must give the codes of the binary search it replaced,
    clip(searchsorted(edges, v, "right") − 1, 0, K − 1), for every edge set the breakdowns use, values on, just
    below and just above each edge, ±inf, −0.0 and NaN (the last bucket), in every dtype the values come in."""
    rng = np.random.default_rng(3)
    edge_sets = [
        np.asarray((-np.inf, *(float(np.log(e)) for e in bd.PROB_EDGES[1:]))),
        np.asarray(bd.ENTROPY_EDGES, dtype=np.float64),
        np.asarray(bd.DOUBLING_EDGES, dtype=np.float64),
        np.linspace(-3.0, 3.0, 200),  # more inner edges than an int8 count holds
    ]
    for edges in edge_sets:
        finite = edges[np.isfinite(edges)]
        values = np.concatenate(
            [
                rng.normal(0.0, 3.0, 2000),
                finite,
                np.nextafter(finite, -np.inf),
                np.nextafter(finite, np.inf),
                [np.inf, -np.inf, np.nan, -0.0, 0.0, 1e300, -1e300],
            ]
        )
        if np.issubdtype(dtype, np.integer):
            values = np.nan_to_num(values, nan=0.0).clip(-1e9, 1e9).astype(dtype)
        else:
            with np.errstate(over="ignore"):
                values = values.astype(dtype)
        k = edges.shape[0] - 1
        expected = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, k - 1)
        got = bd._bucket_codes(values, edges)
        assert got.dtype == np.intp
        assert np.array_equal(got, expected)
