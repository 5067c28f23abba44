"""`--key-style miles`: miles' `train/*` loss and metrics (docs/key-styles.md).

What: the keys of miles `31f1ca96` + PR #1498 (`--loss-aggregation`): `loss_hub/losses.py::policy_loss_function`
and `get_pg_loss_reducer`, `loss_hub/math_utils.py::compute_policy_loss`, `compute_approx_kl`,
`compute_ess_ratio_contribution`, `_safe_clamp_log_ratio`, reduced by `cp_utils.py::get_sum_of_sample_mean`.

Why: miles reports every metric as a **sample mean** `SM(x) = (1/S) Σ_i Σ_t m x / max(N_i, 1)` (empty samples
add 0 and count in S), stores `ppo_kl = lp_old − lp_new` (sign opposite to verl's naming) and
zeroes every non-finite log-ratio before the loss, which then clamps it to ±20; `train/ois` = SM(exp(−ppo_kl)) is not
clamped and exists only under TIS. Worked example: `train/ppo_kl` =
(0 + 0 − 0.25/3 + 0.1/3)/4 = −0.0125, against verl's token mean −0.011538.

How: `--aggregation` picks `--loss-aggregation` (sample_mean default, prompt_mean, token_mean, constant with
`--divisor`); under token_mean only `loss`, `pg_loss` and `ess_ratio` become token-normalised. The bare
native default ``token_mean`` cannot be told apart from "not given", so it means miles' default
sample_mean (with a notice); ask for miles' token mean with ``miles:token_mean``. `--tis` turns on
truncated importance sampling: the weight clamp(e^Δ, 0, 2) multiplies the per-token loss and `train/tis*`
are logged; `--mismatch-metrics` (miles `--get-mismatch-metrics`) enters the same branch of miles'
`policy_loss_function`, so it TIS-weights `pg_loss` too (with miles' built-in TIS function). One row per
rollout is assumed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.styles.common import clip_ratio, div, exp, sample_mean_guard, total, value
from pgdiag.metrics.styles.flags import StyleRules
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput
from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

RULES = StyleRules(
    "miles",
    frozenset({"dual_clip", "divisor", "tis", "mismatch_metrics"}),
    {
        "sample_mean": "sample_mean",
        "prompt_mean": "prompt_mean",
        "token_mean": "token_mean",
        "constant": "constant",
    },
    "sample_mean",  # no --aggregation: miles' default
    divisor_needed={
        "constant": ("miles --loss-aggregation constant needs --divisor (loss-aggregation-divisor)", None)
    },
)
_LOG_RATIO_CLAMP = 20.0
TIS_CLIP_LOW, TIS_CLIP_HIGH = 0.0, 2.0


def tis_branch(settings: MetricSettings) -> bool:
    """miles' `if args.get_mismatch_metrics or args.use_tis` branch: TIS-weighted pg_loss, ois and tis keys."""
    return settings.style.tis or settings.style.mismatch_metrics


def check_miles_settings(settings: MetricSettings) -> None:
    """Reject flags miles has no setting for; `constant` needs `--divisor`."""
    RULES.check(settings)


def safe_log_ratio(x: np.ndarray) -> np.ndarray:
    """miles `_safe_clamp_log_ratio`: NaN → 0, ±inf → ±20, then clamp to [−20, 20]."""
    x = np.nan_to_num(x, nan=0.0, posinf=_LOG_RATIO_CLAMP, neginf=-_LOG_RATIO_CLAMP)
    return np.clip(x, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def compute_miles(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """miles' `train/*` keys for one step (one row per rollout, kl/entropy coefficients 0)."""
    agg = RULES.mode(settings)  # miles' --loss-aggregation
    s = inputs.n_samples
    notices = []
    if s and int(np.max(np.bincount(inputs.document))) > 1:
        notices.append("miles: documents with several rows (multi-sample rollouts) are not reproduced in v1")
    if tis_branch(settings) and not inputs.has_pair:
        flag = "--tis" if settings.style.tis else "--mismatch-metrics"
        raise UsageError(
            Code.MISSING_SETTING, f"miles {flag} needs a rollout stream (--stream-a) for the TIS weights"
        )

    def sm(x: np.ndarray) -> float:
        return sample_mean_guard(inputs, x)

    out: list[MetricValue] = []
    if inputs.has_policy:
        assert inputs.lp_new is not None and inputs.lp_old is not None
        ppo_kl = inputs.lp_old - inputs.lp_new  # (M,)
        ppo_kl[~np.isfinite(ppo_kl)] = 0.0  # nan_to_num(ppo_kl, nan=0, posinf=0, neginf=0) on loss tokens
        ratio = exp(safe_log_ratio(-ppo_kl))  # (M,) r̂: the ±20 clamp only ever meets finite values
        if inputs.adv is not None:
            out += _policy_loss(inputs, settings, agg, ratio)
        out.append(value("train/ppo_kl", sm(ppo_kl), "nats", "sample", s))
        out.append(_ess_ratio(inputs, ratio, agg))
        if tis_branch(settings):
            # ois = (−ppo_kl).exp() with no ±20 clamp, only in miles' TIS / mismatch-metrics branch
            out.append(value("train/ois", sm(exp(-ppo_kl)), "ratio", "sample", s))
    if inputs.entropy is not None:
        out.append(value("train/entropy_loss", sm(inputs.entropy), "nats", "sample", s))
    if inputs.has_pair:
        assert inputs.lp_a is not None and inputs.lp_b is not None
        delta = inputs.lp_b - inputs.lp_a  # (M,) Δ = lp_train − lp_rollout
        y = safe_log_ratio(delta)
        train_rollout_kl = np.clip(exp(y) - 1.0 - y, -10.0, 10.0)
        out += [
            value("train/train_rollout_logprob_abs_diff", sm(np.abs(delta)), "nats", "sample", s),
            value("train/train_rollout_kl", sm(train_rollout_kl), "nats", "sample", s),
        ]
    if inputs.lp_new is not None and inputs.lp_ref is not None:
        out.append(value("train/kl_loss", sm(inputs.lp_new - inputs.lp_ref), "nats", "sample", s))
    if tis_branch(settings):
        tis = _tis_weight_raw(inputs)  # (M,)
        clipped = np.clip(tis, TIS_CLIP_LOW, TIS_CLIP_HIGH)
        out += [
            value("train/tis", sm(tis), "ratio", "sample", s),
            value("train/tis_clipfrac", sm((clipped != tis) * 1.0), "fraction", "sample", s),
            value("train/tis_abs", sm(np.abs(tis - 1.0)), "ratio", "sample", s),
        ]
    return StyleOutput(tuple(out), tuple(notices))


def _tis_weight_raw(inputs: StyleInputs) -> np.ndarray:
    """(M,) e^Δ = π_train / π_rollout, unclamped (miles `compute_tis_weights`)."""
    assert inputs.lp_a is not None and inputs.lp_b is not None
    return exp(inputs.lp_b - inputs.lp_a)


def _policy_loss(
    inputs: StyleInputs, settings: MetricSettings, agg: str, ratio: np.ndarray
) -> list[MetricValue]:
    """train/pg_loss, train/loss (= pg_loss at zero kl/entropy coefficients) and train/pg_clipfrac."""
    assert inputs.adv is not None
    adv = inputs.adv
    loss_unclipped = -ratio * adv
    loss_clipped = -clip_ratio(ratio, settings.clip.eps_low, settings.clip.eps_high) * adv
    token_loss = np.maximum(loss_unclipped, loss_clipped)  # (M,) ℓ̂
    if settings.clip.dual_clip is not None:
        token_loss = np.where(adv < 0, np.minimum(-settings.clip.dual_clip * adv, token_loss), token_loss)
    if tis_branch(settings):
        token_loss = token_loss * np.clip(_tis_weight_raw(inputs), TIS_CLIP_LOW, TIS_CLIP_HIGH)
    pg_loss = _reduce_loss(inputs, token_loss, agg, settings.divisor)
    clipfrac = sample_mean_guard(inputs, (loss_clipped > loss_unclipped) * 1.0)
    n = inputs.n_tokens
    return [
        value("train/loss", pg_loss, "loss", "mode", n),
        value("train/pg_loss", pg_loss, "loss", "mode", n),
        value("train/pg_clipfrac", clipfrac, "fraction", "sample", inputs.n_samples),
    ]


def _reduce_loss(inputs: StyleInputs, token_loss: np.ndarray, agg: str, divisor: float | None) -> float:
    """PR #1498 `get_pg_loss_reducer` for one step: sample_mean, token_mean, prompt_mean, constant."""
    if agg == "sample_mean":
        return sample_mean_guard(inputs, token_loss)
    if agg == "token_mean":
        return div(total(token_loss), max(inputs.n_tokens, 1))
    if agg == "constant":
        assert divisor is not None
        return div(total(token_loss), divisor * inputs.n_samples)
    groups, group_of_sample = np.unique(inputs.group, return_inverse=True)  # prompt_mean
    group_sum = np.bincount(group_of_sample, weights=inputs.sample_sum(token_loss), minlength=groups.shape[0])
    group_tokens = np.bincount(group_of_sample, weights=inputs.n_loss, minlength=groups.shape[0])
    return div(total(group_sum / np.maximum(group_tokens, 1)), groups.shape[0])


def _ess_ratio(inputs: StyleInputs, ratio: np.ndarray, agg: str) -> MetricValue:
    """e_i = (Σ_t r̂)² / (max(N_i, 1) · max(Σ_t r̂², 1e-8)); (1/S) Σ e_i, or Σ N_i e_i / N under token_mean."""
    first = inputs.sample_sum(ratio)  # (S,)
    second = inputs.sample_sum(ratio * ratio)  # (S,)
    ess = first**2 / (np.maximum(inputs.n_loss, 1) * np.maximum(second, 1e-8))  # (S,)
    if agg == "token_mean":
        return value(
            "train/ess_ratio",
            div(total(inputs.n_loss * ess), max(inputs.n_tokens, 1)),
            "1",
            "token",
            inputs.n_tokens,
        )
    return value("train/ess_ratio", div(total(ess), inputs.n_samples), "1", "sample", inputs.n_samples)
