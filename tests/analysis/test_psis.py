"""PSIS k̂ against arviz's `psislw` on identical input (1e-6), and the sample-size threshold."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pgdiag.analysis.psis import khat_threshold, min_sample_size, psis_khat

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import arviz


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("heavy: Student t, 2 dof", lambda rng: rng.standard_t(2, 256)),
        ("heavy: log Pareto", lambda rng: np.log(rng.pareto(0.8, 1000) + 1)),
        ("light: normal 0.3", lambda rng: rng.normal(0, 0.3, 256)),
        ("light: sequence sums", lambda rng: rng.normal(-0.01, 0.05, (64, 300)).sum(axis=1)),
    ],
)
def test_khat_matches_arviz(name, make):
    log_w = make(np.random.default_rng(7))
    _, k_arviz = arviz.psislw(log_w.copy())
    assert psis_khat(log_w) == pytest.approx(float(k_arviz), abs=1e-6), name


def test_too_few_points_give_no_estimate():
    # S = 12: tail ceil(min(2.4, 10.4)) = 3 points <= 4: arviz returns inf
    log_w = np.random.default_rng(0).normal(size=12)
    _, k_arviz = arviz.psislw(log_w.copy())
    assert np.isinf(k_arviz) and psis_khat(log_w) is None


def test_threshold_and_min_sample_size():
    assert khat_threshold(256) == pytest.approx(1 - 1 / np.log10(256))  # 0.5847
    assert khat_threshold(256) == pytest.approx(0.5847, abs=1e-4)
    assert khat_threshold(10**6) == 0.7
    assert min_sample_size(0.5) == pytest.approx(100.0)
    assert min_sample_size(1.2) is None
