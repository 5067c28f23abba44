"""Parity table math: a hand-computed example, identities across buckets, and agreement with the metrics engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pgdiag.compare.parity import bucket_table, sequence_table, token_table, token_terms


def test_worked_example_by_hand() -> None:
    lp_a = np.array([-1.0, -0.5, -2.0, -0.6])
    lp_b = np.array([-0.9, -0.7, -2.0, -0.3])  # Δ = (0.1, −0.2, 0, 0.3)
    t = token_table(lp_a, lp_b, eps_low=0.2, eps_high=0.2)
    one = {k: float(v[0]) for k, v in t.items()}
    # bias = (0.1 − 0.2 + 0 + 0.3) / 4 = 0.05; mean |Δ| = 0.6 / 4 = 0.15; rms = sqrt(0.14 / 4)
    assert one["bias"] == pytest.approx(0.05, abs=1e-15)
    assert one["kl_k1"] == pytest.approx(-0.05, abs=1e-15)
    assert one["abs_mean"] == pytest.approx(0.15, abs=1e-15)
    assert one["rms"] == pytest.approx(math.sqrt(0.035), rel=1e-14)
    # sd: deviations (0.05, −0.25, −0.05, 0.25): squares sum 0.13, / 4
    assert one["sd"] == pytest.approx(math.sqrt(0.0325), rel=1e-14)
    # |Δ| sorted (0, 0.1, 0.2, 0.3): p50 = 0.15 (type 7: h = 1.5), max 0.3
    assert one["abs_p50"] == pytest.approx(0.15, abs=1e-15)
    assert one["abs_max"] == pytest.approx(0.3, abs=1e-15)
    # bands: ρ = e^Δ = (1.105, 0.819, 1, 1.350): outside [0.8, 1.2] only the last; outside [0.9, 1.1]: 3
    assert one["frac_out_clip"] == 0.25
    assert one["frac_out_10pct"] == 0.75
    assert one["frac_out_strict"] == 0.75
    assert one["frac_out_2x"] == 0.0
    # k3 = mean(e^Δ − 1 − Δ)
    k3 = (math.expm1(0.1) - 0.1 + math.expm1(-0.2) + 0.2 + math.expm1(0.3) - 0.3) / 4
    assert one["kl_k3"] == pytest.approx(k3, rel=1e-12)
    rev_k3 = sum(1 - math.exp(d) + math.exp(d) * d for d in (0.1, -0.2, 0.0, 0.3)) / 4
    assert one["kl_rev_k3"] == pytest.approx(rev_k3, rel=1e-12)
    assert one["tmpe"] == pytest.approx((math.exp(0.1) + math.exp(0.2) + 1 + math.exp(0.3)) / 4, rel=1e-14)
    chi2 = (math.exp(0.2) + math.exp(-0.4) + 1 + math.exp(0.6)) / 4 - 1
    assert one["chi2_token"] == pytest.approx(chi2, rel=1e-12)
    rho = [math.exp(d) for d in (0.1, -0.2, 0.0, 0.3)]
    assert one["ess_token"] == pytest.approx(sum(rho) ** 2 / (4 * sum(r * r for r in rho)), rel=1e-14)
    dprob = sum(abs(math.exp(b) - math.exp(a)) for a, b in zip(lp_a, lp_b, strict=True)) / 4
    assert one["abs_dprob_mean"] == pytest.approx(dprob, rel=1e-14)
    assert one["tokens"] == 4


def test_fit_recovers_a_linear_relation() -> None:
    rng = np.random.default_rng(1)
    lp_a = -rng.exponential(2.0, size=500)
    lp_b = 0.7 * lp_a - 0.05
    t = token_table(lp_a, lp_b, eps_low=0.2, eps_high=0.2)
    assert t["fit_slope"][0] == pytest.approx(0.7, rel=1e-12)
    assert t["fit_intercept"][0] == pytest.approx(-0.05, abs=1e-12)
    assert t["pearson_r"][0] == pytest.approx(1.0, abs=1e-12)
    assert t["fit_resid_rms"][0] == pytest.approx(0.0, abs=1e-12)


def test_identical_streams_give_exact_zeros() -> None:
    lp = -np.random.default_rng(2).exponential(1.5, size=1000)
    t = token_table(lp, lp.copy(), eps_low=0.2, eps_high=0.2)
    for stat in (
        "bias",
        "sd",
        "rms",
        "abs_mean",
        "abs_p99",
        "abs_max",
        "kl_k1",
        "kl_k3",
        "kl_rev_k1",
        "kl_rev_k3",
    ):
        assert t[stat][0] == 0.0, stat
    for stat in (
        "frac_out_strict",
        "frac_out_clip",
        "chi2_token",
        "abs_dprob_mean",
        "fit_intercept",
        "fit_resid_rms",
    ):
        assert t[stat][0] == 0.0, stat
    assert t["tmpe"][0] == 1.0
    assert t["ess_token"][0] == 1.0
    assert t["fit_slope"][0] == 1.0
    assert t["pearson_r"][0] == 1.0


def test_buckets_equal_the_table_of_each_subset() -> None:
    rng = np.random.default_rng(3)
    lp_a = -rng.exponential(1.0, size=3000)
    lp_b = lp_a + rng.normal(0, 0.05, size=3000)
    codes = rng.integers(0, 4, size=3000)
    codes[codes == 2] = 3  # bucket 2 stays empty
    terms = token_terms(lp_a, lp_b, eps_low=0.2, eps_high=0.28)
    bucketed = bucket_table(terms, codes, 4)
    assert len(bucketed) == 16
    for k in (0, 1, 3):
        sub = token_table(lp_a[codes == k], lp_b[codes == k], eps_low=0.2, eps_high=0.28)
        for stat, values in bucketed.items():
            assert values[k] == pytest.approx(sub[stat][0], rel=1e-9, abs=1e-15), stat
    assert bucketed["tokens"][2] == 0
    assert np.isnan(bucketed["bias"][2]) and np.isnan(bucketed["abs_p50"][2])


def test_sequence_table_uses_per_sample_means_and_product_ratios() -> None:
    # two samples: Δ = (0.2, 0.4) and (−0.1,): means 0.3 and −0.1, sums 0.6 and −0.1
    lp_a = np.array([-1.0, -1.0, -2.0])
    lp_b = np.array([-0.8, -0.6, -2.1])
    offsets = np.array([0, 2, 2, 3])  # the middle sample is empty and does not count
    t = sequence_table(lp_a, lp_b, offsets, eps_low=0.2, eps_high=0.2)
    assert t["samples"][0] == 2
    assert t["bias"][0] == pytest.approx(0.1, abs=1e-15)
    assert t["abs_mean"][0] == pytest.approx(0.2, abs=1e-15)
    assert t["chi2_seq"][0] == pytest.approx((math.exp(1.2) + math.exp(-0.2)) / 2 - 1, rel=1e-12)
    w = [math.exp(0.6), math.exp(-0.1)]
    assert t["ess_seq"][0] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)), rel=1e-12)
    assert t["seq_sum_delta_p50"][0] == pytest.approx(0.25, abs=1e-15)
    assert t["seq_ratio_p50"][0] == pytest.approx(math.exp(0.25), rel=1e-14)
    assert "chi2_token" not in t and "abs_dprob_mean" not in t


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1001])
def test_in_place_quantiles_match_numpy_type_7(n: int) -> None:
    from pgdiag.compare.parity import _quantiles

    values = np.random.default_rng(n).normal(size=n)
    qs = [0.01, 0.5, 0.95, 0.99]
    expected = [*np.quantile(values, qs), values.max()]
    assert _quantiles(values.copy(), qs) == pytest.approx(expected, rel=1e-15, abs=1e-15)


def test_sample_level_buckets_equal_token_level_buckets() -> None:
    """step / length / env buckets reduced through per-sample sums give the token-level numbers."""
    from pgdiag.compare.parity import sample_bucket_table, sample_terms

    rng = np.random.default_rng(5)
    counts = rng.integers(0, 30, size=60)  # some samples are empty
    offsets = np.concatenate([[0], np.cumsum(counts)])
    m = int(offsets[-1])
    token_row = np.repeat(np.arange(60), counts)
    lp_a = -rng.exponential(1.0, size=m)
    lp_b = lp_a + rng.normal(0.3, 0.2, size=m)  # a large bias: the spread must not cancel
    sample_codes = rng.integers(0, 5, size=60)
    sample_codes[sample_codes == 3] = 4  # bucket 3 stays empty
    terms = token_terms(lp_a, lp_b, eps_low=0.2, eps_high=0.2)
    by_token = bucket_table(terms, sample_codes[token_row], 5)
    by_sample = sample_bucket_table(
        sample_terms(terms, offsets, token_row), terms, sample_codes, token_row, 5
    )
    assert set(by_token) == set(by_sample)
    for stat, values in by_token.items():
        np.testing.assert_allclose(by_sample[stat], values, rtol=1e-12, atol=1e-15, err_msg=stat)
    assert by_sample["tokens"][3] == 0 and np.isnan(by_sample["sd"][3])


def test_token_table_leaves_its_inputs_untouched() -> None:
    rng = np.random.default_rng(6)
    lp_a = -rng.exponential(1.0, size=2000)
    lp_b = lp_a + rng.normal(0, 0.1, size=2000)
    delta = lp_b - lp_a
    copies = (lp_a.copy(), lp_b.copy(), delta.copy())
    terms = token_terms(lp_a, lp_b, eps_low=0.2, eps_high=0.2, delta=delta)
    term_copies = {k: v.copy() for k, v in vars(terms).items() if isinstance(v, np.ndarray)}
    given = token_table(lp_a, lp_b, eps_low=0.2, eps_high=0.2, terms=terms)
    computed = token_table(lp_a, lp_b, eps_low=0.2, eps_high=0.2)
    for before, after in zip(copies, (lp_a, lp_b, delta), strict=True):
        assert np.array_equal(before, after)
    for name, before in term_copies.items():
        assert np.array_equal(before, getattr(terms, name)), name
    assert given.keys() == computed.keys()
    for stat in given:
        assert given[stat][0] == computed[stat][0] or (
            np.isnan(given[stat][0]) and np.isnan(computed[stat][0])
        )


def test_token_table_kl_sums_are_those_of_the_metrics_terms() -> None:
    """The `all` row's KL, chi-square, ESS and tmpe come from one expm1(Δ) (`metrics.terms.kl_sums`); each must be
    bit for bit the mean of the `metrics.terms` function `metrics` reduces, so both commands agree exactly.
    Δ spans exact zeros, tiny and large values (ρ up to e^30) and both signs."""
    from pgdiag.metrics import terms as t

    rng = np.random.default_rng(7)
    lp_a = -rng.exponential(2.0, size=4099)
    delta = np.concatenate([rng.normal(0, 0.02, 3000), rng.normal(0, 3.0, 1000), np.zeros(90), [30.0] * 9])
    lp_b = lp_a + delta
    delta = lp_b - lp_a  # as the pair computes it
    table = token_table(lp_a, lp_b, eps_low=0.2, eps_high=0.28, delta=delta)
    out, spare = np.empty_like(delta), np.empty_like(delta)
    n = delta.shape[0]
    assert table["chi2_token"][0] == np.sum(t.chi2(delta, out, spare)) / n
    assert table["kl_k3"][0] == np.sum(t.k3(delta, out)) / n
    assert table["kl_rev_k1"][0] == np.sum(t.rev_k1(delta, out)) / n
    assert table["kl_rev_k3"][0] == np.sum(t.rev_k3(delta, out, spare)) / n
    assert table["tmpe"][0] == np.sum(t.tmpe(delta, out, spare)) / n
    rho = t.ratio(delta, out)
    assert table["ess_token"][0] == np.sum(rho) * np.sum(rho) / (n * np.dot(rho, rho))
    assert table["kl_k1"][0] == 0.0 - np.sum(delta) / n


def test_bucket_max_is_the_max_of_each_bucket_ignoring_nan() -> None:
    """`_bucket_max` (one np.fmax.at): each bucket's max as polars' `max` gives it (NaN ignored), NaN for an
    empty bucket and for one holding only NaN."""
    from pgdiag.compare.parity import _bucket_max

    rng = np.random.default_rng(8)
    values = np.abs(rng.normal(0.0, 1.0, 5000))
    codes = rng.integers(0, 6, 5000).astype(np.intp)
    codes[codes == 2] = 3  # bucket 2 empty
    values[codes == 4] = np.nan  # bucket 4 all NaN
    values[:7] = np.nan  # a few NaN in the others
    got = _bucket_max(values, codes, 7)  # bucket 6 empty too
    for bucket in range(7):
        inside = values[codes == bucket]
        inside = inside[~np.isnan(inside)]
        if inside.size == 0:
            assert np.isnan(got[bucket]), bucket
        else:
            assert got[bucket] == inside.max(), bucket
    values[codes == 5] = -np.inf  # a −inf value: bucket 5's max, not an empty bucket
    got = _bucket_max(values, codes, 7)
    assert got[5] == -np.inf and np.isnan(got[2]) and np.isnan(got[4]) and np.isnan(got[6])
    clean = np.abs(rng.normal(0.0, 1.0, 5000))  # no NaN, no −inf: the fast path alone
    got = _bucket_max(clean, codes, 7)
    for bucket in range(7):
        inside = clean[codes == bucket]
        assert (np.isnan(got[bucket]) and inside.size == 0) or got[bucket] == inside.max(), bucket


def test_bin_counts_equal_the_binary_search_histogram() -> None:
    """The Δ histogram's counts (`pooled.bin_counts`: values below each edge, differenced) equal
    bincount(searchsorted(edges, d, "right") − 1) on the report's edges, with values on, just below and just
    above every edge, ±0, −inf and the extremes."""
    from pgdiag.compare.pair_report import DLOGP_EDGES
    from pgdiag.compare.pooled import bin_counts

    edges = np.asarray(DLOGP_EDGES)
    inner = edges[1:-1]
    rng = np.random.default_rng(9)
    for scale in (1e-7, 1e-3, 0.02, 1.0, 30.0):
        d = np.concatenate(
            [
                rng.normal(0.0, scale, 3000),
                inner,
                np.nextafter(inner, -np.inf),
                np.nextafter(inner, np.inf),
                [0.0, -0.0, 0.0, -1e300, 1e300, -np.inf],
            ]
        )
        counts, zeros = bin_counts(d, edges)
        expected = np.bincount(np.searchsorted(edges, d, side="right") - 1, minlength=edges.shape[0] - 1)
        assert counts.dtype == np.int64 and np.array_equal(counts, expected)
        assert zeros == np.count_nonzero(d == 0.0)
