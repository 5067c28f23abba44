"""`--key-style verl`: verl 0.9.1's actor, advantage and rollout-correction keys (docs/key-styles.md).

What: `actor/*` from `core_algos.py::compute_policy_loss_vanilla` / `compute_policy_loss_gspo` / `agg_loss` /
`kl_penalty` (low_var_kl), `critic/advantages/*` from `metric_utils.py::compute_data_metrics`,
`rollout_corr/*` from `rollout_corr_helper.py::compute_offpolicy_metrics` and `compute_is_metrics`, and
`training/rollout_*` from `utils/debug/metrics.py::calculate_debug_metrics`.

Why: verl clamps the log-ratio to ±20 before exp, always applies dual clip (c = 3), averages with
`masked_mean` = Σ m x / (Σ m + 1e-8), and its `pg_clipfrac_lower` is the **dual-clip activation rate**
(A < 0 and r > c), not a low-side clip fraction (docs/key-styles.md). Worked example: `actor/pg_clipfrac` =
4 / (13 + 1e-8) = 0.307692, `actor/ppo_kl` = −0.15/13 = −0.011538, `actor/pg_loss` = 0.080553.

How: `AGG` is `agg_loss` with global batch info (batch_num_tokens = N, global_batch_size = S, or S+ under
`--empty-seqs skip`); `actor/entropy` uses `agg_loss` without global info (GB = S+). `--level sequence`
selects `loss_mode = gspo` (s_i = exp(min(δ̄_i, 10)) broadcast, per-token A, no dual clip).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.styles.common import clip_ratio, div, exp, extremum, mean_eps, total, value
from pgdiag.metrics.styles.flags import StyleRules
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput
from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

_LOSS_AGG_MODES = {
    "token-mean": "token-mean",
    "token_mean": "token-mean",
    "gspo_token_mean": "token-mean",
    "token-sum": "token-sum",
    "token_sum": "token-sum",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "sample_mean": "seq-mean-token-mean",
    "gspo_seq_mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "gspo_length_prop": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
    "constant": "seq-mean-token-sum-norm",
}
RULES = StyleRules(
    "verl",
    frozenset({"dual_clip", "divisor", "empty_seqs", "level", "rollout_is", "rollout_is_threshold"}),
    _LOSS_AGG_MODES,
    "token-mean",
    divisor_needed={
        "seq-mean-token-sum-norm": (
            "verl seq-mean-token-sum-norm needs --divisor (loss_scale_factor)",
            "verl's own default is the padded response width of the micro-batch, which the run does not record",
        )
    },
)
DEFAULT_CLIP_RATIO_C = 3.0
DEFAULT_ROLLOUT_IS_THRESHOLD = 2.0
_LOG_RATIO_CLAMP = 20.0
_GSPO_LOG_RATIO_MAX = 10.0


def check_verl_settings(settings: MetricSettings) -> None:
    """Reject flags verl has no setting for; the loss_agg_mode must exist and have what it needs."""
    RULES.check(settings)
    if settings.style.rollout_is is not None and settings.style.rollout_is != "token":
        raise UsageError(
            Code.NOT_IN_KEY_STYLE,
            f"--rollout-is {settings.style.rollout_is!r}: only token-level rollout IS metrics are reproduced",
            "sequence-level rollout IS and rejection sampling are out of scope for v1",
        )
    if settings.style.rollout_is_threshold is not None and not settings.style.rollout_is_threshold > 0:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"--rollout-is-threshold must be > 0 (got {settings.style.rollout_is_threshold})",
        )


def compute_verl(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """verl's keys for one step (one micro-batch, DP = 1)."""
    mode = RULES.mode(settings)
    n = inputs.n_tokens
    notices = []
    if settings.divisor is not None and mode != "seq-mean-token-sum-norm":
        notices.append(f"verl: --divisor (loss_scale_factor) is unused by loss_agg_mode {mode}")
    if settings.level == "sequence" and settings.clip.dual_clip is not None:
        notices.append("verl: loss_mode gspo has no dual clip; --dual-clip is unused")
    out = []
    if inputs.has_policy and inputs.adv is not None:
        out += _actor_policy(inputs, settings, mode)
    elif inputs.has_policy:
        ppo_kl = _ppo_kl(inputs, settings)
        out.append(value("actor/ppo_kl", ppo_kl, "nats", "token", n))
    if inputs.entropy is not None:
        entropy = _agg_loss(inputs, inputs.entropy, mode, settings, global_info=False)
        out.append(value("actor/entropy", entropy, "nats", "mode", n))
    if inputs.lp_new is not None and inputs.lp_ref is not None:
        y = np.clip(inputs.lp_ref - inputs.lp_new, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kld = np.clip(exp(y) - y - 1.0, -10.0, 10.0)  # low_var_kl
        out.append(value("actor/kl_loss", _agg_loss(inputs, kld, mode, settings), "nats", "mode", n))
    if inputs.adv is not None:
        adv_mean = float(np.mean(inputs.adv)) if n else None
        out += [
            value("critic/advantages/mean", adv_mean, "1", "tok", n),
            value("critic/advantages/max", extremum(inputs.adv, "max"), "1", "tok", n),
            value("critic/advantages/min", extremum(inputs.adv, "min"), "1", "tok", n),
        ]
    if inputs.has_pair:
        out += _rollout_corr(inputs, settings)
        out += _debug_probs(inputs)
    return StyleOutput(tuple(out), tuple(notices))


def _policy_ratio(inputs: StyleInputs, settings: MetricSettings) -> np.ndarray:
    """(M,) r̃ = exp(clamp(d, ±20)) (vanilla) or s_i = exp(min(δ̄_i, 10)) broadcast (gspo)."""
    assert inputs.lp_new is not None and inputs.lp_old is not None
    if settings.level == "sequence":
        return inputs.per_token(exp(np.minimum(inputs.seq_mean_logratio(), _GSPO_LOG_RATIO_MAX)))
    d = inputs.lp_new - inputs.lp_old
    return exp(np.clip(d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _ppo_kl(inputs: StyleInputs, settings: MetricSettings) -> float:
    """mm(−d̃) (vanilla, clamped ±20) or mm(−d) (gspo, unclamped)."""
    assert inputs.lp_new is not None and inputs.lp_old is not None
    d = inputs.lp_new - inputs.lp_old
    if settings.level != "sequence":
        d = np.clip(d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return mean_eps(-d)


def _actor_policy(inputs: StyleInputs, settings: MetricSettings, mode: str) -> list[MetricValue]:
    """actor/pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower."""
    assert inputs.adv is not None
    adv = inputs.adv
    ratio = _policy_ratio(inputs, settings)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * clip_ratio(ratio, settings.clip.eps_low, settings.clip.eps_high)
    clip1 = np.maximum(loss_unclipped, loss_clipped)
    clipfrac = mean_eps((loss_clipped > loss_unclipped).astype(np.float64))
    if settings.level == "sequence":
        token_loss = clip1
        clipfrac_lower = 0.0
    else:
        c = settings.clip.dual_clip if settings.clip.dual_clip is not None else DEFAULT_CLIP_RATIO_C
        loss_dual = -adv * c
        token_loss = np.where(adv < 0, np.minimum(loss_dual, clip1), clip1)
        clipfrac_lower = mean_eps(((clip1 > loss_dual) & (adv < 0)).astype(np.float64))
    n = inputs.n_tokens
    return [
        value("actor/pg_loss", _agg_loss(inputs, token_loss, mode, settings), "loss", "mode", n),
        value("actor/pg_clipfrac", clipfrac, "fraction", "token", n),
        value("actor/ppo_kl", _ppo_kl(inputs, settings), "nats", "token", n),
        value("actor/pg_clipfrac_lower", clipfrac_lower, "fraction", "token", n),
    ]


def _agg_loss(
    inputs: StyleInputs, x: np.ndarray, mode: str, settings: MetricSettings, *, global_info: bool = True
) -> float:
    """verl `agg_loss` for one process: global info gives batch_num_tokens = N and global_batch_size = S
    (S+ under --empty-seqs skip); without it GB = S+ (samples with at least one token)."""
    n_nonempty = int(np.count_nonzero(inputs.n_loss))
    use_all_rows = global_info and settings.empty_seqs == "count"
    global_batch = inputs.n_samples if use_all_rows else n_nonempty
    if mode == "token-mean":
        return div(total(x), inputs.n_tokens)
    if mode == "token-sum":
        return total(x)
    if mode == "seq-mean-token-mean":
        seq_losses = inputs.sample_sum(x) / (inputs.n_loss + 1e-8)  # (S,)
        return div(total(seq_losses[inputs.n_loss > 0]), global_batch)
    seq_sums = inputs.sample_sum(x)[inputs.n_loss > 0]  # seq-mean-token-sum(-norm)
    loss = div(total(seq_sums), global_batch)
    if mode == "seq-mean-token-sum-norm":
        assert settings.divisor is not None
        loss = div(loss, settings.divisor)
    return loss


def _rollout_corr(inputs: StyleInputs, settings: MetricSettings) -> list[MetricValue]:
    """rollout_corr/* off-policy metrics (and token-level IS metrics with --rollout-is token)."""
    assert inputs.lp_a is not None and inputs.lp_b is not None
    n, s = inputs.n_tokens, inputs.n_samples
    keys = [
        ("rollout_corr/kl", "nats", "token"),
        ("rollout_corr/k3_kl", "nats", "token"),
        ("rollout_corr/training_ppl", "1", "rows"),
        ("rollout_corr/training_log_ppl", "nats", "rows"),
        ("rollout_corr/rollout_ppl", "1", "rows"),
        ("rollout_corr/rollout_log_ppl", "nats", "rows"),
        ("rollout_corr/log_ppl_diff", "nats", "rows"),
        ("rollout_corr/log_ppl_abs_diff", "nats", "rows"),
        ("rollout_corr/log_ppl_diff_max", "nats", "rows"),
        ("rollout_corr/log_ppl_diff_min", "nats", "rows"),
        ("rollout_corr/ppl_ratio", "1", "rows"),
        ("rollout_corr/chi2_token", "1", "token"),
        ("rollout_corr/chi2_seq", "1", "rows"),
    ]
    if n == 0:  # compute_offpolicy_metrics asserts at least one valid token
        return [value(k, None, u, r, 0) for k, u, r in keys]
    delta = inputs.lp_b - inputs.lp_a  # (M,) Δ = log π_train − log π_rollout
    mu_b = inputs.sample_sum(inputs.lp_b) / (inputs.n_loss + 1e-8)  # (S,)
    mu_a = inputs.sample_sum(inputs.lp_a) / (inputs.n_loss + 1e-8)  # (S,)
    log_ppl_diff = mu_a - mu_b  # (S,)
    delta_safe = np.clip(delta, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    seq_delta_safe = np.clip(inputs.sample_sum(delta), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (S,)
    vals = [
        mean_eps(-delta),
        mean_eps(exp(delta) - delta - 1.0),
        float(np.mean(exp(-mu_b))),
        float(np.mean(-mu_b)),
        float(np.mean(exp(-mu_a))),
        float(np.mean(-mu_a)),
        float(np.mean(log_ppl_diff)),
        float(np.mean(np.abs(log_ppl_diff))),
        float(np.max(log_ppl_diff)),
        float(np.min(log_ppl_diff)),
        float(np.mean(exp(log_ppl_diff))),
        mean_eps(exp(2.0 * delta_safe)) - 1.0,
        float(np.mean(exp(2.0 * seq_delta_safe))) - 1.0,
    ]
    out = [value(k, v, u, r, n if r == "token" else s) for (k, u, r), v in zip(keys, vals, strict=True)]
    if settings.style.rollout_is == "token":
        out += _rollout_is(delta_safe, settings)
    return out


def _rollout_is(delta_safe: np.ndarray, settings: MetricSettings) -> list[MetricValue]:
    """Token-level truncated IS weights w = min(exp(clamp(Δ, ±20)), thr) and their statistics."""
    threshold = settings.style.rollout_is_threshold or DEFAULT_ROLLOUT_IS_THRESHOLD
    raw = exp(delta_safe)  # (M,)
    w = np.minimum(raw, threshold)  # (M,)
    n = w.shape[0]
    w_mean = mean_eps(w)
    std = math.sqrt(max(mean_eps(w * w) - w_mean**2, 0.0)) if n > 1 else 0.0
    ess = div(1.0, mean_eps((w / (w_mean + 1e-8)) ** 2))
    return [
        value("rollout_corr/rollout_is_mean", w_mean, "ratio", "token", n),
        value("rollout_corr/rollout_is_max", extremum(w, "max"), "ratio", "tok", n),
        value("rollout_corr/rollout_is_min", extremum(w, "min"), "ratio", "tok", n),
        value(
            "rollout_corr/rollout_is_ratio_fraction_high",
            mean_eps((raw > threshold) * 1.0),
            "fraction",
            "token",
            n,
        ),
        value(
            "rollout_corr/rollout_is_ratio_fraction_low",
            mean_eps((raw < 1.0 / threshold) * 1.0),
            "fraction",
            "token",
            n,
        ),
        value("rollout_corr/rollout_is_std", std, "ratio", "token", n),
        value("rollout_corr/rollout_is_eff_sample_size", ess, "1", "token", n),
    ]


def _debug_probs(inputs: StyleInputs) -> list[MetricValue]:
    """training/rollout_probs_diff_{mean,max,std} and the probability Pearson correlation (over m = 1)."""
    assert inputs.lp_a is not None and inputs.lp_b is not None
    n = inputs.n_tokens
    p_b, p_a = exp(inputs.lp_b), exp(inputs.lp_a)  # (M,)
    diff = np.abs(p_b - p_a)
    std = float(np.std(diff, ddof=1)) if n > 1 else None
    pearson = None
    if n > 1:
        cb, ca = p_b - p_b.mean(), p_a - p_a.mean()
        pearson = div(total(cb * ca), math.sqrt(total(cb * cb) * total(ca * ca)))
    return [
        value("training/rollout_probs_diff_mean", float(np.mean(diff)) if n else None, "prob", "tok", n),
        value("training/rollout_probs_diff_max", extremum(diff, "max"), "prob", "tok", n),
        value("training/rollout_probs_diff_std", std, "prob", "tok", n),
        value("training/rollout_actor_probs_pearson_corr", pearson, "1", "tok", n),
    ]
