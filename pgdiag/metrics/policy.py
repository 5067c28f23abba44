"""Policy family of design/metrics.md §4: how far π_new moved from π_old on the tokens sampled from π_old.

Definitions (a = old, b = new; valid tokens m' only, §0.2 rule 3):
    d_t = lp_new − lp_old,   r_t = exp(d_t),   band O_t = 1[r_t < 1 − ε_l ∨ r_t > 1 + ε_h],
    binding B_t = 1[(A_t > 0 ∧ r_t > 1 + ε_h) ∨ (A_t < 0 ∧ r_t < 1 − ε_l)],
    sequence ratio R_i = exp(Σ_t d / N_i) (GSPO), product ratio W_i = exp(Σ_t d).
On-policy data gives d = 0: ratio 1, every clip fraction 0, every KL 0, every ESS 1 (the identity of §9).

Why one `PolicyTokens` object: d, r and the clip indicators are computed once per step and shared with the
loss (§7) and advantage (§6) families; a 10M-token step cannot afford recomputing exp(d) per metric.
Nothing is clamped: |d| > 20 is counted, a ratio that overflows float64 is +inf and propagates into the
means (counted in `count/policy_ratio_overflow`).

Worked example (metrics.md §11, 13 valid tokens): ratio_mean 13.385230 / 13 = 1.029633,
clip_frac_band 6/13, clip_frac_binding 4/13, kl_k1 = −0.15/13 = −0.011538, ess_token 0.967279.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.reduce import (
    TokenReducer,
    ess_from_log_weights,
    extremum,
    fraction,
    plain_mean,
    quantiles,
)
from pgdiag.metrics.settings import MetricSettings

LOG_FLOAT64_MAX = math.log(np.finfo(np.float64).max)  # 709.78: exp(d) overflows above this
LOGRATIO_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999))
SEQ_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclass(frozen=True)
class PolicyTokens:
    """The valid tokens of the policy pair with every per-token and per-sample quantity shared by families.

    Token arrays (N,) hold the valid tokens in sample order; sample arrays (S,) hold 0 / False for samples
    without valid tokens.
    """

    reducer: TokenReducer
    d: np.ndarray  # (N,) log-ratio lp_new − lp_old
    r: np.ndarray  # (N,) ratio exp(d), +inf on overflow
    band_low: np.ndarray  # (N,) bool r < 1 − ε_l
    band_high: np.ndarray  # (N,) bool r > 1 + ε_h
    sum_d: np.ndarray  # (S,) Σ_t d
    mean_d: np.ndarray  # (S,) δ̄_i = Σ_t d / N_i
    seq_low: np.ndarray  # (S,) bool R_i < 1 − ε_l
    seq_high: np.ndarray  # (S,) bool R_i > 1 + ε_h
    advantages: np.ndarray | None  # (N,) A
    binding: np.ndarray | None  # (N,) bool B_t
    dual: np.ndarray | None  # (N,) bool Dual_t (all False without --dual-clip)
    binding_seq: np.ndarray | None  # (N,) bool B^G_t
    abs_grad: np.ndarray | None  # (N,) |g_t| of the token modes: |A| r where ¬B ∧ ¬Dual, else 0
    abs_grad_seq: np.ndarray | None  # (N,) |g_t| of the GSPO modes: |A| R_i where ¬B^G, else 0

    @property
    def seq_ratio(self) -> np.ndarray:
        """(S,) R_i = exp(δ̄_i) (1 for empty samples)."""
        return np.exp(self.mean_d)


def build_policy_tokens(
    lp_new: np.ndarray,
    lp_old: np.ndarray,
    advantages: np.ndarray | None,
    reducer: TokenReducer,
    settings: MetricSettings,
) -> PolicyTokens:
    """Per-token and per-sample policy quantities from the valid tokens (N,) of one step."""
    low_edge, high_edge = 1.0 - settings.eps_low, 1.0 + settings.eps_high
    d = lp_new - lp_old  # (N,)
    with np.errstate(over="ignore"):
        r = np.exp(d)  # (N,)
    band_low, band_high = r < low_edge, r > high_edge
    n_i = reducer.n_per_sample
    sum_d = reducer.sample_sums(d)  # (S,)
    mean_d = np.divide(sum_d, n_i, out=np.zeros_like(sum_d), where=n_i > 0)  # (S,)
    with np.errstate(over="ignore"):
        seq_ratio = np.exp(mean_d)
    seq_low, seq_high = seq_ratio < low_edge, seq_ratio > high_edge
    binding = dual = binding_seq = abs_grad = abs_grad_seq = None
    if advantages is not None:
        positive, negative = advantages > 0, advantages < 0
        binding = (positive & band_high) | (negative & band_low)
        if settings.dual_clip is None:
            dual = np.zeros_like(binding)
        else:
            clipped = np.clip(r, low_edge, high_edge)
            dual = negative & (np.maximum(r, clipped) > settings.dual_clip)
        binding_seq = (positive & reducer.broadcast(seq_high)) | (negative & reducer.broadcast(seq_low))
        abs_adv = np.abs(advantages)
        with np.errstate(invalid="ignore"):
            abs_grad = np.where(binding | dual | (abs_adv == 0), 0.0, abs_adv * r)
            abs_grad_seq = np.where(binding_seq | (abs_adv == 0), 0.0, abs_adv * reducer.broadcast(seq_ratio))
    return PolicyTokens(
        reducer=reducer,
        d=d,
        r=r,
        band_low=band_low,
        band_high=band_high,
        sum_d=sum_d,
        mean_d=mean_d,
        seq_low=seq_low,
        seq_high=seq_high,
        advantages=advantages,
        binding=binding,
        dual=dual,
        binding_seq=binding_seq,
        abs_grad=abs_grad,
        abs_grad_seq=abs_grad_seq,
    )


def add_policy_counts(d: np.ndarray, sink: MetricSink) -> None:
    """`count/policy_*` over every loss position: |d| > 20, NaN d, infinite d, overflow of exp(d).

    `d` (M,) is lp_new − lp_old at every loss position, valid or not.
    """
    n_positions = d.shape[0]
    with np.errstate(invalid="ignore"):
        big = np.count_nonzero(d > 20.0) + np.count_nonzero(d < -20.0)
        sink.add("count/policy_abs_logratio_gt_20", big, n_positions)
        sink.add("count/policy_logratio_nan", np.count_nonzero(np.isnan(d)), n_positions)
        sink.add("count/policy_logratio_inf", np.count_nonzero(np.isinf(d)), n_positions)
        sink.add("count/policy_ratio_overflow", np.count_nonzero(d > LOG_FLOAT64_MAX), n_positions)


def add_policy_metrics(pt: PolicyTokens, settings: MetricSettings, sink: MetricSink) -> None:
    """Every `policy/*` key of §4 except `policy/ref_*` (see `add_ref_metrics`)."""
    red = pt.reducer
    n_tok, n_red = red.n_tokens, red.population
    d, r = pt.d, pt.r
    with np.errstate(invalid="ignore", over="ignore"):
        # 1. ratio and log-ratio
        sink.add("policy/ratio_mean", red.mean(r), n_red)
        sink.add("policy/ratio_std", red.spread(r), n_red)
        sink.add("policy/ratio_min", extremum(r, "min"), n_tok)
        sink.add("policy/ratio_max", extremum(r, "max"), n_tok)
        sink.add("policy/logratio_mean", red.mean(d), n_red)
        abs_d = np.abs(d)
        sink.add("policy/logratio_abs_mean", red.mean(abs_d), n_red)
        for (name, _), value in zip(
            LOGRATIO_QUANTILES, quantiles(d, tuple(q for _, q in LOGRATIO_QUANTILES)), strict=True
        ):
            sink.add(f"policy/logratio_{name}", value, n_tok)
        sink.add("policy/logratio_absmax", extremum(abs_d, "max"), n_tok)
        # 2. clip fractions: band (any A) and binding (clipping changes the objective)
        sink.add("policy/clip_frac_band", red.mean(pt.band_low | pt.band_high), n_red)
        sink.add("policy/clip_frac_band_low", red.mean(pt.band_low), n_red)
        sink.add("policy/clip_frac_band_high", red.mean(pt.band_high), n_red)
        if pt.advantages is not None:
            positive, negative = pt.advantages > 0, pt.advantages < 0
            sink.add("policy/clip_frac_binding", red.mean(pt.binding), n_red)
            sink.add("policy/clip_frac_low", red.mean(negative & pt.band_low), n_red)
            sink.add("policy/clip_frac_high", red.mean(positive & pt.band_high), n_red)
            if settings.dual_clip is not None:
                sink.add("policy/dual_clip_frac", red.mean(pt.dual), n_red)
            stopped = pt.binding | pt.dual  # (N,) zero gradient through clipping
            sink.add("policy/zero_grad_frac", red.mean(stopped | (pt.advantages == 0)), n_red)
            passing = pt.abs_grad  # (N,) |A| r where the gradient passes, 0 where it is stopped
            total = float(np.sum(passing))
            share = float(np.sum(passing * (pt.band_low | pt.band_high))) / total if total > 0 else None
            sink.add("policy/band_nonbinding_grad_share", share, n_tok)
            sink.add("policy/seq_token_clip_agreement", red.mean(pt.binding == pt.binding_seq), n_red)
        # 3. KL estimators of KL(π_old‖π_new) (k1, k2, k3) and KL(π_new‖π_old) (rev)
        sink.add("policy/kl_k1", None if (m := red.mean(d)) is None else -m, n_red)
        sink.add("policy/kl_k2", red.mean(0.5 * d * d), n_red)
        sink.add("policy/kl_k3", red.mean(r - 1.0 - d), n_red)
        sink.add("policy/kl_rev_k1", red.mean(r * d), n_red)
        sink.add("policy/kl_rev_k3", red.mean(1.0 + r * (d - 1.0)), n_red)
        # 4. effective sample sizes
        r_sums, r2_sums = red.sample_sums(r), red.sample_sums(r * r)  # (S,)
        total_r, total_r2 = float(np.sum(r_sums)), float(np.sum(r2_sums))
        ess_token = total_r * total_r / (n_tok * total_r2) if n_tok and total_r2 > 0 else None
        sink.add("policy/ess_token", ess_token, n_tok)
        ne = red.nonempty
        n_seq = red.n_nonempty
        sink.add(
            "policy/ess_per_seq", plain_mean(r_sums[ne] ** 2 / (red.n_per_sample[ne] * r2_sums[ne])), n_seq
        )
        sink.add("policy/ess_seq", ess_from_log_weights(pt.sum_d[ne]), n_seq)
        sink.add("policy/ess_seq_geo", ess_from_log_weights(pt.mean_d[ne]), n_seq)
    add_sequence_metrics(pt, sink)


def add_sequence_metrics(pt: PolicyTokens, sink: MetricSink) -> None:
    """`policy/seq_*`: statistics over the S+ non-empty samples of R_i, Σd_i and max_t |d|."""
    red = pt.reducer
    ne = red.nonempty
    n_seq = red.n_nonempty
    with np.errstate(over="ignore", invalid="ignore"):
        seq_ratio = pt.seq_ratio[ne]  # (S+,)
        sum_d = pt.sum_d[ne]  # (S+,)
        sink.add("policy/seq_ratio_mean", plain_mean(seq_ratio), n_seq)
        sink.add("policy/seq_ratio_min", extremum(seq_ratio, "min"), n_seq)
        sink.add("policy/seq_ratio_max", extremum(seq_ratio, "max"), n_seq)
        qs = tuple(q for _, q in SEQ_QUANTILES)
        for (name, _), value in zip(SEQ_QUANTILES, quantiles(seq_ratio, qs), strict=True):
            sink.add(f"policy/seq_ratio_{name}", value, n_seq)
        for (name, _), value in zip(SEQ_QUANTILES, quantiles(sum_d, qs), strict=True):
            sink.add(f"policy/seq_logratio_sum_{name}", value, n_seq)
        sink.add("policy/seq_logratio_sum_absmax", extremum(np.abs(sum_d), "max"), n_seq)
        sink.add("policy/seq_clip_frac_band", fraction(pt.seq_low[ne] | pt.seq_high[ne]), n_seq)
        if pt.advantages is not None:
            adv_sums = red.sample_sums(pt.advantages)[ne]  # (S+,) sign of Ā_i = sign of Σ_t A
            binding = ((adv_sums > 0) & pt.seq_high[ne]) | ((adv_sums < 0) & pt.seq_low[ne])
            sink.add("policy/seq_clip_frac_binding", fraction(binding), n_seq)
        sink.add("policy/seq_max_abs_logratio_mean", plain_mean(red.sample_max(np.abs(pt.d))), n_seq)


def add_ref_metrics(lp_new: np.ndarray, lp_ref: np.ndarray, reducer: TokenReducer, sink: MetricSink) -> None:
    """`policy/ref_kl_k1/k2/k3` with x = lp_new − lp_ref on tokens treated as drawn from π_new.

    `lp_new`, `lp_ref` (N,) are the valid tokens of `reducer`; tokens with a non-finite lp_ref are left out.
    """
    finite_ref = np.isfinite(lp_ref)
    if not finite_ref.all():
        reducer = reducer.subset(finite_ref)
        lp_new, lp_ref = lp_new[finite_ref], lp_ref[finite_ref]
    x = lp_new - lp_ref  # (N_ref,)
    n_red = reducer.population
    with np.errstate(over="ignore", invalid="ignore"):
        sink.add("policy/ref_kl_k1", reducer.mean(x), n_red)
        sink.add("policy/ref_kl_k2", reducer.mean(0.5 * x * x), n_red)
        sink.add("policy/ref_kl_k3", reducer.mean(np.exp(-x) - 1.0 + x), n_red)
