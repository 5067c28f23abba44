"""Mismatch family of design/metrics.md §5: how the evaluated side b disagrees with the sampling side a.

Definitions on the tokens valid for the pair (m ∧ finite(lp_a) ∧ finite(lp_b)):
    Δ_t = lp_b − lp_a,   ρ_t = exp(Δ_t) = π_b / π_a  (π_train / π_rollout with the default pair),
    δ̄^Δ_i = Σ_t Δ / N_i (GSPO scale),   Σ_t Δ = log of the sequence importance ratio.
A bit-identical recompute gives Δ = 0 everywhere: bias, sd, every KL and every `frac_out_*` are 0, both
ESS are 1. Typical healthy bf16 engine-vs-trainer pairs show `abs_mean` around 1e-3 to 1e-2 nats.

Why so many views of one Δ: frameworks and papers gate on different ones (verl `rollout_corr/k3_kl`,
NeMo-RL `token_mult_prob_error`, probability differences, sequence IS ratios). All are computed from Δ and
ρ once; nothing is clamped, `|Δ| > 20` is counted.

The best-fit temperature needs side b's logits, which only `pgdiag logprobs` sees: the metric keys are null
here (`status = needs_recompute`) and `fit_temperature` is the pure function the recompute path calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pgdiag.errors import InvalidInputError
from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.reduce import (
    TokenReducer,
    ess_from_log_weights,
    ess_from_weights,
    extremum,
    fraction,
    linear_fit,
    plain_mean,
    plain_sd,
    quantiles,
)
from pgdiag.metrics.settings import MetricSettings

SEQ_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
TAU_RANGE = (0.05, 20.0)
TAU_GRID_POINTS = 200
TAU_LOG_TOL = 1e-6


def mismatch_bands(settings: MetricSettings) -> tuple[tuple[str, float, float], ...]:
    """The five ρ bands of `frac_out_*`: (name, low, high)."""
    return (
        ("strict", 0.999, 1.002),
        ("1pct", 0.99, 1.01),
        ("10pct", 0.9, 1.1),
        ("clip", 1.0 - settings.eps_low, 1.0 + settings.eps_high),
        ("2x", 0.5, 2.0),
    )


def add_mismatch_counts(lp_a: np.ndarray, lp_b: np.ndarray, valid: np.ndarray, sink: MetricSink) -> None:
    """`count/mismatch_*` over every loss position (M,): valid tokens, invalid ones, |Δ| > 20."""
    n_positions = lp_a.shape[0]
    n_valid = int(np.count_nonzero(valid))
    with np.errstate(invalid="ignore"):
        big = int(np.count_nonzero(np.abs(lp_b - lp_a) > 20.0))
    sink.add("count/mismatch_tokens", n_valid, n_positions)
    sink.add("count/mismatch_invalid", n_positions - n_valid, n_positions)
    sink.add("count/mismatch_abs_delta_gt_20", big, n_positions)


def add_mismatch_metrics(
    lp_a: np.ndarray, lp_b: np.ndarray, reducer: TokenReducer, settings: MetricSettings, sink: MetricSink
) -> None:
    """Every `mismatch/*` key of §5 from the valid tokens (N,) of the pair; `tau_fit*` are null (no logits)."""
    red = reducer
    n_tok, n_red = red.n_tokens, red.population
    ne = red.nonempty
    n_seq = red.n_nonempty
    delta = lp_b - lp_a  # (N,)
    abs_delta = np.abs(delta)
    with np.errstate(over="ignore", invalid="ignore"):
        rho = np.exp(delta)  # (N,)
        # 1. location and spread of Δ
        sink.add("mismatch/bias", red.mean(delta), n_red)
        sink.add("mismatch/sd", red.spread(delta), n_red)
        mean_sq = red.mean(delta * delta)
        sink.add("mismatch/rms", None if mean_sq is None else math.sqrt(mean_sq), n_red)
        sink.add("mismatch/abs_mean", red.mean(abs_delta), n_red)
        p50, p95, p99 = quantiles(abs_delta, (0.5, 0.95, 0.99))
        sink.add("mismatch/abs_p50", p50, n_tok)
        sink.add("mismatch/abs_p95", p95, n_tok)
        sink.add("mismatch/abs_p99", p99, n_tok)
        sink.add("mismatch/abs_max", extremum(abs_delta, "max"), n_tok)
        fit = linear_fit(lp_a, lp_b)
        sink.add("mismatch/pearson_r", fit.pearson_r, n_tok)
        sink.add("mismatch/fit_slope", fit.slope, n_tok)
        sink.add("mismatch/fit_intercept", fit.intercept, n_tok)
        sink.add("mismatch/fit_resid_rms", fit.resid_rms, n_tok)
        # 2. band fractions, token and sequence level (tested on Δ against ln of the band edges)
        sum_delta = red.sample_sums(delta)  # (S,)
        mean_delta = sum_delta[ne] / red.n_per_sample[ne]  # (S+,)
        for name, low, high in mismatch_bands(settings):
            log_low, log_high = math.log(low), math.log(high)
            sink.add(f"mismatch/frac_out_{name}", red.mean((delta < log_low) | (delta > log_high)), n_red)
            seq_out = (mean_delta < log_low) | (mean_delta > log_high)
            sink.add(f"mismatch/seq_frac_out_{name}", fraction(seq_out), n_seq)
        # 3. KL estimators and moments of ρ
        sink.add("mismatch/kl_k1", None if (m := red.mean(delta)) is None else -m, n_red)
        sink.add("mismatch/kl_k3", red.mean(rho - 1.0 - delta), n_red)
        sink.add("mismatch/kl_rev_k1", red.mean(rho * delta), n_red)
        sink.add("mismatch/kl_rev_k3", red.mean(1.0 + rho * (delta - 1.0)), n_red)
        sink.add("mismatch/tmpe", red.mean(np.exp(abs_delta)), n_red)
        rho_sq_mean = red.mean(rho * rho)
        sink.add("mismatch/chi2_token", None if rho_sq_mean is None else rho_sq_mean - 1.0, n_red)
        seq_sum = sum_delta[ne]  # (S+,)
        sink.add("mismatch/chi2_seq", None if n_seq == 0 else plain_mean(np.exp(2.0 * seq_sum)) - 1.0, n_seq)
        sink.add("mismatch/ess_token", ess_from_weights(rho), n_tok)
        sink.add("mismatch/ess_seq", ess_from_log_weights(seq_sum), n_seq)
        # 4. probability space
        prob_a, prob_b = np.exp(lp_a), np.exp(lp_b)
        abs_dprob = np.abs(prob_b - prob_a)
        sink.add("mismatch/abs_dprob_mean", red.mean(abs_dprob), n_red)
        sink.add("mismatch/abs_dprob_p99", quantiles(abs_dprob, (0.99,))[0], n_tok)
        sink.add("mismatch/abs_dprob_max", extremum(abs_dprob, "max"), n_tok)
        sink.add("mismatch/prob_pearson_r", linear_fit(prob_a, prob_b).pearson_r, n_tok)
        # 5. sequence level
        sink.add("mismatch/seq_mean_delta_mean", plain_mean(mean_delta), n_seq)
        sink.add("mismatch/seq_mean_delta_sd", plain_sd(mean_delta), n_seq)
        sink.add("mismatch/seq_mean_delta_absmax", extremum(np.abs(mean_delta), "max"), n_seq)
        qs = tuple(q for _, q in SEQ_QUANTILES)
        for (name, _), value in zip(SEQ_QUANTILES, quantiles(seq_sum, qs), strict=True):
            sink.add(f"mismatch/seq_sum_delta_{name}", value, n_seq)
            sink.add(f"mismatch/seq_ratio_{name}", None if value is None else math.exp(value), n_seq)
    sink.add("mismatch/tau_fit", None, n_tok)
    sink.add("mismatch/tau_fit_rms", None, n_tok)


@dataclass(frozen=True)
class TemperatureFit:
    """Best-fit temperature τ* of §5 and the RMS residual (nats) at τ*; None for no tokens."""

    tau: float | None
    rms: float | None
    n: int


def tempered_logprobs(target_logits: np.ndarray, logits: np.ndarray, tau: float) -> np.ndarray:
    """(M,) lp_b(τ) = z[y]/τ − logsumexp(z/τ) from the target logits (M,) and the full logits (M, V)."""
    scaled = logits / tau  # (M, V)
    top = np.max(scaled, axis=1)  # (M,)
    scaled -= top[:, None]
    np.exp(scaled, out=scaled)
    return target_logits / tau - (top + np.log(np.sum(scaled, axis=1)))


def fit_temperature(target_logits: np.ndarray, logits: np.ndarray, lp_a: np.ndarray) -> TemperatureFit:
    """τ* = argmin over τ ∈ [0.05, 20] of Σ_t (lp_b(τ)_t − lp_a,t)², with its RMS residual.

    Inputs are float64 over the M masked tokens: `target_logits` (M,) z_t[y_t], `logits` (M, V) side b's
    logits after the model's own soft-cap and logit scale, `lp_a` (M,) the sampling side's log-probs.
    Search: the 200-point log-spaced grid over [0.05, 20], then golden-section refinement of ln τ inside
    the grid neighbours of the best point until the bracket is below 1e-6 in ln τ.
    Reading: τ* ≈ 0.7 means the sampling side looks like b's logits divided by 0.7.
    """
    m = lp_a.shape[0]
    if target_logits.shape != (m,) or logits.ndim != 2 or logits.shape[0] != m:
        raise ValueError(
            f"shapes must be (M,), (M, V), (M,); got {target_logits.shape}, {logits.shape}, {lp_a.shape}"
        )
    if m == 0:
        return TemperatureFit(None, None, 0)
    if not (np.all(np.isfinite(logits)) and np.all(np.isfinite(target_logits)) and np.all(np.isfinite(lp_a))):
        raise InvalidInputError(
            "E207", "fit_temperature: logits and log-probs must be finite on the fitted tokens", None
        )

    def sq_error(log_tau: float) -> float:
        resid = tempered_logprobs(target_logits, logits, math.exp(log_tau)) - lp_a
        return float(np.sum(resid * resid))

    grid = np.linspace(math.log(TAU_RANGE[0]), math.log(TAU_RANGE[1]), TAU_GRID_POINTS)
    errors = [sq_error(float(u)) for u in grid]
    best = int(np.argmin(errors))
    lo = float(grid[max(best - 1, 0)])
    hi = float(grid[min(best + 1, TAU_GRID_POINTS - 1)])
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
    f1, f2 = sq_error(x1), sq_error(x2)
    while hi - lo > TAU_LOG_TOL:
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - inv_phi * (hi - lo)
            f1 = sq_error(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + inv_phi * (hi - lo)
            f2 = sq_error(x2)
    candidates = [(errors[best], float(grid[best])), (f1, x1), (f2, x2)]
    err, log_tau = min(candidates)
    return TemperatureFit(math.exp(log_tau), math.sqrt(err / m), m)
