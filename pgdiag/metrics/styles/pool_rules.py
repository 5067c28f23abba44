"""The pooling rule of every key of every key style (docs/key-styles.md, "The `all` row"): the table alone.

What: `PoolRule` says how the pooled value of one key follows from its per-step values (kind, weight, guard,
integer numerator, offset, empty-row value); `POOL_RULES[style][key]` holds the rule of every key a style
prints, `COUNTS` those of the native `count/*` keys every style adds, and `pool_rules(settings)` the rules of
one run's keys. `metrics.styles.pooled` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pgdiag.metrics.settings import MetricSettings

EPS = 1e-8  # verl masked_mean's denominator guard
PARTIAL = "partial"  # the reduction of a per-step partial value: consumed by pooling, never reported
PEARSON_PARTIALS = (
    "partial/probs_b_mean",
    "partial/probs_a_mean",
    "partial/probs_b_css",
    "partial/probs_a_css",
    "partial/probs_csp",
)


@dataclass(frozen=True)
class PoolRule:
    """How the pooled value of one key follows from the step values.

    kind: ``mode`` (unweighted mean over the steps with a value), ``sum``, ``max``, ``min``, ``mean``
    (weighted mean), ``std`` (sample std pooled from each step's n, mean and std), ``derived`` (from other
    pooled keys), ``none`` (null with a notice: not decomposable).
    weight: a step's weight for ``mean``: ``n`` (the value's own n), ``samples`` (`count/samples`) or
    ``docs`` (`count/docs`).
    guard: the denominator: ``plain`` Σ/W (null at W = 0), ``max1`` Σ/max(W, 1), ``eps`` Σ/(W + 1e-8).
    integer: the numerator is an integer count (a fraction), recovered exactly by rounding.
    offset: the value is the weighted mean minus `offset` (verl's χ²: mean − 1).
    empty: the value one row of a step without loss tokens adds where that step prints null or nothing
    (None: such a step adds nothing).
    source: for ``std``, the key holding the step mean; for ``derived``, the derivation's name.
    whole_groups: computed over whole prompt groups: null (with a notice) once a group straddles a step.
    """

    kind: str
    weight: str = "n"
    guard: str = "plain"
    integer: bool = False
    offset: float = 0.0
    empty: float | None = None
    source: str = ""
    whole_groups: bool = False


MODE = PoolRule("mode")
SUM = PoolRule("sum")
MAX = PoolRule("max")
MIN = PoolRule("min")
GROUPS = PoolRule("sum", whole_groups=True)
NOT_DECOMPOSABLE = PoolRule("none")
TOKENEPS = PoolRule("mean", "n", "eps")  # verl masked_mean
TOKENEPS_COUNT = PoolRule("mean", "n", "eps", integer=True)
TOKEN_GUARD = PoolRule("mean", "n", "max1")  # TRL/Liger/miles token mean: Σ/max(N, 1)
TOKEN_GUARD_COUNT = PoolRule("mean", "n", "max1", integer=True)
TOKEN_PLAIN = PoolRule("mean", "n", "plain")  # torch .mean(): null on no tokens
SAMPLES = PoolRule("mean", "samples", "plain")  # miles SM, per-row means over S
SAMPLES_COUNT = PoolRule("mean", "samples", "plain", integer=True)
DOCS = PoolRule("mean", "docs", "plain")  # Fast-LLM per-document mean over D
PIPELINERL_DOC = PoolRule("mean", "samples", "plain", empty=0.0)  # (1/S) Σ_i Σ_t x / N_i, empty rows add 0


def _verl_row(empty: float, offset: float = 0.0) -> PoolRule:
    """verl's per-row rollout_corr keys: a mean over all S rows; an empty row has μ = 0."""
    return PoolRule("mean", "samples", "plain", offset=offset, empty=empty)


COUNTS: dict[str, PoolRule] = {
    "count/tokens": SUM,
    "count/tokens_masked": SUM,
    "count/tokens_invalid": SUM,
    "count/samples": SUM,
    "count/samples_empty": SUM,
    "count/docs": SUM,
    "count/adv_nonconstant_samples": SUM,
    "count/policy_abs_logratio_gt_20": SUM,
    "count/policy_logratio_nan": SUM,
    "count/policy_logratio_inf": SUM,
    "count/policy_ratio_overflow": SUM,
    "count/mismatch_tokens": SUM,
    "count/mismatch_invalid": SUM,
    "count/mismatch_abs_delta_gt_20": SUM,
    "count/groups": GROUPS,
    "count/groups_singleton": GROUPS,
    "count/groups_split": GROUPS,
}

# Fast-LLM keys carry the loss name: "{p}" is replaced by `--loss-name` (default grpo).
POOL_RULES: dict[str, dict[str, PoolRule]] = {
    "fast-llm": {
        "{p}": MODE,
        "lm_head_loss": MODE,
        "{p}_new_logprobs": DOCS,
        "{p}_old_logprobs": DOCS,
        "{p}_ratio_new_old": DOCS,
        "{p}_ratio_new_old_sum": SUM,
        "{p}_ratio_new_old_squared_sum": SUM,
        "{p}_kl_new_old": DOCS,
        "{p}_clipped_ratio_fraction": DOCS,
        "{p}_advantage": DOCS,
        "{p}_max_advantage": MAX,
        "{p}_min_advantage": MIN,
        "{p}_num_tokens": SUM,
        "{p}_num_segments": SUM,
        "{p}_entropy": DOCS,
        "{p}_train_samples_reward": DOCS,
        "{p}_max_train_samples_reward": MAX,
        "{p}_min_train_samples_reward": MIN,
    },
    "verl": {
        "actor/pg_loss": MODE,
        "actor/pg_clipfrac": TOKENEPS_COUNT,
        "actor/ppo_kl": TOKENEPS,
        "actor/pg_clipfrac_lower": TOKENEPS_COUNT,
        "actor/entropy": MODE,
        "actor/kl_loss": MODE,
        "critic/advantages/mean": TOKEN_PLAIN,
        "critic/advantages/max": MAX,
        "critic/advantages/min": MIN,
        "rollout_corr/kl": TOKENEPS,
        "rollout_corr/k3_kl": TOKENEPS,
        "rollout_corr/training_ppl": _verl_row(1.0),
        "rollout_corr/training_log_ppl": _verl_row(0.0),
        "rollout_corr/rollout_ppl": _verl_row(1.0),
        "rollout_corr/rollout_log_ppl": _verl_row(0.0),
        "rollout_corr/log_ppl_diff": _verl_row(0.0),
        "rollout_corr/log_ppl_abs_diff": _verl_row(0.0),
        "rollout_corr/log_ppl_diff_max": PoolRule("max", "samples", empty=0.0),
        "rollout_corr/log_ppl_diff_min": PoolRule("min", "samples", empty=0.0),
        "rollout_corr/ppl_ratio": _verl_row(1.0),
        "rollout_corr/chi2_token": PoolRule("mean", "n", "eps", offset=1.0),
        "rollout_corr/chi2_seq": _verl_row(0.0, offset=1.0),
        "rollout_corr/rollout_is_mean": TOKENEPS,
        "rollout_corr/rollout_is_max": MAX,
        "rollout_corr/rollout_is_min": MIN,
        "rollout_corr/rollout_is_ratio_fraction_high": TOKENEPS_COUNT,
        "rollout_corr/rollout_is_ratio_fraction_low": TOKENEPS_COUNT,
        "rollout_corr/rollout_is_std": PoolRule("derived", source="verl_is_std"),
        "rollout_corr/rollout_is_eff_sample_size": PoolRule("derived", source="verl_is_ess"),
        "training/rollout_probs_diff_mean": TOKEN_PLAIN,
        "training/rollout_probs_diff_max": MAX,
        "training/rollout_probs_diff_std": PoolRule("std", source="training/rollout_probs_diff_mean"),
        "training/rollout_actor_probs_pearson_corr": PoolRule("derived", source="verl_pearson"),
    },
    "trl": {
        "loss": MODE,
        "clip_ratio/low_mean": TOKEN_GUARD_COUNT,  # sequence level: rows / B, B >= 1 on every step
        "clip_ratio/low_min": MIN,
        "clip_ratio/high_mean": TOKEN_GUARD_COUNT,
        "clip_ratio/high_max": MAX,
        "clip_ratio/region_mean": TOKEN_GUARD_COUNT,
        "entropy": TOKEN_GUARD,
        "kl": TOKEN_GUARD,
        "sampling/sampling_logp_difference/mean": TOKEN_GUARD,  # 0 when no token: Σ/max(n, 1)
        "sampling/sampling_logp_difference/max": MAX,  # |Δ| >= 0, so a step's 0-if-none is neutral
        "sampling/importance_sampling_ratio/min": MIN,
        "sampling/importance_sampling_ratio/mean": SAMPLES,
        "sampling/importance_sampling_ratio/max": MAX,
        "frac_reward_zero_std": PoolRule("mean", "samples", "plain", integer=True, whole_groups=True),
    },
    "liger": {
        "loss": MODE,
        "kl": TOKEN_GUARD,
        "clip_ratio": TOKEN_GUARD_COUNT,
    },
    "miles": {
        "train/loss": MODE,
        "train/pg_loss": MODE,
        "train/pg_clipfrac": SAMPLES,
        "train/ppo_kl": SAMPLES,
        "train/ess_ratio": TOKEN_GUARD,  # n is S (sample_mean) or N (token_mean); both >= 1 or 0 · guard
        "train/ois": SAMPLES,
        "train/entropy_loss": SAMPLES,
        "train/train_rollout_logprob_abs_diff": SAMPLES,
        "train/train_rollout_kl": SAMPLES,
        "train/kl_loss": SAMPLES,
        "train/tis": SAMPLES,
        "train/tis_clipfrac": SAMPLES,
        "train/tis_abs": SAMPLES,
    },
    "pipelinerl": {
        "rl/loss": MODE,
        "rl/new_logprobs": PIPELINERL_DOC,
        "rl/old_logprobs": PIPELINERL_DOC,
        "rl/ref_logprobs": PIPELINERL_DOC,
        "rl/advantage": PIPELINERL_DOC,
        "rl/max_advantage": MAX,
        "rl/min_advantage": MIN,
        "rl/reward": PIPELINERL_DOC,
        "rl/max_reward": MAX,
        "rl/min_reward": MIN,
        "rl/entropy": PIPELINERL_DOC,
        "rl/ratio_new_old": PIPELINERL_DOC,
        "rl/ratio_new_old_sum": SUM,
        "rl/ratio_new_old_squared_sum": SUM,
        "rl/num_output_tokens_sum": SUM,
        "rl/ess": PoolRule("derived", source="pipelinerl_ess"),
        "rl/kl_new_old": PIPELINERL_DOC,
        "rl/clamp_log_ratio_new_old_indicator": PIPELINERL_DOC,
        "rl/mean_abs_log_ratio_new_old": PIPELINERL_DOC,
        "rl/kl": PIPELINERL_DOC,
        "rl/max_kl": MAX,
        "rl/min_kl": MIN,
        "rl/ratio_ref_new": PIPELINERL_DOC,
        "rl/ratio_ref_old": PIPELINERL_DOC,
        "rl/clamp_log_ratio_ref_new_indicator": PIPELINERL_DOC,
    },
}


def pool_rules(settings: MetricSettings) -> dict[str, PoolRule]:
    """The pooling rule of every key `settings.key_style` can print (the style's keys, then `count/*`)."""
    prefix = settings.style.loss_name or "grpo"
    style = POOL_RULES.get(settings.key_style, {})
    return {key.replace("{p}", prefix): rule for key, rule in style.items()} | COUNTS
