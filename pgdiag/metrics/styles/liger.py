"""`--key-style liger`: Liger-Kernel 0.8.5's fused GRPO loss outputs (docs/key-styles.md).

What: `loss`, `kl` (β ≠ 0) and `clip_ratio`, the positional outputs of
`src/liger_kernel/chunked_loss/grpo_loss.py::LigerFusedLinearGRPOFunction.ppo_loss_fn`, named as TRL logs
them; the dapo normalizer is `fused_linear_ppo.py::LigerFusedLinearPPOBase._compute_dapo_normalizer`.

Why: Liger's defaults differ from TRL's on the same math: β = 0.04 (so the logged loss carries a k3
reference-KL term; without a reference stream Liger uses lp_new as reference and the term is 0),
`dr_grpo` has no default max_completion_length, and `luspo` divides Σ_i N_i Σ_t ℓ_it by B·T′ over the
**padded** width T′, padding included (pgdiag sums masked tokens only and says so in a notice).

How: one call = the whole step (the chunked sums equal the unchunked value), one advantage per sample
(Ā_i), `--level sequence` = `importance_sampling_level = "sequence"` with R_i broadcast to tokens.
T′ = `--pad-width`, default the longest response (seq_len − prompt_len) of the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pgdiag.metrics.styles.common import clip_ratio, div, div_array, exp, k3_ref, mean_guard, total, value
from pgdiag.metrics.styles.flags import StyleRules, require_at_least
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput
from pgdiag.metrics.styles.trl import LOSS_TYPES, aggregate_loss_type

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

RULES = StyleRules(
    "liger",
    frozenset({"divisor", "level", "beta", "pad_width"}),
    LOSS_TYPES,
    "dapo",
    divisor_needed={
        "dr_grpo": (
            "liger dr_grpo needs --divisor (max_completion_length); Liger has no default for it",
            None,
        )
    },
)
DEFAULT_BETA = 0.04


def check_liger_settings(settings: MetricSettings) -> None:
    """Reject flags Liger has no setting for; `dr_grpo` needs max_completion_length (`--divisor`)."""
    RULES.check(settings)
    require_at_least("--pad-width", settings.style.pad_width, 1)


def compute_liger(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """Liger's outputs for one step (one call, no torch.distributed, num_items_in_batch = None)."""
    if not inputs.has_policy or inputs.adv is None:
        return StyleOutput((), ("liger: the loss function needs the new and old streams and advantages",))
    assert inputs.lp_new is not None and inputs.lp_old is not None
    loss_type = RULES.mode(settings)
    beta = DEFAULT_BETA if settings.style.beta is None else settings.style.beta
    sequence = settings.level == "sequence"
    n = inputs.n_tokens
    notices = []
    if inputs.lp_ref is not None:
        kl = k3_ref(inputs.lp_ref, inputs.lp_new)  # (M,)
    else:
        kl = np.zeros(n)  # Liger's reference defaults to lp_new.detach(): k3 = 0
        if beta != 0.0:
            notices.append(f"liger: no reference stream, so the β = {beta} KL term is 0 (Liger uses lp_new)")
    if sequence:
        ratio = inputs.per_token(exp(inputs.seq_mean_logratio()))  # (M,) R_i
    else:
        ratio = exp(inputs.lp_new - inputs.lp_old)  # (M,)
    adv = inputs.per_token(inputs.sample_mean_adv())  # (M,) Ā_i
    token_loss = -np.minimum(
        ratio * adv, clip_ratio(ratio, settings.clip.eps_low, settings.clip.eps_high) * adv
    )
    if beta != 0.0:
        token_loss = token_loss + beta * kl
    if loss_type == "luspo":
        loss = _luspo(inputs, token_loss, settings)
        if not sequence:
            notices.append("liger: luspo at token level sums masked tokens only (Liger also sums padding)")
    else:
        divisor = settings.divisor if settings.divisor is not None else float("nan")
        loss = aggregate_loss_type(inputs, token_loss, loss_type, divisor)
    out = [value("loss", loss, "loss", "mode", n)]
    if beta != 0.0:
        out.append(value("kl", mean_guard(kl), "nats", "token", n))
    low = (ratio < 1.0 - settings.clip.eps_low) & (adv < 0)
    high = (ratio > 1.0 + settings.clip.eps_high) & (adv > 0)
    out.append(value("clip_ratio", mean_guard((low | high) * 1.0), "fraction", "token", n))
    return StyleOutput(tuple(out), tuple(notices))


def _luspo(inputs: StyleInputs, token_loss: np.ndarray, settings: MetricSettings) -> float:
    """Σ_i N_i Σ_t ℓ_it / (B·T′) with T′ the padded width (1 at sequence level, where ℓ_it = l_i)."""
    if settings.level == "sequence":
        seq_loss = div_array(inputs.sample_sum(token_loss), inputs.n_loss, empty=0.0)  # (S,) l_i
        return div(total(inputs.n_loss * seq_loss), inputs.n_samples)
    width = settings.style.pad_width
    if width is None:
        width = int(np.max(inputs.seq_len - inputs.prompt_len)) if inputs.n_samples else 1
    return div(total(inputs.n_loss * inputs.sample_sum(token_loss)), inputs.n_samples * width)
