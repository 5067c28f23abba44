"""The parity table of a pair of aligned streams, per scope and per bucket (metrics.md §5, data-and-cli.md §2.4).

What: for Δ = lp_b − lp_a on matched tokens, the mismatch family of metrics.md §5: bias, sd, RMS, mean |Δ|, |Δ|
quantiles and max, Pearson r and the OLS fit lp_b ≈ α + β·lp_a, the fractions of ratios outside the standard
bands, k1/k3 in both directions, mean exp|Δ| (`tmpe`), chi-square, ESS and verl's |Δp|, with units.
Why: one vectorised engine serves the `all` row and every breakdown, so a bucket's numbers are computed
exactly like the headline's. Buckets are integer codes; sums are `np.bincount` (one pass each, O(M)), spreads
subtract the bucket mean first (no subtraction of squares), quantiles (Hyndman–Fan type 7) come from one stable
sort of the codes plus `np.quantile` on each bucket's contiguous slice. Exact-zero cases stay exact: k3 uses
expm1(Δ) − Δ and chi-square expm1(2Δ), so identical streams give 0, not rounding noise.
How: `token_table` gives {metric: (K,) array} for K buckets (NaN = not computable); `sequence_table` first
reduces each sample to its mean log-probs (length-normalised, GSPO scale) and applies the same table over
samples, plus the product-ratio keys (`chi2_seq`, `ess_seq`, `seq_sum_delta_p*`, `seq_ratio_p*`), which replace
the token-only keys (`chi2_token`, `ess_token`, the probability-space ones). Without
codes (K = 1) the sums are NumPy's pairwise sums.
"""

from __future__ import annotations

import math

import numpy as np

# (lo, hi) ratio bands of mismatch/frac_out_*; `clip` takes its edges from eps_low / eps_high.
BANDS: dict[str, tuple[float, float] | None] = {
    "strict": (0.999, 1.002),
    "1pct": (0.99, 1.01),
    "10pct": (0.9, 1.1),
    "clip": None,
    "2x": (0.5, 2.0),
}
ABS_QUANTILES = {"abs_p50": 0.5, "abs_p95": 0.95, "abs_p99": 0.99}
SEQ_SUM_QUANTILES = {"p1": 0.01, "p5": 0.05, "p50": 0.5, "p95": 0.95, "p99": 0.99}

# metric stat -> (unit, reduction kind): "mean" becomes token-mean / seq-mean by scope.
UNITS: dict[str, tuple[str, str]] = {
    "bias": ("nats", "mean"),
    "sd": ("nats", "mean"),
    "rms": ("nats", "mean"),
    "abs_mean": ("nats", "mean"),
    "abs_p50": ("nats", "quantile"),
    "abs_p95": ("nats", "quantile"),
    "abs_p99": ("nats", "quantile"),
    "abs_max": ("nats", "max"),
    "pearson_r": ("1", "fit"),
    "fit_slope": ("1", "fit"),
    "fit_intercept": ("nats", "fit"),
    "fit_resid_rms": ("nats", "fit"),
    **{f"frac_out_{band}": ("fraction", "mean") for band in BANDS},
    "kl_k1": ("nats", "mean"),
    "kl_k3": ("nats", "mean"),
    "kl_rev_k1": ("nats", "mean"),
    "kl_rev_k3": ("nats", "mean"),
    "tmpe": ("ratio", "mean"),
    "chi2_token": ("1", "mean"),
    "ess_token": ("1", "mean"),
    "abs_dprob_mean": ("prob", "mean"),
    "abs_dprob_p99": ("prob", "quantile"),
    "abs_dprob_max": ("prob", "max"),
    "prob_pearson_r": ("1", "fit"),
    "chi2_seq": ("1", "mean"),
    "ess_seq": ("1", "mean"),
    **{f"seq_sum_delta_{q}": ("nats", "quantile") for q in SEQ_SUM_QUANTILES},
    **{f"seq_ratio_{q}": ("ratio", "quantile") for q in SEQ_SUM_QUANTILES},
    "tau_fit": ("1", "fit"),
    "tau_fit_rms": ("nats", "fit"),
    "tau_hint": ("1", "fit"),
    "first_token_ratio": ("ratio", "mean"),
    "tokens": ("count", "sum"),
    "samples": ("count", "sum"),
    "abs_delta_gt_20": ("count", "sum"),
}


def unit_and_reduction(stat: str, scope: str) -> tuple[str, str]:
    """(unit, reduction) of `mismatch/<stat>` at `scope` ("token" or "sequence")."""
    unit, kind = UNITS[stat]
    if kind == "mean":
        kind = "token-mean" if scope == "token" else "seq-mean"
    return unit, kind


def _sum(x: np.ndarray, codes: np.ndarray | None, k: int) -> np.ndarray:
    """(K,) sums of x per bucket; pairwise `np.sum` when there is a single bucket."""
    if codes is None:
        return np.array([np.sum(x)], dtype=np.float64)
    return np.bincount(codes, weights=x, minlength=k)


def _expand(per_bucket: np.ndarray, codes: np.ndarray | None) -> np.ndarray | float:
    return per_bucket[0] if codes is None else per_bucket[codes]


def bucket_order(codes: np.ndarray | None, k: int) -> tuple[np.ndarray | None, np.ndarray]:
    """Stable order that groups tokens by bucket (None for one bucket) and the (K + 1,) bucket starts."""
    if codes is None:
        return None, np.array([0], dtype=np.int64)
    order = np.argsort(codes, kind="stable")
    starts = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.bincount(codes, minlength=k), out=starts[1:])
    return order, starts


def bucket_quantiles(
    values: np.ndarray, order: np.ndarray | None, starts: np.ndarray, qs: list[float]
) -> np.ndarray:
    """(K, len(qs)) type-7 quantiles and (K,) max appended as the last column; NaN for empty buckets."""
    if order is None:
        if values.size == 0:
            return np.full((1, len(qs) + 1), np.nan)
        return np.concatenate([np.quantile(values, qs), [np.max(values)]])[None, :]
    grouped = values[order]
    k = starts.shape[0] - 1
    out = np.full((k, len(qs) + 1), np.nan)
    for bucket in range(k):
        lo, hi = starts[bucket], starts[bucket + 1]
        if hi > lo:
            segment = grouped[lo:hi]
            out[bucket, :-1] = np.quantile(segment, qs)
            out[bucket, -1] = segment.max()
    return out


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = num / den
    return np.where(den > 0, out, np.nan)


def token_table(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    *,
    eps_low: float,
    eps_high: float,
    codes: np.ndarray | None = None,
    n_buckets: int = 1,
    full: bool = True,
) -> dict[str, np.ndarray]:
    """{stat: (K,) float64} over the tokens of each bucket (NaN = not computable) plus "tokens".

    `codes` (M,) int in [0, K) assigns tokens to buckets; None = one bucket. `full=False` skips the probability
    statistics and the |Δp| quantiles (the breakdown set).
    """
    k = 1 if codes is None else n_buckets
    d = lp_b - lp_a  # (M,)
    abs_d = np.abs(d)
    n = np.bincount(codes, minlength=k).astype(np.float64) if codes is not None else np.array([float(d.size)])
    out: dict[str, np.ndarray] = {"tokens": n}

    # 1. moments of Δ (spread around the bucket mean, never as a difference of squares)
    bias = _safe_div(_sum(d, codes, k), n)
    dev = d - _expand(np.nan_to_num(bias), codes)
    out["bias"] = bias
    out["sd"] = np.sqrt(_safe_div(_sum(dev * dev, codes, k), n))
    out["rms"] = np.sqrt(_safe_div(_sum(d * d, codes, k), n))
    out["abs_mean"] = _safe_div(_sum(abs_d, codes, k), n)

    # 2. quantiles and max of |Δ|
    order, starts = bucket_order(codes, k)
    quant = bucket_quantiles(abs_d, order, starts, list(ABS_QUANTILES.values()))
    for j, name in enumerate(ABS_QUANTILES):
        out[name] = quant[:, j]
    out["abs_max"] = quant[:, -1]

    # 3. correlation and OLS fit lp_b ≈ α + β·lp_a (centred sums)
    out.update(_fit(lp_a, lp_b, codes, k, n))

    # 4. band fractions: ratio outside [lo, hi] tested on Δ
    for band, edges in BANDS.items():
        lo, hi = edges if edges is not None else (1.0 - eps_low, 1.0 + eps_high)
        log_lo = math.log(lo) if lo > 0 else -math.inf
        outside = (d < log_lo) | (d > math.log(hi))
        out[f"frac_out_{band}"] = _safe_div(_sum(outside.astype(np.float64), codes, k), n)

    # 5. KL estimators, tmpe, chi-square, ESS (ρ = e^Δ; exact zeros for Δ = 0)
    with np.errstate(over="ignore", invalid="ignore"):
        em1 = np.expm1(d)  # ρ − 1
        rho = em1 + 1.0
        out["kl_k1"] = 0.0 - bias
        out["kl_k3"] = _safe_div(_sum(em1 - d, codes, k), n)
        out["kl_rev_k1"] = _safe_div(_sum(rho * d, codes, k), n)
        out["kl_rev_k3"] = _safe_div(_sum(rho * d - em1, codes, k), n)
        out["tmpe"] = _safe_div(_sum(np.exp(abs_d), codes, k), n)
        out["chi2_token"] = _safe_div(_sum(np.expm1(2.0 * d), codes, k), n)
        sum_rho = _sum(rho, codes, k)
        out["ess_token"] = _safe_div(sum_rho * sum_rho, n * _sum(rho * rho, codes, k))

    # 6. probability space (verl |Δp|)
    p_a, p_b = np.exp(lp_a), np.exp(lp_b)
    abs_dp = np.abs(p_b - p_a)
    out["abs_dprob_mean"] = _safe_div(_sum(abs_dp, codes, k), n)
    out["abs_delta_gt_20"] = _sum((abs_d > 20.0).astype(np.float64), codes, k)
    if full:
        q = bucket_quantiles(abs_dp, order, starts, [0.99])
        out["abs_dprob_p99"], out["abs_dprob_max"] = q[:, 0], q[:, 1]
        out["prob_pearson_r"] = _fit(p_a, p_b, codes, k, n)["pearson_r"]
    return out


def _fit(
    x: np.ndarray, y: np.ndarray, codes: np.ndarray | None, k: int, n: np.ndarray
) -> dict[str, np.ndarray]:
    """Pearson r and the OLS fit y ≈ α + β·x per bucket, on centred sums."""
    mean_x = _safe_div(_sum(x, codes, k), n)
    mean_y = _safe_div(_sum(y, codes, k), n)
    cx = x - _expand(np.nan_to_num(mean_x), codes)
    cy = y - _expand(np.nan_to_num(mean_y), codes)
    sxx, syy, sxy = _sum(cx * cx, codes, k), _sum(cy * cy, codes, k), _sum(cx * cy, codes, k)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where((sxx > 0) & (syy > 0), sxy / np.sqrt(sxx * syy), np.nan)
        slope = np.where(sxx > 0, sxy / sxx, np.nan)
    intercept = mean_y - slope * mean_x
    resid = cy - _expand(np.nan_to_num(slope), codes) * cx
    resid_rms = np.where(np.isfinite(slope), np.sqrt(_safe_div(_sum(resid * resid, codes, k), n)), np.nan)
    return {"pearson_r": r, "fit_slope": slope, "fit_intercept": intercept, "fit_resid_rms": resid_rms}


def sequence_means(
    lp_a: np.ndarray, lp_b: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per non-empty sample: (mean lp_a, mean lp_b, Σ Δ, rows) — the inputs of the sequence scope."""
    counts = np.diff(offsets)
    rows = np.flatnonzero(counts > 0)
    starts = offsets[:-1][rows]
    if rows.size == 0:
        empty = np.zeros(0)
        return empty, empty, empty, rows
    sum_a = np.add.reduceat(lp_a, starts)
    sum_b = np.add.reduceat(lp_b, starts)
    sum_d = np.add.reduceat(lp_b - lp_a, starts)
    n = counts[rows].astype(np.float64)
    return sum_a / n, sum_b / n, sum_d, rows


def sequence_table(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    offsets: np.ndarray,
    *,
    eps_low: float,
    eps_high: float,
) -> dict[str, np.ndarray]:
    """The token table over samples (one value per non-empty sample) plus the product-ratio keys; K = 1."""
    mean_a, mean_b, sum_d, rows = sequence_means(lp_a, lp_b, offsets)
    out = token_table(mean_a, mean_b, eps_low=eps_low, eps_high=eps_high)
    out["samples"] = out.pop("tokens")
    for token_only in (
        "abs_delta_gt_20",
        "abs_dprob_mean",
        "abs_dprob_p99",
        "abs_dprob_max",
        "prob_pearson_r",
        "chi2_token",
        "ess_token",
    ):
        out.pop(token_only)
    s = float(rows.size)
    with np.errstate(over="ignore"):
        out["chi2_seq"] = np.array([np.mean(np.expm1(2.0 * sum_d)) if s else np.nan])
    if s:
        lse = _logsumexp(sum_d)
        out["ess_seq"] = np.array([math.exp(2.0 * lse - math.log(s) - _logsumexp(2.0 * sum_d))])
        qs = np.quantile(sum_d, list(SEQ_SUM_QUANTILES.values()))
    else:
        out["ess_seq"] = np.array([np.nan])
        qs = np.full(len(SEQ_SUM_QUANTILES), np.nan)
    for j, name in enumerate(SEQ_SUM_QUANTILES):
        out[f"seq_sum_delta_{name}"] = np.array([qs[j]])
        with np.errstate(over="ignore"):
            out[f"seq_ratio_{name}"] = np.array([np.exp(qs[j])])
    return out


def _logsumexp(x: np.ndarray) -> float:
    top = float(np.max(x))
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(x - top))))
