"""Reductions of docs/metrics.md on hand cases, and the exact large-array quantile path."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pgdiag.metrics.reduce import (
    TokenReducer,
    ess_from_log_weights,
    linear_fit,
    quantiles,
    segment_sums,
)


def reducer(mode: str, lengths=(1, 3, 0, 2), docs=(0, 0, 1, 2)) -> TokenReducer:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    valid = np.ones(int(offsets[-1]), dtype=bool)
    return TokenReducer.build(valid, offsets, np.asarray(docs, dtype=np.int64), mode)


def r_mean(red: TokenReducer, x: np.ndarray) -> float | None:
    return red.mean_of_sums(red.sample_sums(x))


def r_spread(red: TokenReducer, x: np.ndarray) -> float | None:
    sums = red.sample_sums(x)
    return red.spread_of_moments(sums, red.centred_m2(x, sums))


# x per sample: [4], [1, 2, 3], [], [10, 20]; documents {s0, s1}, {s2 (empty)}, {s3}
X = np.array([4.0, 1.0, 2.0, 3.0, 10.0, 20.0])


def test_token_sample_document_means_differ_as_the_formulas_say():
    assert r_mean(reducer("token"), X) == pytest.approx(40.0 / 6, rel=1e-15)
    # sample: (4 + 2 + 15) / S+ with S+ = 3
    assert r_mean(reducer("sample"), X) == pytest.approx(21.0 / 3, rel=1e-15)
    # document: d0 = (4 + 6) / 4 = 2.5, d1 empty adds 0 but counts, d2 = 15: (2.5 + 0 + 15) / 3
    assert r_mean(reducer("document"), X) == pytest.approx(17.5 / 3, rel=1e-15)
    assert reducer("token").population == 6
    assert reducer("sample").population == 3
    assert reducer("document").population == 3


def test_spread_is_the_centred_second_moment_under_each_reduction():
    tok = reducer("token")
    mean = 40.0 / 6
    assert r_spread(tok, X) == pytest.approx(math.sqrt(np.mean((X - mean) ** 2)), rel=1e-15)
    sam = reducer("sample")
    centre = 7.0
    per_sample = [
        (4 - centre) ** 2,
        np.mean((np.array([1, 2, 3]) - centre) ** 2),
        np.mean((np.array([10, 20]) - centre) ** 2),
    ]
    assert r_spread(sam, X) == pytest.approx(math.sqrt(np.mean(per_sample)), rel=1e-15)
    # no cancellation: a constant offset of 1e9 leaves the spread of a tiny signal intact
    shifted = 1e9 + np.array([0.0, 1e-3, 2e-3, 0.0, 1e-3, 2e-3])
    assert r_spread(tok, shifted) == pytest.approx(
        math.sqrt(np.mean((shifted - shifted.mean()) ** 2)), rel=1e-6
    )


def test_boolean_flags_reduce_like_fractions():
    flags = np.array([True, False, False, True, True, False])
    assert r_mean(reducer("token"), flags) == pytest.approx(0.5, rel=1e-15)
    assert r_mean(reducer("sample"), flags) == pytest.approx((1 + 1 / 3 + 1 / 2) / 3, rel=1e-15)


def test_empty_population_gives_none():
    red = reducer("token", lengths=(0, 0), docs=(0, 1))
    assert r_mean(red, np.zeros(0)) is None
    assert r_spread(red, np.zeros(0)) is None
    assert quantiles(np.zeros(0), (0.5,)) == [None]


def test_segment_sums_handle_empty_runs():
    got = segment_sums(X, np.array([0, 1, 4, 4]), np.array([1, 3, 0, 2]))
    assert got.tolist() == [4.0, 6.0, 0.0, 30.0]


def test_subset_drops_tokens_and_keeps_samples():
    red = reducer("sample")
    keep = np.array([False, True, True, False, True, True])
    sub = red.subset(keep)
    assert sub.n_per_sample.tolist() == [0, 2, 0, 2]
    assert r_mean(sub, X[keep]) == pytest.approx((1.5 + 15.0) / 2, rel=1e-15)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 300_001])
def test_quantiles_equal_numpy_type_7(n):
    rng = np.random.default_rng(n)
    qs = (0.0, 0.001, 0.01, 0.05, 0.5, 0.95, 0.99, 0.999, 1.0)
    for x in (rng.normal(size=n), np.sort(rng.normal(size=n)), rng.integers(0, 4, size=n).astype(float)):
        assert quantiles(x, qs) == np.quantile(x, qs).tolist()


def test_quantile_of_equal_infinite_order_statistics_is_infinite():
    assert quantiles(np.array([1.0, math.inf, math.inf]), (0.75,)) == [math.inf]


def test_linear_fit_recovers_a_line_and_flags_constants():
    x = np.array([0.0, 1.0, 2.0, 3.0])
    fit = linear_fit(x, 2.0 * x - 1.0)
    assert fit.slope == pytest.approx(2.0, rel=1e-15)
    assert fit.intercept == pytest.approx(-1.0, rel=1e-15)
    assert fit.pearson_r == pytest.approx(1.0, rel=1e-15)
    assert fit.resid_rms == pytest.approx(0.0, abs=1e-15)
    flat = linear_fit(x, np.ones(4))
    assert flat.pearson_r is None and flat.slope == 0.0
    assert linear_fit(np.ones(4), x).slope is None


def test_ess_in_log_space_survives_huge_product_ratios():
    log_w = np.array([800.0, 800.0, 0.0])  # exp(800) overflows float64
    assert ess_from_log_weights(log_w) == pytest.approx(4.0 / 6.0, rel=1e-12)  # (2)^2 / (3 · 2)
    assert ess_from_log_weights(np.zeros(3)) == 1.0
    assert ess_from_log_weights(np.zeros(0)) is None


def test_rows_rebase_a_step_and_match_a_fresh_reducer():
    full = reducer("document", lengths=(2, 1, 0, 3, 1), docs=(0, 0, 1, 2, 3))
    x = np.array([1.0, 2.0, 5.0, 1.0, 1.0, 4.0, 8.0])
    sums = full.sample_sums(x)
    step = full.rows(2, 5)  # samples 2..4: documents 1, 2, 3 rebased to 0, 1, 2
    assert step.n_docs == 3 and step.doc_of_sample.tolist() == [0, 1, 2]
    assert full.token_range(2, 5) == (3, 7)
    fresh = reducer("document", lengths=(0, 3, 1), docs=(0, 1, 2))
    assert (
        step.mean_of_sums(sums[2:5]) == r_mean(fresh, x[3:7]) == pytest.approx((0 + 2.0 + 8.0) / 3, rel=1e-15)
    )
