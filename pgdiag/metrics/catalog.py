"""The catalog of native metric keys (docs/metrics.md): family, unit, reduction code and meaning.

Why: `--help`, docs/metrics.md, the rich table grouping and the engine all need the same facts about a
key. The engine stamps units and reduction codes from here through `MetricSink`, so a key that is not in
the catalog cannot be emitted and a unit cannot drift between code and docs.

How: `METRIC_CATALOG` is the one constant tuple of `MetricSpec`; reduction code ``R`` means "the
`--metric-reduction` in force" (token, sample or document) and is resolved when a value is emitted.
`catalog_markdown()` renders the table that docs/metrics.md embeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pgdiag.metrics.values import MetricValue


@dataclass(frozen=True)
class MetricSpec:
    """One native key: its family, unit (see `MetricValue`), reduction code and a one-line meaning."""

    key: str
    family: str
    unit: str
    reduction: str  # R | tok | seq | grp | step | cnt | mode
    meaning: str


METRIC_CATALOG: tuple[MetricSpec, ...] = (
    MetricSpec("policy/ratio_mean", "policy", "ratio", "R", "r = π_new/π_old = exp(lp_new − lp_old)"),
    MetricSpec("policy/ratio_std", "policy", "ratio", "R", "sqrt(R((r − R(r))²))"),
    MetricSpec("policy/ratio_min", "policy", "ratio", "tok", "min of r"),
    MetricSpec("policy/ratio_max", "policy", "ratio", "tok", "max of r"),
    MetricSpec("policy/logratio_mean", "policy", "nats", "R", "d = lp_new − lp_old"),
    MetricSpec("policy/logratio_abs_mean", "policy", "nats", "R", "|d|"),
    MetricSpec("policy/logratio_p1", "policy", "nats", "tok", "0.01 quantile of d (type 7)"),
    MetricSpec("policy/logratio_p5", "policy", "nats", "tok", "0.05 quantile of d (type 7)"),
    MetricSpec("policy/logratio_p50", "policy", "nats", "tok", "0.5 quantile of d (type 7)"),
    MetricSpec("policy/logratio_p95", "policy", "nats", "tok", "0.95 quantile of d (type 7)"),
    MetricSpec("policy/logratio_p99", "policy", "nats", "tok", "0.99 quantile of d (type 7)"),
    MetricSpec("policy/logratio_p999", "policy", "nats", "tok", "0.999 quantile of d (type 7)"),
    MetricSpec("policy/logratio_absmax", "policy", "nats", "tok", "max |d|; headline of the identity check"),
    MetricSpec(
        "policy/clip_frac_band",
        "policy",
        "fraction",
        "R",
        "r outside [1 − ε_l, 1 + ε_h], any A (Fast-LLM/PipelineRL)",
    ),
    MetricSpec("policy/clip_frac_band_low", "policy", "fraction", "R", "r < 1 − ε_l"),
    MetricSpec("policy/clip_frac_band_high", "policy", "fraction", "R", "r > 1 + ε_h"),
    MetricSpec(
        "policy/clip_frac_binding",
        "policy",
        "fraction",
        "R",
        "clip binds: (A > 0 ∧ r > 1 + ε_h) ∨ (A < 0 ∧ r < 1 − ε_l) (verl pg_clipfrac)",
    ),
    MetricSpec(
        "policy/clip_frac_low", "policy", "fraction", "R", "A < 0 ∧ r < 1 − ε_l (TRL clip_ratio/low_mean)"
    ),
    MetricSpec(
        "policy/clip_frac_high", "policy", "fraction", "R", "A > 0 ∧ r > 1 + ε_h (TRL clip_ratio/high_mean)"
    ),
    MetricSpec(
        "policy/dual_clip_frac",
        "policy",
        "fraction",
        "R",
        "A < 0 ∧ max(r, clip(r)) > C (only with --dual-clip; verl pg_clipfrac_lower)",
    ),
    MetricSpec(
        "policy/zero_grad_frac",
        "policy",
        "fraction",
        "R",
        "tokens with zero gradient: A = 0 ∨ binding ∨ dual clip",
    ),
    MetricSpec(
        "policy/band_nonbinding_grad_share",
        "policy",
        "fraction",
        "step",
        "share of unclipped Σ|A|r carried by out-of-band tokens that still pass gradient",
    ),
    MetricSpec("policy/kl_k1", "policy", "nats", "R", "−d: k1 estimate of KL(π_old‖π_new), can be < 0"),
    MetricSpec("policy/kl_k2", "policy", "nats", "R", "d²/2"),
    MetricSpec("policy/kl_k3", "policy", "nats", "R", "r − 1 − d ≥ 0: k3 estimate of KL(π_old‖π_new)"),
    MetricSpec("policy/kl_rev_k1", "policy", "nats", "R", "r·d: KL(π_new‖π_old) through importance weights"),
    MetricSpec("policy/kl_rev_k3", "policy", "nats", "R", "1 − r + r·d ≥ 0: KL(π_new‖π_old)"),
    MetricSpec(
        "policy/ess_token", "policy", "1", "step", "(Σr)² / (N Σr²), normalised Kish ESS (PipelineRL rl/ess)"
    ),
    MetricSpec("policy/ess_per_seq", "policy", "1", "seq", "mean over samples of (Σ_t r)² / (N_i Σ_t r²)"),
    MetricSpec(
        "policy/ess_seq", "policy", "1", "step", "(Σ W_i)² / (S+ Σ W_i²), W_i = exp(Σd_i), in log space"
    ),
    MetricSpec("policy/ess_seq_geo", "policy", "1", "step", "same with R_i = exp(δ̄_i)"),
    MetricSpec(
        "policy/seq_ratio_mean", "policy", "ratio", "seq", "R_i = exp(mean_t d), GSPO geometric-mean ratio"
    ),
    MetricSpec("policy/seq_ratio_min", "policy", "ratio", "seq", "min of R_i"),
    MetricSpec("policy/seq_ratio_max", "policy", "ratio", "seq", "max of R_i"),
    MetricSpec("policy/seq_ratio_p1", "policy", "ratio", "seq", "0.01 quantile of R_i"),
    MetricSpec("policy/seq_ratio_p5", "policy", "ratio", "seq", "0.05 quantile of R_i"),
    MetricSpec("policy/seq_ratio_p50", "policy", "ratio", "seq", "0.5 quantile of R_i"),
    MetricSpec("policy/seq_ratio_p95", "policy", "ratio", "seq", "0.95 quantile of R_i"),
    MetricSpec("policy/seq_ratio_p99", "policy", "ratio", "seq", "0.99 quantile of R_i"),
    MetricSpec(
        "policy/seq_logratio_sum_p1", "policy", "nats", "seq", "0.01 quantile of Σd_i (log product ratio)"
    ),
    MetricSpec(
        "policy/seq_logratio_sum_p5", "policy", "nats", "seq", "0.05 quantile of Σd_i (log product ratio)"
    ),
    MetricSpec(
        "policy/seq_logratio_sum_p50", "policy", "nats", "seq", "0.5 quantile of Σd_i (log product ratio)"
    ),
    MetricSpec(
        "policy/seq_logratio_sum_p95", "policy", "nats", "seq", "0.95 quantile of Σd_i (log product ratio)"
    ),
    MetricSpec(
        "policy/seq_logratio_sum_p99", "policy", "nats", "seq", "0.99 quantile of Σd_i (log product ratio)"
    ),
    MetricSpec("policy/seq_logratio_sum_absmax", "policy", "nats", "seq", "max |Σd_i|"),
    MetricSpec("policy/seq_clip_frac_band", "policy", "fraction", "seq", "R_i outside the band"),
    MetricSpec(
        "policy/seq_clip_frac_binding",
        "policy",
        "fraction",
        "seq",
        "(Ā_i > 0 ∧ R_i > 1 + ε_h) ∨ (Ā_i < 0 ∧ R_i < 1 − ε_l)",
    ),
    MetricSpec(
        "policy/seq_token_clip_agreement",
        "policy",
        "fraction",
        "R",
        "token-level and sequence-level clip decisions agree",
    ),
    MetricSpec("policy/seq_max_abs_logratio_mean", "policy", "nats", "seq", "mean over samples of max_t |d|"),
    MetricSpec(
        "policy/ref_kl_k1", "policy", "nats", "R", "x = lp_new − lp_ref (tokens treated as drawn from π_new)"
    ),
    MetricSpec("policy/ref_kl_k2", "policy", "nats", "R", "x²/2"),
    MetricSpec("policy/ref_kl_k3", "policy", "nats", "R", "e^(−x) − 1 + x: KL(π_new‖π_ref)"),
    MetricSpec("mismatch/bias", "mismatch", "nats", "R", "Δ = lp_b − lp_a"),
    MetricSpec("mismatch/sd", "mismatch", "nats", "R", "sqrt(R((Δ − R(Δ))²))"),
    MetricSpec("mismatch/rms", "mismatch", "nats", "R", "sqrt(R(Δ²))"),
    MetricSpec("mismatch/abs_mean", "mismatch", "nats", "R", "|Δ|"),
    MetricSpec("mismatch/abs_p50", "mismatch", "nats", "tok", "median |Δ|"),
    MetricSpec("mismatch/abs_p95", "mismatch", "nats", "tok", "0.95 quantile of |Δ|"),
    MetricSpec("mismatch/abs_p99", "mismatch", "nats", "tok", "0.99 quantile of |Δ|"),
    MetricSpec("mismatch/abs_max", "mismatch", "nats", "tok", "max |Δ|"),
    MetricSpec("mismatch/pearson_r", "mismatch", "1", "tok", "Pearson correlation of (lp_a, lp_b)"),
    MetricSpec("mismatch/fit_slope", "mismatch", "1", "tok", "OLS slope β of lp_b ≈ α + β·lp_a"),
    MetricSpec("mismatch/fit_intercept", "mismatch", "nats", "tok", "OLS intercept α"),
    MetricSpec("mismatch/fit_resid_rms", "mismatch", "nats", "tok", "RMS residual of the OLS fit"),
    MetricSpec("mismatch/frac_out_strict", "mismatch", "fraction", "R", "ρ = e^Δ outside [0.999, 1.002]"),
    MetricSpec("mismatch/frac_out_1pct", "mismatch", "fraction", "R", "ρ = e^Δ outside [0.99, 1.01]"),
    MetricSpec("mismatch/frac_out_10pct", "mismatch", "fraction", "R", "ρ = e^Δ outside [0.9, 1.1]"),
    MetricSpec("mismatch/frac_out_clip", "mismatch", "fraction", "R", "ρ = e^Δ outside [1 − ε_l, 1 + ε_h]"),
    MetricSpec("mismatch/frac_out_2x", "mismatch", "fraction", "R", "ρ = e^Δ outside [0.5, 2]"),
    MetricSpec(
        "mismatch/seq_frac_out_strict", "mismatch", "fraction", "seq", "exp(mean_t Δ) outside [0.999, 1.002]"
    ),
    MetricSpec(
        "mismatch/seq_frac_out_1pct", "mismatch", "fraction", "seq", "exp(mean_t Δ) outside [0.99, 1.01]"
    ),
    MetricSpec(
        "mismatch/seq_frac_out_10pct", "mismatch", "fraction", "seq", "exp(mean_t Δ) outside [0.9, 1.1]"
    ),
    MetricSpec(
        "mismatch/seq_frac_out_clip",
        "mismatch",
        "fraction",
        "seq",
        "exp(mean_t Δ) outside [1 − ε_l, 1 + ε_h]",
    ),
    MetricSpec("mismatch/seq_frac_out_2x", "mismatch", "fraction", "seq", "exp(mean_t Δ) outside [0.5, 2]"),
    MetricSpec("mismatch/kl_k1", "mismatch", "nats", "R", "−Δ: KL(π_a‖π_b) (verl rollout_corr/kl)"),
    MetricSpec("mismatch/kl_k3", "mismatch", "nats", "R", "ρ − 1 − Δ: KL(π_a‖π_b) (verl rollout_corr/k3_kl)"),
    MetricSpec("mismatch/kl_rev_k1", "mismatch", "nats", "R", "ρΔ: KL(π_b‖π_a)"),
    MetricSpec("mismatch/kl_rev_k3", "mismatch", "nats", "R", "1 − ρ + ρΔ: KL(π_b‖π_a)"),
    MetricSpec("mismatch/tmpe", "mismatch", "ratio", "R", "exp|Δ| (NeMo-RL token_mult_prob_error)"),
    MetricSpec("mismatch/chi2_token", "mismatch", "1", "R", "R(ρ²) − 1"),
    MetricSpec("mismatch/chi2_seq", "mismatch", "1", "seq", "mean over samples of exp(2 Σ_t Δ) − 1"),
    MetricSpec("mismatch/ess_token", "mismatch", "1", "step", "(Σρ)² / (N Σρ²)"),
    MetricSpec(
        "mismatch/ess_seq",
        "mismatch",
        "1",
        "step",
        "Kish ESS of the sequence weights exp(Σ_t Δ), in log space",
    ),
    MetricSpec("mismatch/abs_dprob_mean", "mismatch", "prob", "R", "|e^lp_b − e^lp_a|"),
    MetricSpec("mismatch/abs_dprob_p99", "mismatch", "prob", "tok", "0.99 quantile of |e^lp_b − e^lp_a|"),
    MetricSpec("mismatch/abs_dprob_max", "mismatch", "prob", "tok", "max |e^lp_b − e^lp_a|"),
    MetricSpec("mismatch/prob_pearson_r", "mismatch", "1", "tok", "Pearson correlation of (e^lp_a, e^lp_b)"),
    MetricSpec(
        "mismatch/kept_mass_mean", "mismatch", "prob", "R", "Σ_{j∈K} π(j) of a kept-set recompute (lp_b's K)"
    ),
    MetricSpec("mismatch/kept_mass_p05", "mismatch", "prob", "tok", "0.05 quantile of the kept mass"),
    MetricSpec("mismatch/kept_mass_min", "mismatch", "prob", "tok", "min of the kept mass"),
    MetricSpec(
        "mismatch/truncation_bias",
        "mismatch",
        "nats",
        "R",
        "−log kept mass = log π^K(a) − log π(a): the log-ratio truncation puts between K and the full vocabulary",
    ),
    MetricSpec(
        "mismatch/full_bias", "mismatch", "nats", "R", "lp_b_full − lp_a: Δ against the full-vocabulary lp_b"
    ),
    MetricSpec("mismatch/full_abs_mean", "mismatch", "nats", "R", "|lp_b_full − lp_a|"),
    MetricSpec(
        "mismatch/kept_kl",
        "mismatch",
        "nats",
        "R",
        "KL over K of the engine's kept log-probs (sampling_kept_logprobs) against lp_b's, both renormalised",
    ),
    MetricSpec("mismatch/seq_mean_delta_mean", "mismatch", "nats", "seq", "mean of δ̄_i = Σ_t Δ / N_i"),
    MetricSpec("mismatch/seq_mean_delta_sd", "mismatch", "nats", "seq", "population sd of δ̄_i"),
    MetricSpec("mismatch/seq_mean_delta_absmax", "mismatch", "nats", "seq", "max |δ̄_i|"),
    MetricSpec(
        "mismatch/seq_sum_delta_p1",
        "mismatch",
        "nats",
        "seq",
        "0.01 quantile of Σ_t Δ (log sequence IS ratio)",
    ),
    MetricSpec(
        "mismatch/seq_sum_delta_p5",
        "mismatch",
        "nats",
        "seq",
        "0.05 quantile of Σ_t Δ (log sequence IS ratio)",
    ),
    MetricSpec(
        "mismatch/seq_sum_delta_p50",
        "mismatch",
        "nats",
        "seq",
        "0.5 quantile of Σ_t Δ (log sequence IS ratio)",
    ),
    MetricSpec(
        "mismatch/seq_sum_delta_p95",
        "mismatch",
        "nats",
        "seq",
        "0.95 quantile of Σ_t Δ (log sequence IS ratio)",
    ),
    MetricSpec(
        "mismatch/seq_sum_delta_p99",
        "mismatch",
        "nats",
        "seq",
        "0.99 quantile of Σ_t Δ (log sequence IS ratio)",
    ),
    MetricSpec("mismatch/seq_ratio_p1", "mismatch", "ratio", "seq", "exp(seq_sum_delta_p1)"),
    MetricSpec("mismatch/seq_ratio_p5", "mismatch", "ratio", "seq", "exp(seq_sum_delta_p5)"),
    MetricSpec("mismatch/seq_ratio_p50", "mismatch", "ratio", "seq", "exp(seq_sum_delta_p50)"),
    MetricSpec("mismatch/seq_ratio_p95", "mismatch", "ratio", "seq", "exp(seq_sum_delta_p95)"),
    MetricSpec("mismatch/seq_ratio_p99", "mismatch", "ratio", "seq", "exp(seq_sum_delta_p99)"),
    MetricSpec(
        "mismatch/tau_fit",
        "mismatch",
        "1",
        "tok",
        "best-fit temperature τ* of b's logits to lp_a (needs logits)",
    ),
    MetricSpec("mismatch/tau_fit_rms", "mismatch", "nats", "tok", "RMS residual at τ*"),
    MetricSpec("advantage/mean", "advantage", "1", "R", "A"),
    MetricSpec("advantage/abs_mean", "advantage", "1", "R", "|A|"),
    MetricSpec("advantage/std", "advantage", "1", "R", "sqrt(R((A − R(A))²))"),
    MetricSpec("advantage/min", "advantage", "1", "tok", "min of A"),
    MetricSpec("advantage/max", "advantage", "1", "tok", "max of A"),
    MetricSpec("advantage/frac_pos", "advantage", "fraction", "R", "A > 0"),
    MetricSpec("advantage/frac_neg", "advantage", "fraction", "R", "A < 0"),
    MetricSpec("advantage/frac_zero", "advantage", "fraction", "R", "A = 0"),
    MetricSpec(
        "advantage/group_zero_std_frac",
        "advantage",
        "fraction",
        "grp",
        "groups (≥ 2 samples) whose reward (else Ā_i) has std ≤ --zero-std-atol",
    ),
    MetricSpec("advantage/group_seq_sum_absmax", "advantage", "1", "grp", "max_g |Σ_{i∈g} Ā_i|"),
    MetricSpec(
        "advantage/group_token_sum_absmax",
        "advantage",
        "1",
        "grp",
        "max_g |Σ_{i∈g} Σ_t A| (what token weighting pushes)",
    ),
    MetricSpec("grad/group_token_share_max", "group", "fraction", "grp", "max_g N_g / N"),
    MetricSpec("grad/group_token_share_min", "group", "fraction", "grp", "min_g N_g / N"),
    MetricSpec("entropy/mean", "entropy", "nats", "R", "H"),
    MetricSpec("entropy/p5", "entropy", "nats", "tok", "0.05 quantile of H"),
    MetricSpec("entropy/p50", "entropy", "nats", "tok", "median H"),
    MetricSpec("entropy/p95", "entropy", "nats", "tok", "0.95 quantile of H"),
    MetricSpec("entropy/min", "entropy", "nats", "tok", "min of H"),
    MetricSpec("entropy/max", "entropy", "nats", "tok", "max of H"),
    MetricSpec("count/tokens", "count", "count", "cnt", "N, valid tokens (policy/loss/advantage rule)"),
    MetricSpec("count/tokens_masked", "count", "count", "cnt", "loss positions (Σ m)"),
    MetricSpec(
        "count/tokens_invalid",
        "count",
        "count",
        "cnt",
        "loss positions failing the finiteness test (Σ m − N)",
    ),
    MetricSpec("count/samples", "count", "count", "cnt", "S, samples (rows) in the step"),
    MetricSpec("count/samples_empty", "count", "count", "cnt", "S − S+, samples without valid tokens"),
    MetricSpec("count/docs", "count", "count", "cnt", "D, documents"),
    MetricSpec("count/groups", "count", "count", "cnt", "P, prompt groups"),
    MetricSpec("count/groups_singleton", "count", "count", "cnt", "groups with one sample"),
    MetricSpec("count/groups_split", "count", "count", "cnt", "groups straddling a step boundary"),
    MetricSpec("count/policy_abs_logratio_gt_20", "count", "count", "cnt", "loss positions with |d| > 20"),
    MetricSpec("count/policy_logratio_nan", "count", "count", "cnt", "loss positions with d = NaN"),
    MetricSpec("count/policy_logratio_inf", "count", "count", "cnt", "loss positions with d = ±inf"),
    MetricSpec(
        "count/policy_ratio_overflow", "count", "count", "cnt", "loss positions with d > 709.78 (r = +inf)"
    ),
    MetricSpec("count/mismatch_tokens", "count", "count", "cnt", "valid tokens of the mismatch pair"),
    MetricSpec(
        "count/mismatch_invalid",
        "count",
        "count",
        "cnt",
        "loss positions failing the mismatch finiteness test",
    ),
    MetricSpec("count/mismatch_abs_delta_gt_20", "count", "count", "cnt", "loss positions with |Δ| > 20"),
    MetricSpec(
        "count/adv_nonconstant_samples",
        "count",
        "count",
        "cnt",
        "samples whose A varies over their valid tokens",
    ),
    MetricSpec(
        "loss/pg", "loss", "loss", "mode", "the mode selected by --aggregation (after alias resolution)"
    ),
    MetricSpec("loss/token_mean", "loss", "loss", "mode", "Σ m'ℓ / N"),
    MetricSpec("loss/sample_mean", "loss", "loss", "mode", "(1/S) Σ_i Σ_t m'ℓ / N_i"),
    MetricSpec("loss/prompt_mean", "loss", "loss", "mode", "(1/P) Σ_g Σ_{i∈g} Σ_t m'ℓ / N_g"),
    MetricSpec("loss/constant", "loss", "loss", "mode", "Σ m'ℓ / (L·S), needs --divisor"),
    MetricSpec("loss/seq_mean_token_sum", "loss", "loss", "mode", "Σ m'ℓ / S"),
    MetricSpec("loss/token_sum", "loss", "loss", "mode", "Σ m'ℓ"),
    MetricSpec("loss/gspo_seq_mean", "loss", "loss", "mode", "(1/S) Σ_i Σ_t m'ℓ^G / N_i"),
    MetricSpec("loss/gspo_length_prop", "loss", "loss", "mode", "(1/S) Σ_i Σ_t m'ℓ^G"),
    MetricSpec("loss/gspo_token_mean", "loss", "loss", "mode", "Σ m'ℓ^G / N"),
    MetricSpec("grad/token_mean_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under token_mean"),
    MetricSpec("grad/token_mean_weight_sum", "grad", "1", "mode", "Σ m' w_t under token_mean"),
    MetricSpec(
        "grad/token_mean_length_corr", "grad", "1", "mode", "Pearson(W_i, N_i) over S+ under token_mean"
    ),
    MetricSpec(
        "grad/token_mean_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under token_mean",
    ),
    MetricSpec("grad/sample_mean_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under sample_mean"),
    MetricSpec("grad/sample_mean_weight_sum", "grad", "1", "mode", "Σ m' w_t under sample_mean"),
    MetricSpec(
        "grad/sample_mean_length_corr", "grad", "1", "mode", "Pearson(W_i, N_i) over S+ under sample_mean"
    ),
    MetricSpec(
        "grad/sample_mean_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under sample_mean",
    ),
    MetricSpec("grad/prompt_mean_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under prompt_mean"),
    MetricSpec("grad/prompt_mean_weight_sum", "grad", "1", "mode", "Σ m' w_t under prompt_mean"),
    MetricSpec(
        "grad/prompt_mean_length_corr", "grad", "1", "mode", "Pearson(W_i, N_i) over S+ under prompt_mean"
    ),
    MetricSpec(
        "grad/prompt_mean_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under prompt_mean",
    ),
    MetricSpec("grad/constant_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under constant"),
    MetricSpec("grad/constant_weight_sum", "grad", "1", "mode", "Σ m' w_t under constant"),
    MetricSpec("grad/constant_length_corr", "grad", "1", "mode", "Pearson(W_i, N_i) over S+ under constant"),
    MetricSpec(
        "grad/constant_length_elasticity", "grad", "1", "mode", "OLS slope of ln W_i on ln N_i under constant"
    ),
    MetricSpec(
        "grad/seq_mean_token_sum_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under seq_mean_token_sum"
    ),
    MetricSpec(
        "grad/seq_mean_token_sum_weight_sum", "grad", "1", "mode", "Σ m' w_t under seq_mean_token_sum"
    ),
    MetricSpec(
        "grad/seq_mean_token_sum_length_corr",
        "grad",
        "1",
        "mode",
        "Pearson(W_i, N_i) over S+ under seq_mean_token_sum",
    ),
    MetricSpec(
        "grad/seq_mean_token_sum_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under seq_mean_token_sum",
    ),
    MetricSpec("grad/token_sum_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under token_sum"),
    MetricSpec("grad/token_sum_weight_sum", "grad", "1", "mode", "Σ m' w_t under token_sum"),
    MetricSpec(
        "grad/token_sum_length_corr", "grad", "1", "mode", "Pearson(W_i, N_i) over S+ under token_sum"
    ),
    MetricSpec(
        "grad/token_sum_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under token_sum",
    ),
    MetricSpec("grad/gspo_seq_mean_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under gspo_seq_mean"),
    MetricSpec("grad/gspo_seq_mean_weight_sum", "grad", "1", "mode", "Σ m' w_t under gspo_seq_mean"),
    MetricSpec(
        "grad/gspo_seq_mean_length_corr", "grad", "1", "mode", "Pearson(W_i, N_i) over S+ under gspo_seq_mean"
    ),
    MetricSpec(
        "grad/gspo_seq_mean_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under gspo_seq_mean",
    ),
    MetricSpec("grad/gspo_length_prop_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under gspo_length_prop"),
    MetricSpec("grad/gspo_length_prop_weight_sum", "grad", "1", "mode", "Σ m' w_t under gspo_length_prop"),
    MetricSpec(
        "grad/gspo_length_prop_length_corr",
        "grad",
        "1",
        "mode",
        "Pearson(W_i, N_i) over S+ under gspo_length_prop",
    ),
    MetricSpec(
        "grad/gspo_length_prop_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under gspo_length_prop",
    ),
    MetricSpec("grad/gspo_token_mean_scale", "grad", "1", "mode", "Σ m' w_t |g_t| under gspo_token_mean"),
    MetricSpec("grad/gspo_token_mean_weight_sum", "grad", "1", "mode", "Σ m' w_t under gspo_token_mean"),
    MetricSpec(
        "grad/gspo_token_mean_length_corr",
        "grad",
        "1",
        "mode",
        "Pearson(W_i, N_i) over S+ under gspo_token_mean",
    ),
    MetricSpec(
        "grad/gspo_token_mean_length_elasticity",
        "grad",
        "1",
        "mode",
        "OLS slope of ln W_i on ln N_i under gspo_token_mean",
    ),
    MetricSpec(
        "grad/grad_divisor_scale",
        "grad",
        "1",
        "mode",
        "Σ m' |g_t| / G (--grad-divisor) for the selected mode",
    ),
    MetricSpec("grad/grad_divisor_ratio", "grad", "1", "mode", "grad_divisor_scale / grad/<selected>_scale"),
)


def catalog_by_key() -> dict[str, MetricSpec]:
    """The catalog indexed by key."""
    return {spec.key: spec for spec in METRIC_CATALOG}


def catalog_markdown() -> str:
    """The metric table of docs/metrics.md: one line per key with unit, reduction and meaning."""
    lines = ["| key | unit | reduction | meaning |", "|---|---|---|---|"]
    for spec in METRIC_CATALOG:
        meaning = spec.meaning.replace("|", "\\|")
        lines.append(f"| `{spec.key}` | {spec.unit} | {spec.reduction} | {meaning} |")
    return "\n".join(lines) + "\n"


@dataclass
class MetricSink:
    """Collects the values of one step, stamping each with the catalog's unit and reduction.

    `metric_reduction` resolves the catalog code ``R``; a key missing from the catalog is a bug and
    raises KeyError.
    """

    metric_reduction: str
    specs: dict[str, MetricSpec] = field(default_factory=catalog_by_key)
    values: list[MetricValue] = field(default_factory=list)

    def add(self, key: str, value: float | int | None, n: int) -> None:
        """Record `key` = `value` computed over `n` tokens, samples or groups."""
        spec = self.specs[key]
        reduction = self.metric_reduction if spec.reduction == "R" else spec.reduction
        number = None if value is None else float(value)
        self.values.append(MetricValue(key, number, spec.unit, reduction, int(n)))
