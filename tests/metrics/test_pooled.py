"""The pooled quantile summary: exact below its limit, within its documented bound above it, mergeable."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pgdiag.errors import UsageError
from pgdiag.metrics.pooled import QuantileSettings, QuantileSummary, TokenExtrema, extremum_of, quantiles_of
from pgdiag.metrics.reduce import extremum, quantiles

QS = (0.0, 0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999, 1.0)
ALPHA = 1e-4
SKETCH = QuantileSettings(exact_limit=0, relative_error=ALPHA)


def heavy_tailed(rng: np.random.Generator, n: int) -> np.ndarray:
    """Signed Student-t(1.5) values times a log-uniform scale, with some exact zeros."""
    x = rng.standard_t(1.5, n) * np.exp(rng.uniform(-20, 20, n))
    x[rng.random(n) < 0.01] = 0.0
    return x


def summary_of(parts: list[np.ndarray], settings: QuantileSettings) -> QuantileSummary:
    summary = QuantileSummary(settings)
    for part in parts:
        summary.add(part)
    return summary


def order_statistic_bound(x: np.ndarray, q: float) -> float:
    """α·((1 − t)|a| + t|b|) for the type-7 interpolation of q between order statistics a and b."""
    ordered = np.sort(x)
    h = (x.shape[0] - 1) * q
    lo, hi = math.floor(h), math.ceil(h)
    t = h - lo
    return ALPHA * ((1.0 - t) * abs(ordered[lo]) + t * abs(ordered[hi])) * (1.0 + 1e-9)


def test_exact_below_the_limit_equals_reduce_quantiles_on_the_concatenation():
    rng = np.random.default_rng(1)
    parts = [heavy_tailed(rng, n) for n in (1000, 1, 0, 70_000, 300_000)]  # 371,001 > the bracketing size
    summary = summary_of(parts, QuantileSettings(exact_limit=371_001))
    assert summary.is_exact
    pooled = np.concatenate(parts)
    assert summary.quantiles(QS) == quantiles(pooled, QS)
    assert quantiles_of(summary, QS) == quantiles_of(pooled, QS)
    assert summary.extremum("min") == extremum(pooled, "min")
    assert summary.extremum("max") == extremum(pooled, "max")


def test_past_the_limit_it_sketches_within_the_documented_bound():
    rng = np.random.default_rng(2)
    parts = [heavy_tailed(rng, 50_000) for _ in range(4)]
    summary = summary_of(parts, QuantileSettings(exact_limit=100_000, relative_error=ALPHA))
    assert not summary.is_exact
    pooled = np.concatenate(parts)
    exact = quantiles(pooled, QS)
    for q, got, want in zip(QS, summary.quantiles(QS), exact, strict=True):
        assert abs(got - want) <= order_statistic_bound(pooled, q), q
    assert summary.quantiles((0.0, 1.0)) == [pooled.min(), pooled.max()]  # the ends are exact
    assert summary.extremum("max") == pooled.max()
    # and the bound is not vacuous: the sketch is not exact on this data
    assert summary.quantiles(QS) != exact


def test_sketch_bound_on_every_rank_of_a_small_array():
    rng = np.random.default_rng(3)
    x = heavy_tailed(rng, 2001)
    summary = QuantileSummary.of(x, SKETCH)
    ordered = np.sort(x)
    qs = tuple(k / 2000 for k in range(2001))  # every order statistic exactly
    for k, got in enumerate(summary.quantiles(qs)):
        assert abs(got - ordered[k]) <= ALPHA * abs(ordered[k]) * (1 + 1e-9), k


def test_infinities_zero_all_equal_and_single_value():
    x = np.array([-math.inf, -2.0, 0.0, 0.0, 3.0, math.inf, math.inf])
    summary = QuantileSummary.of(x, SKETCH)
    got = summary.quantiles((0.0, 0.5, 1.0, 1 / 6, 5 / 6))
    assert got[0] == -math.inf and got[2] == math.inf and got[4] == math.inf
    assert got[1] == 0.0
    assert got[3] == pytest.approx(-2.0, rel=ALPHA)
    # between −inf and a finite order statistic: the same lerp as reduce.quantiles
    for q in (0.5 / 6, 0.1 / 6):
        assert summary.quantiles((q,)) == quantiles(x, (q,))
    assert summary.extremum("min") == -math.inf and summary.extremum("max") == math.inf
    same = QuantileSummary.of(np.full(1000, -0.37), SKETCH)
    assert same.quantiles(QS) == [-0.37] * len(QS)  # clamped to the exact min = max
    single = QuantileSummary.of(np.array([5e-324]), SKETCH)
    assert single.quantiles((0.5,)) == [5e-324]
    huge = QuantileSummary.of(np.array([1.7e308, 1.7e308, -1.7e308]), SKETCH)
    assert huge.quantiles((0.0, 1.0)) == [-1.7e308, 1.7e308]
    assert QuantileSummary(SKETCH).quantiles((0.5,)) == [None]
    assert QuantileSummary().extremum("min") is None


def test_merge_is_associative_and_equals_one_summary_of_the_union():
    rng = np.random.default_rng(4)
    a, b, c = (heavy_tailed(rng, n) for n in (3000, 5000, 7000))
    for settings in (QuantileSettings(exact_limit=9000, relative_error=ALPHA), SKETCH):
        sa, sb, sc = (QuantileSummary.of(x, settings) for x in (a, b, c))
        left, right = sa.merge(sb).merge(sc), sa.merge(sb.merge(sc))
        union = QuantileSummary.of(np.concatenate([c, a, b]), settings)
        assert left.quantiles(QS) == right.quantiles(QS) == union.quantiles(QS)
        assert left.is_exact == right.is_exact == union.is_exact == (settings.exact_limit >= 15000)
        assert left.n == 15000 and (left.min, left.max) == (union.min, union.max)
        assert sa.quantiles(QS) == QuantileSummary.of(a, settings).quantiles(QS)  # merge leaves inputs alone
    exact_parts = QuantileSettings(exact_limit=9000, relative_error=ALPHA)
    sa, sb = QuantileSummary.of(a, exact_parts), QuantileSummary.of(b, exact_parts)
    assert sa.merge(sb).is_exact and sa.merge(sb).quantiles(QS) == quantiles(np.concatenate([a, b]), QS)


def test_token_extrema_and_dispatch():
    x = np.array([0.5, 2.0, math.inf])
    pooled = TokenExtrema.of(x[:1]).merge(TokenExtrema.of(x[1:])).merge(TokenExtrema.of(np.zeros(0)))
    assert (pooled.n, extremum_of(pooled, "min"), extremum_of(pooled, "max")) == (3, 0.5, math.inf)
    assert extremum_of(x, "min") == 0.5
    assert TokenExtrema().extremum("max") is None


def test_settings_are_checked():
    with pytest.raises(UsageError):
        QuantileSettings(relative_error=0.0)
    with pytest.raises(UsageError):
        QuantileSettings(exact_limit=-1)
