"""`--key-style trl`: TRL 1.16's GRPOTrainer loss and logged metrics (docs/key-styles.md).

What: `loss`, `clip_ratio/*`, `entropy`, `kl` from `trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss`,
and `sampling/*`, `frac_reward_zero_std` from `::_generate_and_score_completions`.

Why: TRL takes **one advantage per sample** (pgdiag passes Ā_i), never clamps the ratio, guards
every token mean with max(Σ m, 1), and picks its loss denominator by `loss_type` (grpo, bnpo, dr_grpo,
dapo, luspo). Worked example: `loss` = 0.080553 under `dapo` (the default) and 0.001114 under `grpo`.
When a rollout stream is present the vLLM importance-sampling correction (`sequence_mask`, clip_max 3)
multiplies the policy term per sample, as TRL does before adding β·KL.

How: `--level sequence` is `importance_sampling_level = "sequence"`: the ratio is R_i = exp(Σ_t d / N_i)
for every token of sample i, and the clip metrics average the per-sample indicator over all B rows.
Defaults: β = 0 (`--beta`), max_completion_length = 512 (`--divisor`), IS on (`--no-vllm-is`), and
`use_bias_correction_kl` on (TRL 1.16's default: the per-token KL, in the loss and in `kl`, is multiplied by the
ratio; `--no-kl-bias-correction` turns it off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.styles.common import clip_ratio, div, exp, k3_ref, mean_guard, total, value
from pgdiag.metrics.styles.flags import StyleRules
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput
from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

LOSS_TYPES = {
    "dapo": "dapo",
    "token_mean": "dapo",
    "gspo_token_mean": "dapo",
    "grpo": "grpo",
    "sample_mean": "grpo",
    "gspo_seq_mean": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "constant": "dr_grpo",
    "luspo": "luspo",
    "seq_mean_token_sum": "luspo",
    "gspo_length_prop": "luspo",
}
RULES = StyleRules(
    "trl", frozenset({"divisor", "level", "beta", "vllm_is", "kl_bias_correction"}), LOSS_TYPES, "dapo"
)
DEFAULT_BETA = 0.0
DEFAULT_MAX_COMPLETION_LENGTH = 512
VLLM_IS_CLIP_MAX = 3.0
_REWARD_STD_ATOL = 1e-8  # torch.isclose(std, 0) with its default atol


def check_trl_settings(settings: MetricSettings) -> None:
    """Reject flags TRL has no setting for and loss types it does not have."""
    RULES.check(settings)


def compute_trl(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """TRL's keys for one step (one generation batch = one optimizer step, GA = 1, one process)."""
    loss_type = RULES.mode(settings)
    beta = DEFAULT_BETA if settings.style.beta is None else settings.style.beta
    if beta != 0.0 and inputs.lp_ref is None:
        raise UsageError(
            Code.MISSING_SETTING,
            f"--key-style trl --beta {beta}: the KL term needs a reference stream",
            "pass --ref STREAM, or leave --beta at TRL's default 0",
        )
    use_is = settings.style.vllm_is and inputs.has_pair
    n = inputs.n_tokens
    out = []
    seq_isr = _importance_sampling_ratio(inputs) if use_is else None  # (S,)
    if inputs.has_policy and inputs.adv is not None:
        ratio = _ratio(inputs, settings)  # (M,)
        adv = inputs.per_token(inputs.sample_mean_adv())  # (M,) Ā_i
        token_loss = -np.minimum(
            ratio * adv, clip_ratio(ratio, settings.clip.eps_low, settings.clip.eps_high) * adv
        )
        if seq_isr is not None:
            token_loss = token_loss * inputs.per_token(seq_isr)
        if beta != 0.0:
            token_loss = token_loss + beta * _token_kl(inputs, settings, ratio)
        divisor = settings.divisor if settings.divisor is not None else DEFAULT_MAX_COMPLETION_LENGTH
        out.append(
            value("loss", aggregate_loss_type(inputs, token_loss, loss_type, divisor), "loss", "mode", n)
        )
        out += _clip_metrics(inputs, settings, ratio)
    if inputs.entropy is not None:
        out.append(value("entropy", mean_guard(inputs.entropy), "nats", "token", n))
    if beta != 0.0 and inputs.lp_ref is not None and inputs.lp_new is not None:
        ratio_kl = (
            _ratio(inputs, settings) if settings.style.kl_bias_correction and inputs.has_policy else None
        )
        out.append(value("kl", mean_guard(_token_kl(inputs, settings, ratio_kl)), "nats", "token", n))
    if seq_isr is not None:
        out += _sampling_metrics(inputs, seq_isr)
    if inputs.reward is not None:
        out.append(_frac_reward_zero_std(inputs))
    return StyleOutput(tuple(out))


def aggregate_loss_type(inputs: StyleInputs, token_loss: np.ndarray, loss_type: str, divisor: float) -> float:
    """The TRL/Liger loss-type denominators for one whole step (docs/metrics.md); B counts empty rows."""
    b = inputs.n_samples
    if loss_type == "grpo":
        per_sample = inputs.sample_sum(token_loss) / np.maximum(inputs.n_loss, 1)  # (S,)
        return div(total(per_sample), b)
    if loss_type in ("bnpo", "dapo"):
        return mean_guard(token_loss)
    if loss_type == "dr_grpo":
        return div(total(token_loss), b * divisor)
    if loss_type == "luspo":
        return div(total(token_loss), b)
    raise ValueError(f"unknown loss type {loss_type!r}")


def _token_kl(inputs: StyleInputs, settings: MetricSettings, ratio: np.ndarray | None) -> np.ndarray:
    """(M,) TRL's per-token KL: k3(lp_ref, lp_new), times the ratio under `use_bias_correction_kl` (default)."""
    assert inputs.lp_ref is not None and inputs.lp_new is not None
    kl = k3_ref(inputs.lp_ref, inputs.lp_new)
    if settings.style.kl_bias_correction and ratio is not None:
        kl = kl * ratio
    return kl


def _ratio(inputs: StyleInputs, settings: MetricSettings) -> np.ndarray:
    """(M,) r = exp(d) (token level) or R_i = exp(Σ_t d / max(N_i, 1)) broadcast (sequence level)."""
    assert inputs.lp_new is not None and inputs.lp_old is not None
    if settings.level == "sequence":
        return inputs.per_token(exp(inputs.seq_mean_logratio()))
    return exp(inputs.lp_new - inputs.lp_old)


def _clip_metrics(inputs: StyleInputs, settings: MetricSettings, ratio: np.ndarray) -> list[MetricValue]:
    """clip_ratio/{low_mean, low_min, high_mean, high_max, region_mean} (binding sides, on Ā_i)."""
    seq_adv = inputs.sample_mean_adv()  # (S,)
    if settings.level == "sequence":
        seq_ratio = exp(inputs.seq_mean_logratio())  # (S,) R_i; empty rows have R = 1
        low = (seq_ratio < 1.0 - settings.clip.eps_low) & (seq_adv < 0)  # (S,)
        high = (seq_ratio > 1.0 + settings.clip.eps_high) & (seq_adv > 0)
        b = inputs.n_samples
        low_mean, high_mean, region_mean = (div(float(np.sum(x)), b) for x in (low, high, low | high))
        low_tok, high_tok = inputs.per_token(low), inputs.per_token(high)
        reduction, n = "sample", b
    else:
        adv = inputs.per_token(seq_adv)
        low_tok = (ratio < 1.0 - settings.clip.eps_low) & (adv < 0)  # (M,)
        high_tok = (ratio > 1.0 + settings.clip.eps_high) & (adv > 0)
        low_mean, high_mean, region_mean = (
            mean_guard(x * 1.0) for x in (low_tok, high_tok, low_tok | high_tok)
        )
        reduction, n = "token", inputs.n_tokens
    # per-sample fractions; empty rows are NaN and skipped by nanmin / nanmax
    has_tokens = inputs.n_loss > 0
    low_per_sample = inputs.sample_sum(low_tok * 1.0)[has_tokens] / inputs.n_loss[has_tokens]
    high_per_sample = inputs.sample_sum(high_tok * 1.0)[has_tokens] / inputs.n_loss[has_tokens]
    n_rows = int(np.count_nonzero(has_tokens))
    return [
        value("clip_ratio/low_mean", low_mean, "fraction", reduction, n),
        value(
            "clip_ratio/low_min", float(np.min(low_per_sample)) if n_rows else None, "fraction", "seq", n_rows
        ),
        value("clip_ratio/high_mean", high_mean, "fraction", reduction, n),
        value(
            "clip_ratio/high_max",
            float(np.max(high_per_sample)) if n_rows else None,
            "fraction",
            "seq",
            n_rows,
        ),
        value("clip_ratio/region_mean", region_mean, "fraction", reduction, n),
    ]


def _importance_sampling_ratio(inputs: StyleInputs) -> np.ndarray:
    """(S,) ISR_i = exp(Σ_t Δ′) with Δ′ = Δ, NaN → 0; set to 0 outside [clip_min = None, clip_max = 3]."""
    assert inputs.lp_a is not None and inputs.lp_b is not None
    delta = inputs.lp_b - inputs.lp_a  # (M,)
    delta = np.where(np.isnan(delta), 0.0, delta)
    isr = exp(inputs.sample_sum(delta))  # (S,)
    return np.where(isr > VLLM_IS_CLIP_MAX, 0.0, isr)


def _sampling_metrics(inputs: StyleInputs, seq_isr: np.ndarray) -> list[MetricValue]:
    """sampling/sampling_logp_difference/{mean,max} and sampling/importance_sampling_ratio/{min,mean,max}."""
    assert inputs.lp_a is not None and inputs.lp_b is not None
    abs_diff = np.abs(inputs.lp_b - inputs.lp_a)  # (M,)
    abs_diff = abs_diff[~np.isnan(abs_diff)]
    n_diff, s = abs_diff.shape[0], inputs.n_samples
    diff_mean, diff_max = (float(np.mean(abs_diff)), float(np.max(abs_diff))) if n_diff else (0.0, 0.0)
    out = [
        value("sampling/sampling_logp_difference/mean", diff_mean, "nats", "tok", n_diff),
        value("sampling/sampling_logp_difference/max", diff_max, "nats", "tok", n_diff),
    ]
    for stat, reduce in (("min", np.min), ("mean", np.mean), ("max", np.max)):
        isr = float(reduce(seq_isr)) if s else None
        out.append(value(f"sampling/importance_sampling_ratio/{stat}", isr, "ratio", "rows", s))
    return out


def _frac_reward_zero_std(inputs: StyleInputs) -> MetricValue:
    """Fraction of samples whose group's reward std (unbiased) is 0 within torch.isclose's atol 1e-8."""
    assert inputs.reward is not None
    s = inputs.n_samples
    n_groups = int(inputs.group.max()) + 1 if s else 0
    count = np.bincount(inputs.group, minlength=n_groups).astype(np.float64)  # (G,)
    mean = np.bincount(inputs.group, weights=inputs.reward, minlength=n_groups) / np.maximum(count, 1)
    sq_dev = np.bincount(inputs.group, weights=(inputs.reward - mean[inputs.group]) ** 2, minlength=n_groups)
    with np.errstate(divide="ignore", invalid="ignore"):
        std = np.sqrt(sq_dev / (count - 1.0))  # (G,) NaN for singletons and NaN rewards
    zero = np.abs(std[inputs.group]) <= _REWARD_STD_ATOL  # (S,)
    return value("frac_reward_zero_std", div(float(np.sum(zero)), s), "fraction", "sample", s)
