"""`--key-style pipelinerl`: PipelineRL's `rl/*` loss and statistics (docs/key-styles.md).

What: the stats of `pipelinerl/finetune/rl/__init__.py::rl_step` (RLConfig `policy_loss = ppo`) after
`pipelinerl/finetune/rl/utils.py::aggregate_rl_stats`, plus `rl/ess` from `pipelinerl/finetune_loop.py`.

Why: PipelineRL weights every token by 1/N_i and divides by the samples of the step
(`doc(x) = (1/S) Σ_i Σ_t m x / N_i`), divides its loss by `RLConfig.batch_size` (not by tokens), and its
`clamp_log_ratio_new_old_indicator` is the **band** fraction (any advantage). The old log-probs
are the inference engine's (feed them as lp_old). Keys named "...min"/"...max" are extrema, "...sum" and
"loss" are plain sums.

How: `rl/loss` = Σ_t w_t [ℓ_t + kl_coef·k̂_t] with w_t = 1/batch_size (`--batch-size`, default S) or, with
`--group-normalize`, 1/(mean input length of the sample's group); ℓ = max(−A r, −A clip(r)) without dual clip or ratio
clamp; k̂ = e^c − c − 1 with c = clamp(lp_ref − lp_new, ±10), only when a reference stream is present
(`--kl-coef`, default 0.1). A step without labels logs no `rl/*` stats, as `rl_step` returns early.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pgdiag.metrics.styles.common import clip_ratio, div, exp, extremum, ppo_token_loss, total, value
from pgdiag.metrics.styles.flags import StyleRules, require_at_least
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput
from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

RULES = StyleRules(
    "pipelinerl",
    frozenset({"batch_size", "group_normalize", "kl_coef"}),
    {"token_mean": "ppo", "ppo": "ppo", "seq_mean_token_sum": "ppo"},  # policy losses
    "ppo",
)
DEFAULT_KL_COEF = 0.1
CLAMP_LOG_RATIO_REF_NEW = 10.0


def check_pipelinerl_settings(settings: MetricSettings) -> None:
    """Reject flags PipelineRL has no setting for; only the `ppo` policy loss is reproduced."""
    RULES.check(settings)
    require_at_least("--batch-size", settings.style.batch_size, 1)


def compute_pipelinerl(inputs: StyleInputs, settings: MetricSettings) -> StyleOutput:
    """PipelineRL's `rl/*` keys for one step (one micro-batch, samples_per_step = S)."""
    n, s = inputs.n_tokens, inputs.n_samples
    if n == 0:
        return StyleOutput((), ("pipelinerl: a step without labels logs no rl/* stats",))
    notices = []
    token_weight = 1.0 / inputs.per_token(inputs.n_loss.astype(np.float64))  # (M,) 1/N_i

    def doc(x: np.ndarray) -> float:
        return div(total(x * token_weight), s)

    def mean_key(key: str, x: np.ndarray, unit: str) -> MetricValue:
        return value(key, doc(x), unit, "document", s)

    def extreme_keys(name: str, x: np.ndarray, unit: str) -> list[MetricValue]:
        return [
            value(f"rl/max_{name}", extremum(x, "max"), unit, "extremum", n),
            value(f"rl/min_{name}", extremum(x, "min"), unit, "extremum", n),
        ]

    kl_ref = None
    if inputs.lp_new is not None and inputs.lp_ref is not None:
        c = np.clip(inputs.lp_ref - inputs.lp_new, -CLAMP_LOG_RATIO_REF_NEW, CLAMP_LOG_RATIO_REF_NEW)
        kl_ref = exp(c) - c - 1.0  # (M,) k̂
    out: list[MetricValue] = []
    if inputs.has_policy and inputs.adv is not None:
        loss, loss_notice = _loss(inputs, settings, kl_ref)
        notices += loss_notice
        out.append(value("rl/loss", loss, "loss", "mode", n))
    if inputs.lp_new is not None:
        out.append(mean_key("rl/new_logprobs", inputs.lp_new, "nats"))
    if inputs.lp_old is not None:
        out.append(mean_key("rl/old_logprobs", inputs.lp_old, "nats"))
    if inputs.lp_ref is not None:
        out.append(mean_key("rl/ref_logprobs", inputs.lp_ref, "nats"))
    if inputs.adv is not None:
        out += [mean_key("rl/advantage", inputs.adv, "1"), *extreme_keys("advantage", inputs.adv, "1")]
    if inputs.reward is not None:
        reward = inputs.per_token(inputs.reward)
        out += [mean_key("rl/reward", reward, "1"), *extreme_keys("reward", reward, "1")]
    if inputs.entropy is not None:
        out.append(mean_key("rl/entropy", inputs.entropy, "nats"))
    if inputs.has_policy:
        out += _ratio_keys(inputs, settings, doc)
    if kl_ref is not None:
        assert inputs.lp_ref is not None and inputs.lp_new is not None and inputs.lp_old is not None
        ref_new = inputs.lp_ref - inputs.lp_new
        out += [
            mean_key("rl/kl", kl_ref, "nats"),
            *extreme_keys("kl", kl_ref, "nats"),
            mean_key("rl/ratio_ref_new", exp(ref_new), "ratio"),
            mean_key("rl/ratio_ref_old", exp(inputs.lp_ref - inputs.lp_old), "ratio"),
            mean_key(
                "rl/clamp_log_ratio_ref_new_indicator",
                (np.abs(ref_new) > CLAMP_LOG_RATIO_REF_NEW) * 1.0,
                "fraction",
            ),
        ]
    return StyleOutput(tuple(out), tuple(notices))


def _ratio_keys(
    inputs: StyleInputs, settings: MetricSettings, doc: Callable[[np.ndarray], float]
) -> list[MetricValue]:
    """rl/ratio_new_old (+ sums, ess), kl_new_old, the band indicator and mean_abs_log_ratio_new_old."""
    assert inputs.lp_new is not None and inputs.lp_old is not None
    n, s = inputs.n_tokens, inputs.n_samples
    d = inputs.lp_new - inputs.lp_old  # (M,)
    ratio = exp(d)
    ratio_sum, ratio_sq_sum = total(ratio), total(ratio * ratio)
    band = clip_ratio(ratio, settings.clip.eps_low, settings.clip.eps_high) != ratio
    return [
        value("rl/ratio_new_old", doc(ratio), "ratio", "document", s),
        value("rl/ratio_new_old_sum", ratio_sum, "ratio", "sum", n),
        value("rl/ratio_new_old_squared_sum", ratio_sq_sum, "ratio", "sum", n),
        value("rl/num_output_tokens_sum", n, "count", "sum", n),
        value("rl/ess", div(div(ratio_sum**2, ratio_sq_sum), n), "1", "step", n),
        value("rl/kl_new_old", doc(ratio - 1.0 - d), "nats", "document", s),
        value("rl/clamp_log_ratio_new_old_indicator", doc(band * 1.0), "fraction", "document", s),
        value("rl/mean_abs_log_ratio_new_old", doc(np.abs(d)), "nats", "document", s),
    ]


def _loss(
    inputs: StyleInputs, settings: MetricSettings, kl_ref: np.ndarray | None
) -> tuple[float, list[str]]:
    """rl/loss = Σ_t w_t [ℓ_t + kl_coef·k̂_t] (entropy_bonus = 0) and the notices it raises."""
    assert inputs.lp_new is not None and inputs.lp_old is not None and inputs.adv is not None
    notices = []
    token_loss = ppo_token_loss(
        exp(inputs.lp_new - inputs.lp_old), inputs.adv, settings.clip.eps_low, settings.clip.eps_high
    )
    kl_coef = DEFAULT_KL_COEF if settings.style.kl_coef is None else settings.style.kl_coef
    if kl_ref is not None:
        token_loss = token_loss + kl_coef * kl_ref
    elif kl_coef != 0.0:
        notices.append(
            f"pipelinerl: no reference stream, so the kl_coef = {kl_coef} term is left out of rl/loss"
        )
    if settings.style.group_normalize:
        groups, group_of_sample = np.unique(inputs.group, return_inverse=True)
        length_sum = np.bincount(group_of_sample, weights=inputs.seq_len, minlength=groups.shape[0])
        members = np.bincount(group_of_sample, minlength=groups.shape[0])
        group_length = (length_sum / members)[group_of_sample]  # (S,) mean input length of the group
        return total(token_loss / inputs.per_token(group_length)), notices
    batch_size = settings.style.batch_size if settings.style.batch_size is not None else inputs.n_samples
    return div(total(token_loss), batch_size), notices
