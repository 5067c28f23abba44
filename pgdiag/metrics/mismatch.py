"""Mismatch family of docs/metrics.md: how the evaluated side b disagrees with the sampling side a.

Definitions on the tokens valid for the pair (m ∧ finite(lp_a) ∧ finite(lp_b)):
    Δ_t = lp_b − lp_a,   ρ_t = exp(Δ_t) = π_b / π_a  (π_train / π_rollout with the default pair),
    δ̄^Δ_i = Σ_t Δ / N_i (GSPO scale),   Σ_t Δ = log of the sequence importance ratio.
A bit-identical recompute gives Δ = 0 everywhere: bias, sd, every KL and every `frac_out_*` are 0, both
ESS are 1. The `recommended` gate profile warns at `abs_mean` > 0.01 nats and fails at > 0.02
(docs/cli.md).

Why so many views of one Δ: frameworks and papers gate on different ones (verl `rollout_corr/k3_kl`,
NeMo-RL `token_mult_prob_error`, probability differences, sequence IS ratios). All are computed from Δ and
ρ once, in a token phase over the whole batch that leaves per-sample sums and centred co-moments; a step
is reduced from the slice of its rows. Nothing is clamped, `|Δ| > 20` is counted.

The best-fit temperature needs side b's logits, which only `pgdiag logprobs` sees: the metric keys are null
here (`status = needs_recompute`) and `fit_temperature` is the pure function the recompute path calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pgdiag.errors import Code, InvalidInputError
from pgdiag.metrics import terms
from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.pooled import QuantileSummary, extremum_of, quantiles_of
from pgdiag.metrics.reduce import (
    SAMPLE_AXIS,
    TOKEN_AXIS,
    TokenReducer,
    ess_from_log_weights,
    extremum,
    fraction,
    plain_mean,
    plain_sd,
    quantiles,
    segment_sums,
)
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.terms import band_edges

SEQ_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
TAU_RANGE = (0.05, 20.0)
TAU_GRID_POINTS = 200
TAU_LOG_TOL = 1e-6


@dataclass(frozen=True)
class MismatchTables:
    """Per-sample sums (S,) of every mismatch quantity on the pair-valid tokens, plus token arrays (N,).

    `c_*` are within-sample centred co-moments (Σ_t (x − x̄_i)(y − ȳ_i)), combined across samples exactly by
    `_combine` for the correlations and the OLS fit.
    """

    reducer: TokenReducer
    abs_delta: np.ndarray | QuantileSummary = field(metadata=TOKEN_AXIS)  # (N,) |Δ|
    abs_dprob: np.ndarray | QuantileSummary = field(metadata=TOKEN_AXIS)  # (N,) |e^lp_b − e^lp_a|
    n_positions: np.ndarray = field(metadata=SAMPLE_AXIS)  # loss positions of the sample
    n_abs_gt_20: np.ndarray = field(metadata=SAMPLE_AXIS)  # loss positions with |Δ| > 20
    sum_delta: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_delta2: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_abs: np.ndarray = field(metadata=SAMPLE_AXIS)
    n_out: np.ndarray = field(metadata=SAMPLE_AXIS)  # (S, 5) tokens outside each band of `terms.BANDS`
    sum_k3: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (ρ − 1 − Δ)
    sum_rev_k1: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t ρΔ
    sum_rev_k3: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (1 − ρ + ρΔ)
    sum_tmpe: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t e^|Δ|
    sum_rho: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_rho2: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_chi2: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (ρ² − 1)
    sum_dprob: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_a: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t lp_a
    c_aa: np.ndarray = field(metadata=SAMPLE_AXIS)
    c_ad: np.ndarray = field(metadata=SAMPLE_AXIS)  # lp_a with Δ
    c_dd: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_pa: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t e^lp_a
    sum_pb: np.ndarray = field(metadata=SAMPLE_AXIS)
    c_pa_pa: np.ndarray = field(metadata=SAMPLE_AXIS)
    c_pa_pb: np.ndarray = field(metadata=SAMPLE_AXIS)
    c_pb_pb: np.ndarray = field(metadata=SAMPLE_AXIS)


def build_mismatch_tables(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    valid: np.ndarray,
    offsets: np.ndarray,
    doc_of_sample: np.ndarray,
    settings: MetricSettings,
) -> MismatchTables:
    """Token phase of the mismatch family over every loss position (M,) of the batch; `valid` (M,) is the
    pair's test m ∧ finite(lp_a) ∧ finite(lp_b) and `offsets` (S+1,) delimit the samples."""
    lengths = np.diff(offsets)
    all_valid = bool(valid.all())
    n_abs_gt_20 = None  # counted below from the valid tokens when every position is valid
    if not all_valid:
        with np.errstate(invalid="ignore"):
            big = np.abs(lp_b - lp_a) > 20.0  # (M,) over every position, valid or not
        n_abs_gt_20 = segment_sums(big, offsets[:-1], lengths).astype(np.float64)
        lp_a, lp_b = lp_a[valid], lp_b[valid]
    red = TokenReducer.build(valid, offsets, doc_of_sample, settings.metric_reduction)
    sums = red.sample_sums
    delta = lp_b - lp_a  # (N,)
    abs_delta = np.abs(delta)
    scratch = np.empty_like(delta)
    if n_abs_gt_20 is None:
        any_big = abs_delta.shape[0] > 0 and float(np.max(abs_delta)) > 20.0
        n_abs_gt_20 = sums(abs_delta > 20.0, scratch) if any_big else np.zeros(lengths.shape[0])
    spare = np.empty_like(delta)
    with np.errstate(over="ignore", invalid="ignore"):
        n_out = np.stack(
            [
                sums(delta < log_lo, scratch) + sums(delta > log_hi, scratch)
                for log_lo, log_hi in band_edges(settings.clip).values()
            ],
            axis=1,
        )
        # the per-token terms of `metrics.terms`, shared with compare's parity table
        rho = terms.ratio(delta, np.empty_like(delta))  # (N,)
        sum_rho = sums(rho)
        sum_rho2 = sums(np.multiply(rho, rho, out=scratch))
        sum_chi2 = sums(terms.chi2(delta, scratch, spare))
        sum_rev_k1 = sums(terms.rev_k1(delta, scratch))
        sum_k3 = sums(terms.k3(delta, scratch))
        sum_rev_k3 = sums(terms.rev_k3(delta, scratch, spare))
        sum_tmpe = sums(terms.tmpe(delta, scratch, spare))
        abs_dprob = terms.abs_dprob(lp_a, lp_b, np.empty_like(delta), spare)  # (N,)
        prob_a, prob_b = np.exp(lp_a), np.exp(lp_b)
    sum_delta, sum_a = sums(delta), sums(lp_a)
    sum_pa, sum_pb = sums(prob_a), sums(prob_b)
    a_c = lp_a - red.broadcast(red.sample_means(sum_a))  # (N,) centred within samples
    d_c = delta - red.broadcast(red.sample_means(sum_delta))
    pa_c = np.subtract(prob_a, red.broadcast(red.sample_means(sum_pa)), out=prob_a)
    pb_c = np.subtract(prob_b, red.broadcast(red.sample_means(sum_pb)), out=prob_b)

    def co_moment(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return sums(np.multiply(x, y, out=scratch))

    return MismatchTables(
        reducer=red,
        abs_delta=abs_delta,
        abs_dprob=abs_dprob,
        n_positions=lengths.astype(np.float64),
        n_abs_gt_20=n_abs_gt_20,
        sum_delta=sum_delta,
        sum_delta2=sums(np.multiply(delta, delta, out=scratch)),
        sum_abs=sums(abs_delta),
        n_out=n_out,
        sum_k3=sum_k3,
        sum_rev_k1=sum_rev_k1,
        sum_rev_k3=sum_rev_k3,
        sum_tmpe=sum_tmpe,
        sum_rho=sum_rho,
        sum_rho2=sum_rho2,
        sum_chi2=sum_chi2,
        sum_dprob=sums(abs_dprob),
        sum_a=sum_a,
        c_aa=co_moment(a_c, a_c),
        c_ad=co_moment(a_c, d_c),
        c_dd=co_moment(d_c, d_c),
        sum_pa=sum_pa,
        sum_pb=sum_pb,
        c_pa_pa=co_moment(pa_c, pa_c),
        c_pa_pb=co_moment(pa_c, pb_c),
        c_pb_pb=co_moment(pb_c, pb_c),
    )


def _combine(
    n_i: np.ndarray,
    sum_x: np.ndarray,
    sum_y: np.ndarray,
    c_xx: np.ndarray,
    c_xy: np.ndarray,
    c_yy: np.ndarray,
) -> tuple[float, float, float, float, float]:
    """(mean x, mean y, S_xx, S_xy, S_yy) of the pooled samples from per-sample centred moments.

    S_xy = Σ_i C_xy,i + Σ_i N_i (x̄_i − x̄)(ȳ_i − ȳ) (Chan et al.): exact, and S_xx, S_yy are sums of
    non-negative terms.
    """
    n = float(np.sum(n_i))
    mean_x, mean_y = float(np.sum(sum_x)) / n, float(np.sum(sum_y)) / n
    filled = n_i > 0
    gap_x = sum_x[filled] / n_i[filled] - mean_x
    gap_y = sum_y[filled] / n_i[filled] - mean_y
    weights = n_i[filled]
    s_xx = float(np.sum(c_xx) + np.sum(weights * gap_x * gap_x))
    s_xy = float(np.sum(c_xy) + np.sum(weights * gap_x * gap_y))
    s_yy = float(np.sum(c_yy) + np.sum(weights * gap_y * gap_y))
    return mean_x, mean_y, s_xx, s_xy, s_yy


def add_mismatch_counts(t: MismatchTables, sink: MetricSink) -> None:
    """`count/mismatch_*` over the step's loss positions: valid tokens, invalid ones, |Δ| > 20."""
    n_positions = int(np.sum(t.n_positions))
    n_valid = t.reducer.n_tokens
    sink.add("count/mismatch_tokens", n_valid, n_positions)
    sink.add("count/mismatch_invalid", n_positions - n_valid, n_positions)
    sink.add("count/mismatch_abs_delta_gt_20", np.sum(t.n_abs_gt_20), n_positions)


def add_mismatch_metrics(t: MismatchTables, settings: MetricSettings, sink: MetricSink) -> None:
    """Every `mismatch/*` key for the rows of `t`; `tau_fit*` are null (they need logits)."""
    red = t.reducer
    mean = red.mean_of_sums
    n_tok, n_red = red.n_tokens, red.population
    ne = red.nonempty
    n_seq = red.n_nonempty
    n_i = red.n_per_sample.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        # 1. location and spread of Δ
        bias = mean(t.sum_delta)
        sink.add("mismatch/bias", bias, n_red)
        centred = t.c_dd  # Σ_t (Δ − Δ̄_i)²
        sink.add("mismatch/sd", red.spread_of_moments(t.sum_delta, centred), n_red)
        mean_sq = mean(t.sum_delta2)
        sink.add("mismatch/rms", None if mean_sq is None else math.sqrt(mean_sq), n_red)
        sink.add("mismatch/abs_mean", mean(t.sum_abs), n_red)
        p50, p95, p99 = quantiles_of(t.abs_delta, (0.5, 0.95, 0.99))
        sink.add("mismatch/abs_p50", p50, n_tok)
        sink.add("mismatch/abs_p95", p95, n_tok)
        sink.add("mismatch/abs_p99", p99, n_tok)
        sink.add("mismatch/abs_max", extremum_of(t.abs_delta, "max"), n_tok)
        _add_fit(t, n_i, sink)
        # 2. band fractions, token and sequence level (tested on Δ against ln of the band edges)
        mean_delta = t.sum_delta[ne] / n_i[ne]  # (S+,) δ̄^Δ_i
        for column, (name, (log_lo, log_hi)) in enumerate(band_edges(settings.clip).items()):
            sink.add(f"mismatch/frac_out_{name}", mean(t.n_out[:, column]), n_red)
            seq_out = (mean_delta < log_lo) | (mean_delta > log_hi)
            sink.add(f"mismatch/seq_frac_out_{name}", fraction(seq_out), n_seq)
        # 3. KL estimators and moments of ρ
        sink.add("mismatch/kl_k1", None if bias is None else -bias, n_red)
        sink.add("mismatch/kl_k3", mean(t.sum_k3), n_red)
        sink.add("mismatch/kl_rev_k1", mean(t.sum_rev_k1), n_red)
        sink.add("mismatch/kl_rev_k3", mean(t.sum_rev_k3), n_red)
        sink.add("mismatch/tmpe", mean(t.sum_tmpe), n_red)
        sink.add("mismatch/chi2_token", mean(t.sum_chi2), n_red)
        seq_sum = t.sum_delta[ne]  # (S+,)
        sink.add("mismatch/chi2_seq", plain_mean(np.expm1(2.0 * seq_sum)), n_seq)
        total_rho, total_rho2 = float(np.sum(t.sum_rho)), float(np.sum(t.sum_rho2))
        ess_token = total_rho * total_rho / (n_tok * total_rho2) if n_tok and total_rho2 > 0 else None
        sink.add("mismatch/ess_token", ess_token, n_tok)
        sink.add("mismatch/ess_seq", ess_from_log_weights(seq_sum), n_seq)
        # 4. probability space
        sink.add("mismatch/abs_dprob_mean", mean(t.sum_dprob), n_red)
        sink.add("mismatch/abs_dprob_p99", quantiles_of(t.abs_dprob, (0.99,))[0], n_tok)
        sink.add("mismatch/abs_dprob_max", extremum_of(t.abs_dprob, "max"), n_tok)
        prob_r = None
        if n_tok:
            _, _, s_aa, s_ab, s_bb = _combine(n_i, t.sum_pa, t.sum_pb, t.c_pa_pa, t.c_pa_pb, t.c_pb_pb)
            prob_r = s_ab / math.sqrt(s_aa * s_bb) if s_aa > 0 and s_bb > 0 else None
        sink.add("mismatch/prob_pearson_r", prob_r, n_tok)
        # 5. sequence level
        sink.add("mismatch/seq_mean_delta_mean", plain_mean(mean_delta), n_seq)
        sink.add("mismatch/seq_mean_delta_sd", plain_sd(mean_delta), n_seq)
        sink.add("mismatch/seq_mean_delta_absmax", extremum(np.abs(mean_delta), "max"), n_seq)
        qs = tuple(q for _, q in SEQ_QUANTILES)
        for (name, _), value in zip(SEQ_QUANTILES, quantiles(seq_sum, qs), strict=True):
            sink.add(f"mismatch/seq_sum_delta_{name}", value, n_seq)
            sink.add(f"mismatch/seq_ratio_{name}", None if value is None else exp_saturating(value), n_seq)
    sink.add("mismatch/tau_fit", None, n_tok)
    sink.add("mismatch/tau_fit_rms", None, n_tok)


def exp_saturating(log_value: float) -> float:
    """exp(log_value), +inf past the float64 range (a summed log-ratio above 709.78 nats) instead of OverflowError."""
    return math.inf if log_value > math.log(np.finfo(np.float64).max) else math.exp(log_value)


def _add_fit(t: MismatchTables, n_i: np.ndarray, sink: MetricSink) -> None:
    """Pearson r of (lp_a, lp_b) and the OLS fit lp_b ≈ α + β·lp_a with its RMS residual.

    With lp_b = lp_a + Δ: S_ab = S_aa + S_aΔ, S_bb = S_aa + 2 S_aΔ + S_ΔΔ, β = S_ab / S_aa, and the residual
    sum of squares is S_ΔΔ − S_aΔ² / S_aa, which cancels only on the scale of Δ, not of the log-probs.
    """
    n_tok = t.reducer.n_tokens
    pearson_r = slope = intercept = resid_rms = None
    if n_tok:
        mean_a, mean_d, s_aa, s_ad, s_dd = _combine(n_i, t.sum_a, t.sum_delta, t.c_aa, t.c_ad, t.c_dd)
        s_ab, s_bb = s_aa + s_ad, s_aa + 2.0 * s_ad + s_dd
        if s_aa > 0 and s_bb > 0:
            pearson_r = s_ab / math.sqrt(s_aa * s_bb)
        if s_aa > 0:
            slope = s_ab / s_aa
            intercept = (mean_a + mean_d) - slope * mean_a
            resid_rms = math.sqrt(max(s_dd - s_ad * s_ad / s_aa, 0.0) / n_tok)  # max: rounding of a square
    sink.add("mismatch/pearson_r", pearson_r, n_tok)
    sink.add("mismatch/fit_slope", slope, n_tok)
    sink.add("mismatch/fit_intercept", intercept, n_tok)
    sink.add("mismatch/fit_resid_rms", resid_rms, n_tok)


@dataclass(frozen=True)
class TemperatureFit:
    """Best-fit temperature τ* and the RMS residual (nats) at τ*; None for no tokens."""

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
            Code.NON_FINITE, "fit_temperature: logits and log-probs must be finite on the fitted tokens", None
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
