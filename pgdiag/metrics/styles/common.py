"""The arithmetic the framework key styles share (docs/key-styles.md): guarded means, clamps, exp, values.

What: every style reads the same flat token arrays of one step (`pgdiag.metrics.styles.inputs`) and reduces
them with its framework's own denominator guard. This module gives each guard a name
(`mean_eps` for verl's ``Σ m x / (Σ m + 1e-8)``, `mean_guard` for the ``max(Σ m, 1)`` of TRL, Liger, miles
and Fast-LLM, `sample_mean_guard` for miles' ``SM``, `document_mean` for Fast-LLM's per-document weights),
and the clamps and exponentials their losses share; which flags a style accepts is `styles.flags`.

Why: the guards, clamps and reductions are exactly where the frameworks disagree (docs/key-styles.md), so they
live in one place with one name each, and the style modules read like the tables of docs/key-styles.md.

How: all arithmetic is float64 numpy over the flat (M,) token arrays of `TokenBatch`; per-sample sums use
`np.bincount` on `TokenBatch.token_sample()`. Only loss positions are in a batch, so ``m = 1`` on every
token and ``Σ m = M``. Non-finite inputs propagate as the framework propagates them; a NaN result becomes
``None`` in `MetricValue`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.styles.inputs import StyleInputs


def div(num: float, den: float) -> float:
    """num / den with torch's semantics: x/0 = ±inf, 0/0 = NaN (never a Python ZeroDivisionError)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(num) / np.float64(den))


def div_array(num: np.ndarray, den: np.ndarray, *, empty: float) -> np.ndarray:
    """Elementwise num / den where den > 0, `empty` where den == 0."""
    out = np.full(num.shape, empty, dtype=np.float64)
    nonzero = den > 0
    out[nonzero] = num[nonzero] / den[nonzero]
    return out


def total(x: np.ndarray) -> float:
    """Σ x in float64 (numpy pairwise summation)."""
    return float(np.sum(x, dtype=np.float64))


def mean_eps(x: np.ndarray, eps: float = 1e-8) -> float:
    """verl `masked_mean`: Σ m x / (Σ m + 1e-8); 0 on an empty step."""
    return div(total(x), x.shape[0] + eps)


def mean_guard(x: np.ndarray) -> float:
    """TRL/Liger/miles/Fast-LLM token mean: Σ m x / max(Σ m, 1); 0 on an empty step."""
    return div(total(x), max(x.shape[0], 1))


def sample_mean_guard(inputs: StyleInputs, x: np.ndarray) -> float:
    """miles `SM(x)` = (1/S) Σ_i Σ_t m x / max(N_i, 1): empty samples add 0 and count in S."""
    per_sample = inputs.sample_sum(x) / np.maximum(inputs.n_loss, 1)  # (S,)
    return div(total(per_sample), inputs.n_samples)


def extremum(x: np.ndarray, kind: str) -> float | None:
    """max or min over the step's tokens; None when there are none (the frameworks raise or log nothing)."""
    if x.shape[0] == 0:
        return None
    return float(np.max(x) if kind == "max" else np.min(x))


def clip_ratio(r: np.ndarray, eps_low: float, eps_high: float) -> np.ndarray:
    """clip(r) = min(max(r, 1 − ε_l), 1 + ε_h), NaN kept (torch.clamp semantics)."""
    return np.clip(r, 1.0 - eps_low, 1.0 + eps_high)


def ppo_token_loss(ratio: np.ndarray, adv: np.ndarray, eps_low: float, eps_high: float) -> np.ndarray:
    """ℓ = max(−A r, −A clip(r)) per token (docs/metrics.md), NaN propagated as torch.maximum does."""
    return np.maximum(-adv * ratio, -adv * clip_ratio(ratio, eps_low, eps_high))


def k3_ref(lp_ref: np.ndarray, lp_new: np.ndarray) -> np.ndarray:
    """TRL/Liger reference KL per token: e^(lp_ref − lp_new) − (lp_ref − lp_new) − 1, unclamped."""
    x = lp_ref - lp_new
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(x) - x - 1.0


def exp(x: np.ndarray) -> np.ndarray:
    """np.exp without overflow warnings (an overflow is +inf, as in torch)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(x)


def value(key: str, v: float | None, unit: str, reduction: str, n: int) -> MetricValue:
    """A `MetricValue` with the value cast to a Python float (NaN becomes None in `MetricValue`)."""
    return MetricValue(key, None if v is None else float(v), unit, reduction, int(n))
