"""`--key-style fast-llm`: Fast-LLM's policy-gradient loss and metrics (docs/key-styles.md).

What: the keys Fast-LLM `7d61a1ba` logs from `fast_llm/layers/language_model/loss/policy_gradient.py`
(`LanguageModelGRPOLoss.fused_core`, `grpo_metrics_core`, `_policy_metrics_reduce`, `LanguageModelGSPOLoss`),
prefixed by the loss name (``grpo`` by default, `--loss-name`).

Why: Fast-LLM reduces its metrics per **document** (`doc(x) = (1/D) Σ_t m x / max(N_d, 1)`, D counting fully
masked documents), never clamps the ratio, and its `clipped_ratio_fraction` is the **band** fraction (ratio
outside [1 − ε_l, 1 + ε_h] whatever the advantage), so its numbers differ from verl/TRL on the
same batch. Worked example: `grpo_clipped_ratio_fraction` = (2/3 + 2/4 + 1/3 + 1/3)/4 = 0.458333,
`grpo` = 1.047195/13 = 0.080553.

How: `--level sequence` is the `gspo` loss: the ratio fields use the segment (row) ratio
R_s = exp(Σ_t d / N_s) broadcast to its tokens, and the loss is (1/D) Σ_s N_s l_s with
l_s = −min(R_s Ā_s, clip(R_s) Ā_s) (length-proportional since Fast-LLM PR #544).
"""

from __future__ import annotations

import numpy as np

from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles.common import (
    StyleInputs,
    StyleOutput,
    check_flags,
    clip_ratio,
    div,
    exp,
    ppo_token_loss,
    resolve_alias,
    total,
    value,
)

ALLOWED_FLAGS = frozenset({"level", "loss_name"})
_TOKEN_LOSSES = {"token_mean": "grpo", "grpo": "grpo"}
_SEQUENCE_LOSSES = {"token_mean": "gspo", "gspo": "gspo", "gspo_length_prop": "gspo"}


def check_fast_llm_settings(settings: MetricSettings) -> None:
    """Reject flags Fast-LLM has no setting for, and an aggregation that is not its loss at this level."""
    check_flags("fast-llm", settings, ALLOWED_FLAGS)
    table = _SEQUENCE_LOSSES if settings.level == "sequence" else _TOKEN_LOSSES
    resolve_alias("fast-llm", settings.aggregation, table, "grpo")


def compute_fast_llm(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """Fast-LLM's keys for one step (one micro-batch, one process)."""
    prefix = settings.style.loss_name or "grpo"
    sequence = settings.level == "sequence"
    n_docs = int(inputs.document.max()) + 1 if inputs.n_samples else 0
    doc_tokens = np.bincount(inputs.document, weights=inputs.n_loss, minlength=n_docs)  # (D,) N_d
    token_weight = 1.0 / np.maximum(doc_tokens[inputs.document[inputs.token_sample]], 1.0)  # (M,)

    def doc(x: np.ndarray) -> float:
        return div(total(x * token_weight), n_docs)

    n = inputs.n_tokens
    out = []
    if inputs.has_policy and inputs.adv is not None:
        out.append(value(prefix, _loss(inputs, settings, n_docs), "loss", "mode", n))
    if inputs.lp_new is not None:
        out.append(value(f"{prefix}_new_logprobs", doc(inputs.lp_new), "nats", "document", n))
    if inputs.lp_old is not None:
        out.append(value(f"{prefix}_old_logprobs", doc(inputs.lp_old), "nats", "document", n))
    if inputs.has_policy:
        ratio, kl, band, ratio_sum, ratio_sq_sum = _ratio_fields(inputs, settings)
        out += [
            value(f"{prefix}_ratio_new_old", doc(ratio), "ratio", "document", n),
            value(f"{prefix}_ratio_new_old_sum", ratio_sum, "ratio", "sum", n),
            value(f"{prefix}_ratio_new_old_squared_sum", ratio_sq_sum, "ratio", "sum", n),
            value(f"{prefix}_kl_new_old", doc(kl), "nats", "document", n),
            value(f"{prefix}_clipped_ratio_fraction", doc(band), "fraction", "document", n),
        ]
    if inputs.adv is not None:
        adv = inputs.adv
        out += [
            value(f"{prefix}_advantage", doc(adv), "1", "document", n),
            # torch.where(mask, A, -inf).max(): -inf / +inf on a step without tokens
            value(f"{prefix}_max_advantage", float(np.max(adv)) if n else -np.inf, "1", "extremum", n),
            value(f"{prefix}_min_advantage", float(np.min(adv)) if n else np.inf, "1", "extremum", n),
        ]
    out.append(value(f"{prefix}_num_tokens", n, "count", "cnt", n))
    if sequence:
        segments = int(np.count_nonzero(inputs.n_loss))
        out.append(value(f"{prefix}_num_segments", segments, "count", "cnt", segments))
    if inputs.entropy is not None:
        out.append(value(f"{prefix}_entropy", doc(inputs.entropy), "nats", "document", n))
    if inputs.reward is not None:
        reward = inputs.per_token(inputs.reward)
        out.append(value(f"{prefix}_train_samples_reward", doc(reward), "1", "document", n))
    return StyleOutput(tuple(out))


def _ratio_fields(
    inputs: StyleInputs, settings: MetricSettings
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Per-token ratio, kl_new_old and band indicator (sequence level: the segment's values broadcast),
    plus the raw ratio sums."""
    assert inputs.lp_new is not None and inputs.lp_old is not None
    if settings.level == "sequence":
        mean_d = inputs.seq_mean_logratio()  # (S,)
        seq_ratio = exp(mean_d)  # (S,) R_s
        band = _band(seq_ratio, settings)
        kl = seq_ratio - 1.0 - mean_d
        has_tokens = inputs.n_loss > 0
        ratio_sum = total(seq_ratio[has_tokens])
        ratio_sq_sum = total(seq_ratio[has_tokens] ** 2)
        return (
            inputs.per_token(seq_ratio),
            inputs.per_token(kl),
            inputs.per_token(band),
            ratio_sum,
            ratio_sq_sum,
        )
    d = inputs.lp_new - inputs.lp_old  # (M,)
    ratio = exp(d)
    return ratio, ratio - 1.0 - d, _band(ratio, settings), total(ratio), total(ratio * ratio)


def _band(ratio: np.ndarray, settings: MetricSettings) -> np.ndarray:
    """1[r < 1 − ε_l ∨ r > 1 + ε_h] as float (Fast-LLM's `clipped`, any advantage)."""
    return ((ratio < 1.0 - settings.clip.eps_low) | (ratio > 1.0 + settings.clip.eps_high)).astype(np.float64)


def _loss(inputs: StyleInputs, settings: MetricSettings, n_docs: int) -> float:
    """`grpo`: Σ m ℓ / max(N, 1); `gspo`: (1/D) Σ_s N_s l_s (length-proportional GSPO)."""
    assert inputs.lp_new is not None and inputs.lp_old is not None and inputs.adv is not None
    if settings.level == "sequence":
        seq_ratio = exp(inputs.seq_mean_logratio())  # (S,) R_s
        seq_adv = inputs.sample_mean_adv()  # (S,) Ā_s
        clipped = clip_ratio(seq_ratio, settings.clip.eps_low, settings.clip.eps_high)
        seq_loss = -np.minimum(seq_ratio * seq_adv, clipped * seq_adv)  # (S,) l_s
        return div(total(inputs.n_loss * seq_loss), n_docs)
    ratio = exp(inputs.lp_new - inputs.lp_old)
    token_loss = ppo_token_loss(ratio, inputs.adv, settings.clip.eps_low, settings.clip.eps_high)
    return div(total(token_loss), max(inputs.n_tokens, 1))
