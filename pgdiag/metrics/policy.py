"""Policy family of docs/metrics.md: how far π_new moved from π_old on the tokens sampled from π_old.

Definitions (a = old, b = new; valid tokens m' only):
    d_t = lp_new − lp_old,   r_t = exp(d_t),   band O_t = 1[r_t < 1 − ε_l ∨ r_t > 1 + ε_h],
    binding B_t = 1[(A_t > 0 ∧ r_t > 1 + ε_h) ∨ (A_t < 0 ∧ r_t < 1 − ε_l)],
    sequence ratio R_i = exp(Σ_t d / N_i) (GSPO), product ratio W_i = exp(Σ_t d).
On-policy data gives d = 0: ratio 1, every clip fraction 0, every KL 0, every ESS 1 (the step-0 identity check of docs/metrics.md).

Why two phases: a run holds up to 10M tokens over ~20 steps, and the `all` row pools them again. The token
phase (`build_policy_tables`) runs once over the whole batch: it computes d and exp(d) once and turns every
per-token quantity into per-sample sums (S,). The reduce phase (`add_policy_metrics`) then works on the
rows of one step (`take_rows`), touching tokens only for quantiles and extrema. The per-sample loss and
gradient sums are built in the same pass (`LossSums`), sharing r and the clip indicators.
Nothing is clamped: |d| > 20 is counted, a ratio that overflows float64 is +inf and propagates into the
means (counted in `count/policy_ratio_overflow`).

Worked example (docs/metrics.md, 13 valid tokens): ratio_mean 13.385230 / 13 = 1.029633,
clip_frac_band 6/13, clip_frac_binding 4/13, kl_k1 = −0.15/13 = −0.011538, ess_token 0.967279.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pgdiag.metrics.advantage import AdvantageTables
from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.loss import LossSums, gspo_loss_sums, scaled, token_loss_sums
from pgdiag.metrics.pooled import QuantileSummary, TokenExtrema, extremum_of, quantiles_of
from pgdiag.metrics.reduce import (
    SAMPLE_AXIS,
    TOKEN_AXIS,
    TOKEN_EXTREMA_AXIS,
    TokenReducer,
    ess_from_log_weights,
    extremum,
    fraction,
    plain_mean,
    quantiles,
    segment_sums,
)
from pgdiag.metrics.settings import MetricSettings

LOG_FLOAT64_MAX = math.log(np.finfo(np.float64).max)  # 709.78: exp(d) overflows above this
LOGRATIO_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999))
SEQ_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclass(frozen=True)
class PolicyTables:
    """Per-sample sums (S,) of every policy quantity, plus the token arrays (N,) its token statistics need.

    Counts of indicator tokens are float64 sums. Fields that need advantages are None without them.
    """

    reducer: TokenReducer
    d: np.ndarray | QuantileSummary = field(metadata=TOKEN_AXIS)  # (N,) log-ratio
    r: np.ndarray | TokenExtrema = field(metadata=TOKEN_EXTREMA_AXIS)  # (N,) ratio, +inf on overflow
    sum_d: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t d
    sum_abs_d: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t |d|
    max_abs_d: np.ndarray = field(metadata=SAMPLE_AXIS)  # max_t |d| (NaN for empty samples)
    sum_r: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t r
    m2_r: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (r − r̄_i)²
    sum_r2: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t r²
    sum_d2: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t d²
    sum_k3: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (r − 1 − d)
    sum_rev_k1: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t r d
    sum_rev_k3: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (1 − r + r d)
    n_band_low: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t 1[r < 1 − ε_l]
    n_band_high: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t 1[r > 1 + ε_h]
    # position counts over every loss position of the sample (valid or not)
    n_abs_gt_20: np.ndarray = field(metadata=SAMPLE_AXIS)
    n_nan: np.ndarray = field(metadata=SAMPLE_AXIS)
    n_inf: np.ndarray = field(metadata=SAMPLE_AXIS)
    n_overflow: np.ndarray = field(metadata=SAMPLE_AXIS)
    # with advantages
    sum_adv: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t A
    n_clip_low: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t 1[A < 0 ∧ r < 1 − ε_l]
    n_clip_high: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t 1[A > 0 ∧ r > 1 + ε_h]
    n_dual: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t Dual_t
    n_zero_grad: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t 1[A = 0 ∨ B ∨ Dual]
    n_agree: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t 1[B_t = B^G_t]
    grad_pass: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t |A| r 1[¬B ∧ ¬Dual]
    grad_pass_band: np.ndarray | None = field(metadata=SAMPLE_AXIS)  # Σ_t |A| r 1[O ∧ ¬B ∧ ¬Dual]


def _sequence_ratio(sum_d: np.ndarray, reducer: TokenReducer) -> np.ndarray:
    """(S,) R_i = exp(Σ_t d / N_i); 1 for empty samples."""
    with np.errstate(over="ignore"):
        return np.exp(reducer.sample_means(sum_d))


def build_policy_tables(
    lp_new: np.ndarray,
    lp_old: np.ndarray,
    advantage: AdvantageTables | None,
    advantages: np.ndarray | None,
    position_d: np.ndarray | None,
    position_offsets: np.ndarray,
    settings: MetricSettings,
    reducer: TokenReducer,
) -> tuple[PolicyTables, LossSums | None]:
    """Token phase of the policy and loss families over the valid tokens (N,) of `reducer`.

    `advantages` (N,) and their tables (same reducer) are None without advantages. `position_d` (M,) is
    lp_new − lp_old at every loss position, None when every position is valid (the counts then come from
    the valid tokens); `position_offsets` (S+1,) delimit its samples.
    """
    low_edge, high_edge = 1.0 - settings.clip.eps_low, 1.0 + settings.clip.eps_high
    sums = reducer.sample_sums
    # 1. log-ratio and ratio, once
    d = lp_new - lp_old  # (N,)
    with np.errstate(over="ignore"):
        r = np.exp(d)  # (N,)
    abs_d = np.abs(d)
    band_low, band_high = r < low_edge, r > high_edge  # (N,) bool
    sum_d, sum_r = sums(d), sums(r)
    scratch = np.empty_like(d)  # (N,) reused for every product below
    flag_scratch = np.empty_like(d)  # (N,) float64 copy of an indicator while it is counted

    def count_flags(flags: np.ndarray) -> np.ndarray:
        return sums(flags, flag_scratch)

    with np.errstate(invalid="ignore", over="ignore"):
        sum_r2 = sums(np.multiply(r, r, out=scratch))
        sum_d2 = sums(np.multiply(d, d, out=scratch))
        sum_rev_k1 = sums(np.multiply(r, d, out=scratch))
        np.subtract(r, 1.0, out=scratch)
        sum_k3 = sums(np.subtract(scratch, d, out=scratch))  # r − 1 − d
        np.subtract(d, 1.0, out=scratch)
        np.multiply(scratch, r, out=scratch)
        sum_rev_k3 = sums(np.add(scratch, 1.0, out=scratch))  # 1 + r (d − 1) = 1 − r + r d
        m2_r = reducer.centred_m2(r, sum_r)
    max_abs_d = reducer.sample_max(abs_d)  # (S,)
    # 2. extremes over every loss position; with every position valid and max |d| ≤ 20 they are all 0
    n_samples = reducer.n_per_sample.shape[0]
    extreme = position_d is not None or (abs_d.shape[0] > 0 and float(np.max(abs_d)) > 20.0)
    if extreme:
        counts_d = d if position_d is None else position_d
        count = count_flags if position_d is None else _position_counter(position_offsets)
        with np.errstate(invalid="ignore"):
            n_abs_gt_20 = count(counts_d > 20.0) + count(counts_d < -20.0)
            n_nan, n_inf = count(np.isnan(counts_d)), count(np.isinf(counts_d))
            n_overflow = count(counts_d > LOG_FLOAT64_MAX)
    else:
        n_abs_gt_20 = n_nan = n_inf = n_overflow = np.zeros(n_samples)
    n_band_low, n_band_high = count_flags(band_low), count_flags(band_high)
    tables = dict(
        reducer=reducer,
        d=d,
        r=r,
        sum_d=sum_d,
        sum_abs_d=sums(abs_d),
        max_abs_d=max_abs_d,
        sum_r=sum_r,
        m2_r=m2_r,
        sum_r2=sum_r2,
        sum_d2=sum_d2,
        sum_k3=sum_k3,
        sum_rev_k1=sum_rev_k1,
        sum_rev_k3=sum_rev_k3,
        n_band_low=n_band_low,
        n_band_high=n_band_high,
        n_abs_gt_20=n_abs_gt_20,
        n_nan=n_nan,
        n_inf=n_inf,
        n_overflow=n_overflow,
    )
    if advantages is None or advantage is None:
        none = dict.fromkeys(
            (
                "sum_adv",
                "n_clip_low",
                "n_clip_high",
                "n_dual",
                "n_zero_grad",
                "n_agree",
                "grad_pass",
                "grad_pass_band",
            )
        )
        return PolicyTables(**tables, **none), None
    # 3. clip decisions and the gradient that passes them: per sample when every sample has one advantage
    # value and no ratio overflowed (the common case, no token pass over A), else per token
    ne = reducer.nonempty
    constant = bool(np.all(advantage.min_adv[ne] == advantage.max_adv[ne])) and bool(np.all(np.isfinite(r)))
    clip_sums = _sample_level_clip if constant else _token_level_clip
    n_clip_low, n_clip_high, n_dual, grad_pass, grad_pass_band, loss = clip_sums(
        _ClipInputs(
            advantages,
            advantage,
            r,
            band_low,
            band_high,
            n_band_low,
            n_band_high,
            sum_r,
            reducer,
            settings,
            scratch,
        )
    )
    # 4. sequence level from per-sample algebra: with S_i± = Σ_t max(±A, 0) and the sample's band side,
    # B^G, the GSPO gradient and the GSPO loss need no token pass
    seq_ratio = _sequence_ratio(sum_d, reducer)  # (S,)
    seq_high, seq_low = seq_ratio > high_edge, seq_ratio < low_edge
    positive_part = 0.5 * (advantage.sum_abs + advantage.sum_adv)  # (S,) Σ_t max(A, 0)
    negative_part = 0.5 * (advantage.sum_abs - advantage.sum_adv)  # (S,) Σ_t max(−A, 0)
    disagree = np.where(
        seq_high,
        advantage.n_pos - n_clip_high + n_clip_low,
        np.where(seq_low, advantage.n_neg - n_clip_low + n_clip_high, n_clip_low + n_clip_high),
    )
    passing_seq = np.where(seq_high, negative_part, np.where(seq_low, positive_part, advantage.sum_abs))
    tables.update(
        sum_adv=advantage.sum_adv,
        n_clip_low=n_clip_low,
        n_clip_high=n_clip_high,
        n_dual=n_dual,
        n_zero_grad=n_clip_low + n_clip_high + n_dual + advantage.n_zero,
        n_agree=reducer.n_per_sample - disagree,
        grad_pass=grad_pass,
        grad_pass_band=grad_pass_band,
    )
    sums_of_loss = LossSums(
        reducer=reducer,
        loss=loss,
        loss_seq=gspo_loss_sums(seq_ratio, positive_part, negative_part, settings),
        abs_grad=grad_pass,
        abs_grad_seq=scaled(seq_ratio, passing_seq),
    )
    return PolicyTables(**tables), sums_of_loss


ClipSums = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _ClipInputs:
    """What the two ways of summing the clip decisions read (`_token_level_clip`, `_sample_level_clip`)."""

    advantages: np.ndarray  # (N,) A_t
    advantage: AdvantageTables  # per-sample advantage sums
    r: np.ndarray  # (N,) ratio
    band_low: np.ndarray  # (N,) bool r < 1 − ε_l
    band_high: np.ndarray  # (N,) bool r > 1 + ε_h
    n_band_low: np.ndarray  # (S,)
    n_band_high: np.ndarray  # (S,)
    sum_r: np.ndarray  # (S,) Σ_t r
    reducer: TokenReducer
    settings: MetricSettings
    scratch: np.ndarray  # (N,) work buffer the passes may overwrite


def _token_level_clip(c: _ClipInputs) -> ClipSums:
    """(S,) counts of binding-low, binding-high and dual-clip tokens, Σ|g_t|, Σ|g_t|·O_t and Σ ℓ_t, per token.

    |g_t| = |A| r where neither the clip binds nor the dual clip fires; ℓ_t as in `token_loss_sums`.
    """
    advantages, r, band_low, band_high = c.advantages, c.r, c.band_low, c.band_high
    reducer, settings, scratch = c.reducer, c.settings, c.scratch
    flag_scratch = np.empty_like(r)

    def count_flags(flags: np.ndarray) -> np.ndarray:
        return reducer.sample_sums(flags, flag_scratch)

    positive = advantages > 0  # (N,) bool
    clip_high = positive & band_high
    clip_low = (advantages < 0) & band_low
    n_clip_high, n_clip_low = count_flags(clip_high), count_flags(clip_low)
    stopped = clip_high | clip_low  # binding B_t
    if settings.clip.dual_clip is None:
        n_dual = np.zeros(reducer.n_per_sample.shape[0])
    else:
        dual = (advantages < 0) & (
            np.maximum(r, np.clip(r, 1.0 - settings.clip.eps_low, 1.0 + settings.clip.eps_high))
            > settings.clip.dual_clip
        )
        n_dual = count_flags(dual)
        stopped |= dual
    with np.errstate(invalid="ignore"):
        abs_grad = np.abs(advantages, out=scratch)
        abs_grad *= r
        abs_grad[stopped] = 0.0  # |g_t| = |A| r where the gradient passes
        if not np.all(np.isfinite(r)):
            abs_grad[advantages == 0] = 0.0  # 0·inf: no gradient on A = 0
        grad_pass = reducer.sample_sums(abs_grad)
        grad_pass_band = reducer.sample_sums(np.where(band_low | band_high, abs_grad, 0.0))
        loss = token_loss_sums(advantages, r, positive, reducer, settings, scratch)
    return n_clip_low, n_clip_high, n_dual, grad_pass, grad_pass_band, loss


def _sample_level_clip(c: _ClipInputs) -> ClipSums:
    """The sums of `_token_level_clip` when each sample has one advantage A_i and every r is finite.

    With ρ_hi = Σ_t r·1[r > 1 + ε_h], ρ_lo = Σ_t r·1[r < 1 − ε_l] and ρ_C = Σ_t r·1[r > C] (dual clip C > 1;
    for A < 0, max(r, clip(r)) > C is r > C):
      A_i > 0: binding = high; Σ|g| = A_i Σ_t r·1[¬hi]; Σ|g|·O = A_i ρ_lo; Σℓ = −A_i (Σr − ρ_hi + (1 + ε_h) n_hi)
      A_i < 0: binding = low, dual = r > C; Σ|g| = |A_i| Σ_t r·1[¬lo ∧ r ≤ C]; Σ|g|·O = |A_i| Σ_t r·1[hi ∧ r ≤ C];
               Σℓ = |A_i| (Σr − ρ_lo + (1 − ε_l) n_lo − (ρ_C − C n_C))
    (no overflow: the differences of finite sums are exact up to rounding).
    """
    r, band_low, band_high, sum_r = c.r, c.band_low, c.band_high, c.sum_r
    n_band_low, n_band_high = c.n_band_low, c.n_band_high
    reducer, settings, scratch = c.reducer, c.settings, c.scratch
    high_edge, low_edge = 1.0 + settings.clip.eps_high, 1.0 - settings.clip.eps_low
    adv = np.where(reducer.nonempty, c.advantage.max_adv, 0.0)  # (S,) A_i
    positive, negative = adv > 0, adv < 0
    abs_adv = np.abs(adv)
    r_high = reducer.sample_sums(np.multiply(r, band_high, out=scratch))  # ρ_hi (S,)
    r_low = reducer.sample_sums(np.multiply(r, band_low, out=scratch))  # ρ_lo (S,)
    zeros = np.zeros_like(adv)
    token_adv = reducer.broadcast(adv)  # (N,) A_i on each of its tokens
    # gradient passes: A > 0 out of the high band, or A < 0 out of the low band and under the dual clip
    passing = ((token_adv > 0) & ~band_high) | ((token_adv < 0) & ~band_low)  # (N,) bool
    if settings.clip.dual_clip is None:
        n_over, r_over, r_high_live = zeros, zeros, r_high
    else:
        over = r > settings.clip.dual_clip  # (N,) bool
        passing &= ~over | (token_adv > 0)
        n_over = reducer.sample_sums(over, scratch)
        r_over = reducer.sample_sums(np.multiply(r, over, out=scratch))
        # out-of-band-high tokens that the dual clip leaves alive: r in (1 + ε_h, C]
        r_high_live = r_high - r_over if settings.clip.dual_clip >= high_edge else zeros
    n_clip_high = np.where(positive, n_band_high, 0.0)
    n_clip_low = np.where(negative, n_band_low, 0.0)
    n_dual = np.where(negative, n_over, 0.0)
    # a masked sum, not Σr − ρ: a sample whose every token is stopped passes exactly 0, never a rounding residue
    grad_pass = abs_adv * reducer.sample_sums(np.multiply(r, passing, out=scratch))
    grad_pass_band = abs_adv * np.where(positive, r_low, np.where(negative, r_high_live, 0.0))
    dual_cut = r_over - (settings.clip.dual_clip or 0.0) * n_over
    loss_pos = -adv * (sum_r - r_high + high_edge * n_band_high)
    loss_neg = abs_adv * (sum_r - r_low + low_edge * n_band_low - dual_cut)
    loss = np.where(positive, loss_pos, np.where(negative, loss_neg, 0.0))
    return n_clip_low, n_clip_high, n_dual, grad_pass, grad_pass_band, loss


def _position_counter(offsets: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Per-sample counter of boolean flags over every loss position (M,) delimited by `offsets`."""
    starts, lengths = offsets[:-1], np.diff(offsets)

    def count(flags: np.ndarray) -> np.ndarray:
        return segment_sums(flags, starts, lengths).astype(np.float64)

    return count


def add_policy_counts(t: PolicyTables, n_positions: int, sink: MetricSink) -> None:
    """`count/policy_*` over the step's loss positions: |d| > 20, NaN d, infinite d, overflow of exp(d)."""
    sink.add("count/policy_abs_logratio_gt_20", np.sum(t.n_abs_gt_20), n_positions)
    sink.add("count/policy_logratio_nan", np.sum(t.n_nan), n_positions)
    sink.add("count/policy_logratio_inf", np.sum(t.n_inf), n_positions)
    sink.add("count/policy_ratio_overflow", np.sum(t.n_overflow), n_positions)


def add_policy_metrics(t: PolicyTables, settings: MetricSettings, sink: MetricSink) -> None:
    """Every `policy/*` key except `policy/ref_*` (see `add_ref_metrics`), for the rows of `t`."""
    red = t.reducer
    n_tok, n_red = red.n_tokens, red.population
    mean = red.mean_of_sums
    with np.errstate(invalid="ignore", over="ignore"):
        # 1. ratio and log-ratio
        sink.add("policy/ratio_mean", mean(t.sum_r), n_red)
        sink.add("policy/ratio_std", red.spread_of_moments(t.sum_r, t.m2_r), n_red)
        sink.add("policy/ratio_min", extremum_of(t.r, "min"), n_tok)
        sink.add("policy/ratio_max", extremum_of(t.r, "max"), n_tok)
        logratio_mean = mean(t.sum_d)
        sink.add("policy/logratio_mean", logratio_mean, n_red)
        sink.add("policy/logratio_abs_mean", mean(t.sum_abs_d), n_red)
        qs = tuple(q for _, q in LOGRATIO_QUANTILES)
        for (name, _), value in zip(LOGRATIO_QUANTILES, quantiles_of(t.d, qs), strict=True):
            sink.add(f"policy/logratio_{name}", value, n_tok)
        ne = red.nonempty
        sink.add("policy/logratio_absmax", extremum(t.max_abs_d[ne], "max"), n_tok)
        # 2. clip fractions: band (any A) and binding (clipping changes the objective)
        sink.add("policy/clip_frac_band", mean(t.n_band_low + t.n_band_high), n_red)
        sink.add("policy/clip_frac_band_low", mean(t.n_band_low), n_red)
        sink.add("policy/clip_frac_band_high", mean(t.n_band_high), n_red)
        if t.sum_adv is not None:
            sink.add("policy/clip_frac_binding", mean(t.n_clip_low + t.n_clip_high), n_red)
            sink.add("policy/clip_frac_low", mean(t.n_clip_low), n_red)
            sink.add("policy/clip_frac_high", mean(t.n_clip_high), n_red)
            if settings.clip.dual_clip is not None:
                sink.add("policy/dual_clip_frac", mean(t.n_dual), n_red)
            sink.add("policy/zero_grad_frac", mean(t.n_zero_grad), n_red)
            total = float(np.sum(t.grad_pass))
            share = float(np.sum(t.grad_pass_band)) / total if total > 0 else None
            sink.add("policy/band_nonbinding_grad_share", share, n_tok)
            sink.add("policy/seq_token_clip_agreement", mean(t.n_agree), n_red)
        # 3. KL estimators of KL(π_old‖π_new) (k1, k2, k3) and KL(π_new‖π_old) (rev)
        sink.add("policy/kl_k1", None if logratio_mean is None else -logratio_mean, n_red)
        k2 = mean(t.sum_d2)
        sink.add("policy/kl_k2", None if k2 is None else 0.5 * k2, n_red)
        sink.add("policy/kl_k3", mean(t.sum_k3), n_red)
        sink.add("policy/kl_rev_k1", mean(t.sum_rev_k1), n_red)
        sink.add("policy/kl_rev_k3", mean(t.sum_rev_k3), n_red)
        # 4. effective sample sizes
        total_r, total_r2 = float(np.sum(t.sum_r)), float(np.sum(t.sum_r2))
        ess_token = total_r * total_r / (n_tok * total_r2) if n_tok and total_r2 > 0 else None
        sink.add("policy/ess_token", ess_token, n_tok)
        n_seq = red.n_nonempty
        per_seq = t.sum_r[ne] ** 2 / (red.n_per_sample[ne] * t.sum_r2[ne])
        sink.add("policy/ess_per_seq", plain_mean(per_seq), n_seq)
        sink.add("policy/ess_seq", ess_from_log_weights(t.sum_d[ne]), n_seq)
        sink.add("policy/ess_seq_geo", ess_from_log_weights(red.sample_means(t.sum_d)[ne]), n_seq)
    add_sequence_metrics(t, settings, sink)


def add_sequence_metrics(t: PolicyTables, settings: MetricSettings, sink: MetricSink) -> None:
    """`policy/seq_*`: statistics over the S+ non-empty samples of R_i, Σd_i and max_t |d|."""
    red = t.reducer
    ne = red.nonempty
    n_seq = red.n_nonempty
    low_edge, high_edge = 1.0 - settings.clip.eps_low, 1.0 + settings.clip.eps_high
    with np.errstate(over="ignore", invalid="ignore"):
        seq_ratio = _sequence_ratio(t.sum_d, red)[ne]  # (S+,)
        sum_d = t.sum_d[ne]  # (S+,)
        sink.add("policy/seq_ratio_mean", plain_mean(seq_ratio), n_seq)
        sink.add("policy/seq_ratio_min", extremum(seq_ratio, "min"), n_seq)
        sink.add("policy/seq_ratio_max", extremum(seq_ratio, "max"), n_seq)
        qs = tuple(q for _, q in SEQ_QUANTILES)
        for (name, _), value in zip(SEQ_QUANTILES, quantiles(seq_ratio, qs), strict=True):
            sink.add(f"policy/seq_ratio_{name}", value, n_seq)
        for (name, _), value in zip(SEQ_QUANTILES, quantiles(sum_d, qs), strict=True):
            sink.add(f"policy/seq_logratio_sum_{name}", value, n_seq)
        sink.add("policy/seq_logratio_sum_absmax", extremum(np.abs(sum_d), "max"), n_seq)
        seq_low, seq_high = seq_ratio < low_edge, seq_ratio > high_edge
        sink.add("policy/seq_clip_frac_band", fraction(seq_low | seq_high), n_seq)
        if t.sum_adv is not None:
            adv_sums = t.sum_adv[ne]  # the sign of Ā_i is the sign of Σ_t A
            binding = ((adv_sums > 0) & seq_high) | ((adv_sums < 0) & seq_low)
            sink.add("policy/seq_clip_frac_binding", fraction(binding), n_seq)
        sink.add("policy/seq_max_abs_logratio_mean", plain_mean(t.max_abs_d[ne]), n_seq)


@dataclass(frozen=True)
class RefTables:
    """Per-sample sums of the reference-KL quantities on tokens valid for the policy and finite lp_ref."""

    reducer: TokenReducer
    sum_k1: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t x, x = lp_new − lp_ref
    sum_k2: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t x²/2
    sum_k3: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (e^(−x) − 1 + x)


def build_ref_tables(lp_new: np.ndarray, lp_ref: np.ndarray, reducer: TokenReducer) -> RefTables:
    """Token phase of `policy/ref_*`; `lp_new`, `lp_ref` (N,) are the policy-valid tokens of `reducer`."""
    finite_ref = np.isfinite(lp_ref)
    if not finite_ref.all():
        reducer = reducer.subset(finite_ref)
        lp_new, lp_ref = lp_new[finite_ref], lp_ref[finite_ref]
    x = lp_new - lp_ref  # (N_ref,)
    with np.errstate(over="ignore", invalid="ignore"):
        k3 = np.exp(-x)
        k3 -= 1.0
        k3 += x
        return RefTables(
            reducer, reducer.sample_sums(x), 0.5 * reducer.sample_sums(x * x), reducer.sample_sums(k3)
        )


def add_ref_metrics(t: RefTables, sink: MetricSink) -> None:
    """`policy/ref_kl_k1/k2/k3` (tokens treated as drawn from π_new, as every framework does)."""
    n_red = t.reducer.population
    sink.add("policy/ref_kl_k1", t.reducer.mean_of_sums(t.sum_k1), n_red)
    sink.add("policy/ref_kl_k2", t.reducer.mean_of_sums(t.sum_k2), n_red)
    sink.add("policy/ref_kl_k3", t.reducer.mean_of_sums(t.sum_k3), n_red)
