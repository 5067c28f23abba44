"""`--key-style fast-llm`: Fast-LLM's policy-gradient loss and metrics (docs/key-styles.md).

What: the keys Fast-LLM `7d61a1ba` logs from `fast_llm/layers/language_model/loss/policy_gradient.py`
(`LanguageModelGRPOLoss.fused_core`, `grpo_metrics_core`, `_policy_metrics_reduce`, `LanguageModelGSPOLoss`),
prefixed by the loss name (``grpo`` by default, `--loss-name`), and ``lm_head_loss``: when the policy-gradient loss
is the head's only loss of weight 1, `LanguageModelHead` logs its value under that name instead (same value).

Why: Fast-LLM reduces its metrics per **document** (`doc(x) = (1/D) Σ_t m x / max(N_d, 1)`, D counting fully
masked documents), never clamps the ratio, and its `clipped_ratio_fraction` is the **band** fraction (ratio
outside [1 − ε_l, 1 + ε_h] whatever the advantage), so its numbers differ from verl/TRL on the
same batch. Worked example: `grpo_clipped_ratio_fraction` = (2/3 + 2/4 + 1/3 + 1/3)/4 = 0.458333,
`grpo` = 1.047195/13 = 0.080553.

How: `--level sequence` is the `gspo` loss: the segment is the **document** (every row of one `sample_id`,
as Fast-LLM sums the weighted log-ratio per document index), the ratio fields use the document ratio
R_d = exp(Σ_t d / N_d) broadcast to its tokens, the loss is (1/D) Σ_d N_d l_d with
l_d = −min(R_d Ā_d, clip(R_d) Ā_d) (length-proportional since Fast-LLM PR #544), and `num_segments` counts
documents with a loss token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pgdiag.metrics.styles.common import clip_ratio, div, exp, ppo_token_loss, total, value
from pgdiag.metrics.styles.flags import StyleRules
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

_FLAGS = frozenset({"level", "loss_name"})
LM_HEAD_LOSS = "lm_head_loss"  # Fast-LLM LM_HEAD_LOSS_NAME: the head's total loss
_TOKEN_LOSSES = {"token_mean": "grpo", "grpo": "grpo"}
_SEQUENCE_LOSSES = {"token_mean": "gspo", "gspo": "gspo", "gspo_length_prop": "gspo"}
TOKEN_RULES = StyleRules("fast-llm", _FLAGS, _TOKEN_LOSSES, "grpo")  # the loss at --level token
SEQUENCE_RULES = StyleRules("fast-llm", _FLAGS, _SEQUENCE_LOSSES, "grpo")


def check_fast_llm_settings(settings: MetricSettings) -> None:
    """Reject flags Fast-LLM has no setting for, and an aggregation that is not its loss at this level."""
    (SEQUENCE_RULES if settings.level == "sequence" else TOKEN_RULES).check(settings)


def compute_fast_llm(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """Fast-LLM's keys for one step (one micro-batch, one process)."""
    prefix = settings.style.loss_name or "grpo"
    sequence = settings.level == "sequence"
    docs = _Documents.of(inputs)
    n_docs = docs.count
    token_weight = 1.0 / np.maximum(docs.tokens[docs.of_token], 1.0)  # (M,)

    def doc(x: np.ndarray) -> float:
        return div(total(x * token_weight), n_docs)

    n = inputs.n_tokens
    out = []
    if inputs.has_policy and inputs.adv is not None:
        loss = _loss(inputs, settings, docs)
        # the head logs a lone weight-1 loss under `lm_head_loss` instead of its own name: print both
        out.append(value(prefix, loss, "loss", "mode", n))
        out.append(value(LM_HEAD_LOSS, loss, "loss", "mode", n))
    if inputs.lp_new is not None:
        out.append(value(f"{prefix}_new_logprobs", doc(inputs.lp_new), "nats", "document", n))
    if inputs.lp_old is not None:
        out.append(value(f"{prefix}_old_logprobs", doc(inputs.lp_old), "nats", "document", n))
    if inputs.has_policy:
        ratio, kl, band, ratio_sum, ratio_sq_sum = _ratio_fields(inputs, settings, docs)
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
        segments = int(np.count_nonzero(docs.tokens))  # documents with a loss token, not rows
        out.append(value(f"{prefix}_num_segments", segments, "count", "cnt", segments))
    if inputs.entropy is not None:
        out.append(value(f"{prefix}_entropy", doc(inputs.entropy), "nats", "document", n))
    if inputs.reward is not None:
        reward = inputs.per_token(inputs.reward)  # (M,) the sample's reward on each loss token
        out += [
            value(f"{prefix}_train_samples_reward", doc(reward), "1", "document", n),
            # torch.where(mask, reward, ∓inf).max()/.min(): −inf / +inf on a step without tokens
            value(
                f"{prefix}_max_train_samples_reward",
                float(np.max(reward)) if n else -np.inf,
                "1",
                "extremum",
                n,
            ),
            value(
                f"{prefix}_min_train_samples_reward",
                float(np.min(reward)) if n else np.inf,
                "1",
                "extremum",
                n,
            ),
        ]
    return StyleOutput(tuple(out))


@dataclass(frozen=True)
class _Documents:
    """Fast-LLM's documents of a step: every row of one `sample_id` (consecutive rows) is one document."""

    of_token: np.ndarray  # (M,) document of each loss token
    tokens: np.ndarray  # (D,) N_d, loss tokens per document
    count: int  # D, fully masked documents included

    @staticmethod
    def of(inputs: StyleInputs) -> _Documents:
        count = int(inputs.document.max()) + 1 if inputs.n_samples else 0
        tokens = np.bincount(inputs.document, weights=inputs.n_loss, minlength=count)  # (D,)
        return _Documents(inputs.document[inputs.token_sample], tokens, count)

    def mean(self, x: np.ndarray) -> np.ndarray:
        """(D,) Σ_t x / max(N_d, 1) over each document's tokens (0 for a fully masked one)."""
        return np.bincount(self.of_token, weights=x, minlength=self.count) / np.maximum(self.tokens, 1.0)


def _ratio_fields(
    inputs: StyleInputs, settings: MetricSettings, docs: _Documents
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Per-token ratio, kl_new_old and band indicator (sequence level: the document's values broadcast),
    plus the raw ratio sums."""
    assert inputs.lp_new is not None and inputs.lp_old is not None
    if settings.level == "sequence":
        mean_d = docs.mean(inputs.lp_new - inputs.lp_old)  # (D,) δ̄_d
        doc_ratio = exp(mean_d)  # (D,) R_d
        band = _band(doc_ratio, settings)
        kl = doc_ratio - 1.0 - mean_d
        has_tokens = docs.tokens > 0
        return (
            doc_ratio[docs.of_token],
            kl[docs.of_token],
            band[docs.of_token],
            total(doc_ratio[has_tokens]),
            total(doc_ratio[has_tokens] ** 2),
        )
    d = inputs.lp_new - inputs.lp_old  # (M,)
    ratio = exp(d)
    return ratio, ratio - 1.0 - d, _band(ratio, settings), total(ratio), total(ratio * ratio)


def _band(ratio: np.ndarray, settings: MetricSettings) -> np.ndarray:
    """1[r < 1 − ε_l ∨ r > 1 + ε_h] as float (Fast-LLM's `clipped`, any advantage)."""
    return ((ratio < 1.0 - settings.clip.eps_low) | (ratio > 1.0 + settings.clip.eps_high)).astype(np.float64)


def _loss(inputs: StyleInputs, settings: MetricSettings, docs: _Documents) -> float:
    """`grpo`: Σ m ℓ / N, NaN (null) with N = 0 as Fast-LLM's unguarded `reduce_losses`; `gspo`: (1/D) Σ_d N_d l_d (length-proportional GSPO over documents)."""
    assert inputs.lp_new is not None and inputs.lp_old is not None and inputs.adv is not None
    if settings.level == "sequence":
        doc_ratio = exp(docs.mean(inputs.lp_new - inputs.lp_old))  # (D,) R_d
        doc_adv = docs.mean(inputs.adv)  # (D,) Ā_d
        clipped = clip_ratio(doc_ratio, settings.clip.eps_low, settings.clip.eps_high)
        doc_loss = -np.minimum(doc_ratio * doc_adv, clipped * doc_adv)  # (D,) l_d
        return div(total(docs.tokens * doc_loss), docs.count)
    ratio = exp(inputs.lp_new - inputs.lp_old)
    token_loss = ppo_token_loss(ratio, inputs.adv, settings.clip.eps_low, settings.clip.eps_high)
    return div(total(token_loss), inputs.n_tokens)  # num_labels_in_batch, no max(·, 1) guard
