"""Pareto-smoothed importance sampling: the tail index k̂ of a set of importance weights (docs/whatif.md).

Vehtari, Simpson, Gelman, Yao, Gabry (2024), "Pareto smoothed importance sampling", JMLR 25(72), as arviz 0.23
implements it (`arviz.psislw`, `_psislw`, `_gpdfit`; relative efficiency 1): the tail is the
ceil(min(S/5, 3·√S)) largest log weights (above the cut-off order statistic); a tail of 4 points or fewer cannot
be fitted (k̂ = None here, inf in arviz); the generalised Pareto shape is the empirical-Bayes estimate of Zhang &
Stephens (2009) with the weakly informative prior (n·k + 10·0.5)/(n + 10).

The estimate is reliable when k̂ <= min(1 − 1/log10 S, 0.7) (0.58 at S = 256), and the sample size needed for a
given k̂ < 1 is 10^(1/(1 − k̂)) (the paper's eq. for the minimum S).
"""

from __future__ import annotations

import math

import numpy as np


def _gpd_shape(tail: np.ndarray) -> float:
    """Empirical-Bayes generalised Pareto shape k of the ascending exceedances `tail` (n,), n >= 5."""
    n = tail.shape[0]
    m_est = 30 + int(n**0.5)
    b = 1 - np.sqrt(m_est / (np.arange(1, m_est + 1, dtype=np.float64) - 0.5))
    b /= 3 * tail[int(n / 4 + 0.5) - 1]
    b += 1 / tail[-1]
    k = np.log1p(-b[:, None] * tail).mean(axis=1)  # (m_est,)
    len_scale = n * (np.log(-(b / k)) - k - 1)
    with np.errstate(over="ignore"):  # an overflowing term gives weight 0, as in arviz
        weights = 1 / np.exp(len_scale - len_scale[:, None]).sum(axis=1)
    real = weights >= 10 * np.finfo(float).eps
    weights, b = weights[real], b[real]
    weights /= weights.sum()
    b_post = float(np.sum(b * weights))
    k_post = float(np.log1p(-b_post * tail).mean())
    return (n * k_post + 10 * 0.5) / (n + 10)


def psis_khat(log_weights: np.ndarray) -> float | None:
    """k̂ of the importance weights exp(log_weights) (S,); None when S is too small to fit a tail of 5 points or a
    log weight is not finite."""
    x = np.asarray(log_weights, dtype=np.float64)
    s = x.shape[0]
    if s < 2 or not np.all(np.isfinite(x)):
        return None
    x = x - np.max(x)
    tail_len = math.ceil(min(s / 5.0, 3 * math.sqrt(s)))
    order = np.sort(x)
    cutoff = max(order[-tail_len - 1], math.log(np.finfo(float).tiny))
    tail = x[x > cutoff]
    if tail.shape[0] <= 4:
        return None
    exceed = np.sort(np.exp(tail) - math.exp(cutoff))
    k = _gpd_shape(exceed)
    return k if math.isfinite(k) else None


def khat_threshold(n: int) -> float | None:
    """min(1 − 1/log10 S, 0.7): k̂ above it makes the importance-sampling estimate unreliable at S samples."""
    if n < 11:  # log10 S <= 1: the formula gives <= 0, no k̂ is good enough
        return None
    return min(1.0 - 1.0 / math.log10(n), 0.7)


def min_sample_size(khat: float | None) -> float | None:
    """10^(1/(1 − k̂)): the sample size at which k̂ would be reliable; None (infinite) for k̂ >= 1."""
    if khat is None or khat >= 1:
        return None
    return 10 ** (1.0 / (1.0 - max(khat, 0.0)))
