"""Policy-gradient loss under every aggregation mode and its gradient diagnostics (docs/metrics.md).

Per-token losses, valid tokens only:
    token level  ℓ_t   = max(−A_t r_t, −A_t clip(r_t));  with --dual-clip C and A_t < 0: ℓ_t = min(ℓ_t, −C·A_t)
    GSPO level   ℓ^G_t = max(−A_t R_i, −A_t clip(R_i)),  R_i = exp(mean_t d) of the token's sample.
Every mode is a per-sample weighting: the token weight w_t is constant within a sample (c_i), so
`loss/<mode> = Σ_i c_i Σ_t ℓ_t` and `grad/<mode>_scale = Σ_i c_i Σ_t |g_t|` come from four per-sample sums
(`LossSums`: token and GSPO loss, token and GSPO |g|) built once per batch; a step only re-weights its rows. `resolve_aggregation` maps the framework spellings (docs/metrics.md) to a native mode plus its
divisor semantics; `loss/pg` repeats the selected mode.

Why report every mode: the same tokens give different losses under verl `token-mean`, TRL `grpo` and miles
`constant`; comparing a logged loss to the right mode is the whole point of a parity check. The grad keys
show how each mode rescales the effective learning rate and how much it favours long samples.

Worked example: Σ m'ℓ = 1.047195 over N = 13 tokens, S = 4: token_mean 0.080553, sample_mean 0.001114,
prompt_mean 0.073046, constant (L = 4) 0.065450, seq_mean_token_sum 0.261799.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.reduce import SAMPLE_AXIS, TokenReducer, linear_fit
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles.trl import DEFAULT_MAX_COMPLETION_LENGTH

NATIVE_MODES = (
    "token_mean",
    "sample_mean",
    "prompt_mean",
    "constant",
    "seq_mean_token_sum",
    "token_sum",
    "gspo_seq_mean",
    "gspo_length_prop",
    "gspo_token_mean",
)
GSPO_MODES = ("gspo_seq_mean", "gspo_length_prop", "gspo_token_mean")


@dataclass(frozen=True)
class AliasRule:
    """One framework spelling (docs/metrics.md) and the native mode it means at token and at sequence level."""

    framework: str
    name: str
    token_mode: str | None  # None: no native equivalent at this level
    sequence_mode: str | None
    denominator: str  # the exact denominator in the framework
    bare: bool  # accepted without the ``framework:`` prefix
    default_divisor: float | None = None  # L when `--divisor` is absent (TRL max_completion_length)
    batch_size_samples: bool = False  # S := `--batch-size` (PipelineRL RLConfig.batch_size)


AGGREGATION_ALIASES: tuple[AliasRule, ...] = (
    AliasRule(
        "verl", "token-mean", "token_mean", "gspo_token_mean", "Σ mℓ / batch_num_tokens (agg_loss)", True
    ),
    AliasRule("verl", "token-sum", "token_sum", None, "Σ mℓ", True),
    AliasRule(
        "verl", "seq-mean-token-mean", "sample_mean", "gspo_seq_mean", "Σ_{N_i>0} Σ_t mℓ / N_i / GB", True
    ),
    AliasRule(
        "verl", "seq-mean-token-sum", "seq_mean_token_sum", "gspo_length_prop", "Σ_{N_i>0} Σ_t mℓ / GB", True
    ),
    AliasRule("verl", "seq-mean-token-sum-norm", "constant", None, "Σ mℓ / (GB·loss_scale_factor)", True),
    AliasRule("trl", "grpo", "sample_mean", "gspo_seq_mean", "(1/B) Σ_i Σ_t mℓ / max(N_i, 1)", True),
    AliasRule("trl", "sapo", "sample_mean", "gspo_seq_mean", "(1/B) Σ_i Σ_t mℓ / max(N_i, 1)", True),
    AliasRule("trl", "bnpo", "token_mean", "gspo_token_mean", "Σ mℓ / max(N, 1)", True),
    AliasRule(
        "trl",
        "dr_grpo",
        "constant",
        None,
        "Σ mℓ / (B·max_completion_length)",
        True,
        float(DEFAULT_MAX_COMPLETION_LENGTH),
    ),
    AliasRule("trl", "dapo", "token_mean", "gspo_token_mean", "Σ mℓ / num_items_in_batch", True),
    AliasRule("trl", "luspo", "seq_mean_token_sum", "gspo_length_prop", "(1/B) Σ_i Σ_t mℓ (masked)", False),
    AliasRule("liger", "grpo", "sample_mean", "gspo_seq_mean", "(1/B) Σ_i Σ_t mℓ / max(N_i, 1)", True),
    AliasRule("liger", "sapo", "sample_mean", "gspo_seq_mean", "(1/B) Σ_i Σ_t mℓ / max(N_i, 1)", True),
    AliasRule("liger", "bnpo", "token_mean", "gspo_token_mean", "Σ mℓ / max(N, 1)", True),
    AliasRule("liger", "dr_grpo", "constant", None, "Σ mℓ / (B·max_completion_length)", True),
    AliasRule("liger", "dapo", "token_mean", "gspo_token_mean", "Σ mℓ / max(N, 1)", True),
    AliasRule("liger", "luspo", None, "gspo_length_prop", "Σ_i N_i Σ_t ℓ_it / (B·T′), unmasked", False),
    AliasRule("miles", "sample_mean", "sample_mean", "sample_mean", "(1/S) Σ_i Σ_t mℓ / max(N_i, 1)", True),
    AliasRule("miles", "prompt_mean", "prompt_mean", "prompt_mean", "(1/P) Σ_g Σ mℓ / N_g", True),
    AliasRule("miles", "token_mean", "token_mean", "token_mean", "Σ mℓ / N", True),
    AliasRule("miles", "constant", "constant", "constant", "Σ mℓ / L / S", True),
    AliasRule("miles", "calculate-per-token-loss", "token_mean", "token_mean", "Σ mℓ / N", True),
    AliasRule("fast-llm", "grpo", "token_mean", "gspo_length_prop", "Σ mℓ / num_labels_in_batch", False),
    AliasRule("fast-llm", "gspo", "gspo_length_prop", "gspo_length_prop", "(1/D) Σ_s N_s l_s", False),
    AliasRule(
        "pipelinerl", "ppo", "seq_mean_token_sum", "gspo_length_prop", "Σ mℓ / batch_size", False, None, True
    ),
)


@dataclass(frozen=True)
class ResolvedAggregation:
    """`--aggregation` after alias resolution: the native mode and the divisors it uses."""

    name: str  # as given
    framework: str | None  # None for a native mode name
    mode: str  # one of NATIVE_MODES
    divisor: float | None  # L of `constant`
    sample_count: int | None  # S override (PipelineRL batch_size); None = the step's S
    denominator: str  # the framework's exact denominator (docs and report header)


def resolve_aggregation(name: str | None, settings: MetricSettings) -> ResolvedAggregation:
    """Map a native mode or a framework alias (``verl:seq-mean-token-mean``, ``dr_grpo``) to a mode.

    None (no `--aggregation`) is the native default, ``token_mean``.

    Raises UsageError for an unknown name, a prefix-only alias given bare, an alias with no native mode at
    `settings.level`, or `constant` without a positive `--divisor`.
    """
    if name is None:
        name = "token_mean"
    if name in NATIVE_MODES:
        rule = None
        mode = name
    else:
        rule = _find_alias(name)
        mode = rule.token_mode if settings.level == "token" else rule.sequence_mode
        if mode is None:
            raise UsageError(
                Code.NOT_IN_KEY_STYLE,
                f"--aggregation {name}: {rule.framework} {rule.name} has no native loss mode at --level "
                f"{settings.level}",
                "liger:luspo at token level exists only under --key-style liger; verl token-sum, "
                "seq-mean-token-sum-norm and dr_grpo have no sequence-level form",
            )
    divisor = settings.divisor
    if divisor is None and rule is not None and name.startswith(f"{rule.framework}:"):
        divisor = rule.default_divisor
    if mode == "constant" and divisor is None:
        raise UsageError(
            Code.MISSING_SETTING,
            f"--aggregation {name} resolves to `constant`, which needs --divisor L (loss = Σ m'ℓ / (L·S))",
            "pass --divisor, e.g. the max_completion_length or loss_scale_factor of the run",
        )
    sample_count = None
    if rule is not None and rule.batch_size_samples and settings.style.batch_size is not None:
        if settings.style.batch_size < 1:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--batch-size must be at least 1, got {settings.style.batch_size}",
                None,
            )
        sample_count = settings.style.batch_size
    return ResolvedAggregation(
        name=name,
        framework=None if rule is None else rule.framework,
        mode=mode,
        divisor=divisor if mode == "constant" else None,
        sample_count=sample_count,
        denominator=_native_denominator(mode) if rule is None else rule.denominator,
    )


def _find_alias(name: str) -> AliasRule:
    """The alias rule for ``framework:name`` or a bare name that means the same in every framework."""
    if ":" in name:
        framework, alias = name.split(":", 1)
        for rule in AGGREGATION_ALIASES:
            if rule.framework == framework and rule.name == alias:
                return rule
    else:
        matches = [rule for rule in AGGREGATION_ALIASES if rule.name == name]
        bare = [rule for rule in matches if rule.bare]
        if bare:
            return bare[0]
        if matches:
            options = ", ".join(f"{rule.framework}:{rule.name}" for rule in matches)
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--aggregation {name} needs a framework prefix",
                f"use one of {options}",
            )
    known = ", ".join(NATIVE_MODES)
    raise UsageError(
        Code.BAD_OPTION_VALUE,
        f"unknown --aggregation {name!r}",
        f"native modes: {known}; or an alias of docs/metrics.md such as verl:seq-mean-token-mean or dr_grpo",
    )


def _native_denominator(mode: str) -> str:
    """The denominator of a native mode, as written in docs/metrics.md."""
    return {
        "token_mean": "Σ m'ℓ / N",
        "sample_mean": "(1/S) Σ_i Σ_t m'ℓ / N_i",
        "prompt_mean": "(1/P) Σ_g Σ_{i∈g} Σ_t m'ℓ / N_g",
        "constant": "Σ m'ℓ / (L·S)",
        "seq_mean_token_sum": "Σ m'ℓ / S",
        "token_sum": "Σ m'ℓ",
        "gspo_seq_mean": "(1/S) Σ_i Σ_t m'ℓ^G / N_i",
        "gspo_length_prop": "(1/S) Σ_i Σ_t m'ℓ^G",
        "gspo_token_mean": "Σ m'ℓ^G / N",
    }[mode]


def token_loss_sums(
    advantages: np.ndarray,
    r: np.ndarray,
    positive: np.ndarray,
    reducer: TokenReducer,
    settings: MetricSettings,
    scratch: np.ndarray,
) -> np.ndarray:
    """(S,) Σ_t ℓ_t with ℓ_t = max(−A r, −A clip(r)), and ℓ_t = min(ℓ_t, −C·A) for A < 0 under dual clip C.

    max(−A r, −A clip(r)) is −A·min(r, 1 + ε_h) for A > 0 and −A·max(r, 1 − ε_l) for A < 0 (then capped
    at C), so one selected factor per token suffices. A token with A = 0 has ℓ = 0 even when r overflowed
    to +inf (0·inf is not a loss). `positive` (N,) is A > 0; `scratch` (N,) is a float64 work buffer.
    """
    factor = np.maximum(r, 1.0 - settings.clip.eps_low, out=scratch)  # (N,) for A < 0
    if settings.clip.dual_clip is not None:
        np.minimum(factor, settings.clip.dual_clip, out=factor)
    np.copyto(factor, np.minimum(r, 1.0 + settings.clip.eps_high), where=positive)
    with np.errstate(invalid="ignore"):
        factor *= advantages
    if not np.all(np.isfinite(r)):
        factor[advantages == 0] = 0.0
    return -reducer.sample_sums(factor)


def scaled(factor: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """factor · weight elementwise, 0 where weight is 0 (an infinite ratio times no advantage is no loss)."""
    with np.errstate(invalid="ignore"):
        return np.where(weight == 0, 0.0, factor * weight)


def gspo_loss_sums(
    seq_ratio: np.ndarray, positive_part: np.ndarray, negative_part: np.ndarray, settings: MetricSettings
) -> np.ndarray:
    """(S,) Σ_t ℓ^G_t with ℓ^G_t = max(−A_t R_i, −A_t clip(R_i)).

    For A > 0 the token loss is −A·min(R, clip(R)), for A < 0 it is |A|·max(R, clip(R)), so the sample sum is
    −min(R_i, clip(R_i))·Σ_t max(A, 0) + max(R_i, clip(R_i))·Σ_t max(−A, 0) (all arguments (S,)).
    """
    clipped = np.clip(seq_ratio, 1.0 - settings.clip.eps_low, 1.0 + settings.clip.eps_high)
    low_side = np.minimum(seq_ratio, clipped)
    high_side = np.maximum(seq_ratio, clipped)
    return scaled(high_side, negative_part) - scaled(low_side, positive_part)


def sample_weights(
    mode: str,
    n_per_sample: np.ndarray,
    group_of_sample: np.ndarray,
    n_groups: int,
    n_samples: int,
    divisor: float | None,
) -> np.ndarray | None:
    """(S,) per-token weight c_i of each sample under `mode` (the per-token weight w_t); None on a zero denominator.

    `n_samples` is the S of the formulas (S, S+ under --empty-seqs skip, or an alias's batch size).
    """
    n_tokens = int(n_per_sample.sum())
    if n_tokens == 0 or n_samples == 0:
        return None
    filled = n_per_sample > 0
    count = n_per_sample.shape[0]
    if mode in ("token_mean", "gspo_token_mean"):
        return np.full(count, 1.0 / n_tokens)
    if mode in ("sample_mean", "gspo_seq_mean"):
        return np.divide(1.0, n_samples * n_per_sample, out=np.zeros(count), where=filled)
    if mode in ("seq_mean_token_sum", "gspo_length_prop"):
        return np.full(count, 1.0 / n_samples)
    if mode == "token_sum":
        return np.ones(count)
    if mode == "constant":
        return None if divisor is None else np.full(count, 1.0 / (divisor * n_samples))
    if mode == "prompt_mean":
        group_tokens = np.bincount(group_of_sample, weights=n_per_sample, minlength=n_groups)[group_of_sample]
        return np.divide(1.0, n_groups * group_tokens, out=np.zeros(count), where=group_tokens > 0)
    raise ValueError(f"unknown loss mode {mode!r}")


@dataclass(frozen=True)
class LossSums:
    """Per-sample sums (S,) that every loss mode and grad key is a weighting of."""

    reducer: TokenReducer
    loss: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t ℓ_t
    loss_seq: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t ℓ^G_t
    abs_grad: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t |g_t| (token modes)
    abs_grad_seq: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t |g_t| (GSPO modes)

    def of_mode(self, mode: str) -> tuple[np.ndarray, np.ndarray]:
        """(loss sums, |g| sums) of the token or the GSPO family of `mode`."""
        if mode in GSPO_MODES:
            return self.loss_seq, self.abs_grad_seq
        return self.loss, self.abs_grad


def add_loss_metrics(
    sums: LossSums,
    group_of_sample: np.ndarray,
    n_groups: int,
    settings: MetricSettings,
    resolved: ResolvedAggregation,
    sink: MetricSink,
) -> None:
    """`loss/<mode>`, `loss/pg`, `grad/<mode>_*` and the `--grad-divisor` keys."""
    n_i = sums.reducer.n_per_sample
    n_tokens = int(n_i.sum())
    n_samples = int(np.count_nonzero(n_i)) if settings.empty_seqs == "skip" else int(n_i.shape[0])
    for mode in NATIVE_MODES:
        divisor = settings.divisor if mode == "constant" else None
        weights = sample_weights(mode, n_i, group_of_sample, n_groups, n_samples, divisor)
        losses, grads = sums.of_mode(mode)
        sink.add(f"loss/{mode}", _weighted(weights, losses), n_tokens)
        _add_grad_metrics(mode, weights, grads, n_i, sink)
    pg_samples = n_samples if resolved.sample_count is None else resolved.sample_count
    pg_weights = sample_weights(resolved.mode, n_i, group_of_sample, n_groups, pg_samples, resolved.divisor)
    pg_losses, pg_grads = sums.of_mode(resolved.mode)
    sink.add("loss/pg", _weighted(pg_weights, pg_losses), n_tokens)
    if settings.grad_divisor is not None:
        divisor_scale = float(np.sum(pg_grads)) / settings.grad_divisor if n_tokens else None
        pg_scale = _weighted(pg_weights, pg_grads)
        ratio = divisor_scale / pg_scale if divisor_scale is not None and pg_scale else None
        sink.add("grad/grad_divisor_scale", divisor_scale, n_tokens)
        sink.add("grad/grad_divisor_ratio", ratio, n_tokens)


def _weighted(weights: np.ndarray | None, per_sample: np.ndarray) -> float | None:
    """Σ_i c_i x_i, None when the weights are undefined."""
    return None if weights is None else float(np.sum(weights * per_sample))


def _add_grad_metrics(
    mode: str, weights: np.ndarray | None, abs_grad: np.ndarray, n_per_sample: np.ndarray, sink: MetricSink
) -> None:
    """scale, weight_sum, length_corr and length_elasticity of one mode."""
    n_tokens = int(n_per_sample.sum())
    if weights is None:
        for stat in ("scale", "weight_sum", "length_corr", "length_elasticity"):
            sink.add(f"grad/{mode}_{stat}", None, n_tokens)
        return
    sink.add(f"grad/{mode}_scale", float(np.sum(weights * abs_grad)), n_tokens)
    sample_weight = weights * n_per_sample  # (S,) W_i = Σ_t m' w_t
    sink.add(f"grad/{mode}_weight_sum", float(np.sum(sample_weight)), n_tokens)
    filled = n_per_sample > 0
    lengths, w = n_per_sample[filled].astype(np.float64), sample_weight[filled]  # (S+,)
    n_seq = int(lengths.shape[0])
    if n_seq == 0 or np.all(lengths == lengths[0]):
        corr = elasticity = None
    elif np.all(w == w[0]):
        corr = elasticity = 0.0
    else:
        corr = linear_fit(w, lengths).pearson_r
        elasticity = linear_fit(np.log(lengths), np.log(w)).slope
    sink.add(f"grad/{mode}_length_corr", corr, n_seq)
    sink.add(f"grad/{mode}_length_elasticity", elasticity, n_seq)


def aliases_markdown() -> str:
    """The alias table of docs/metrics.md: framework, name, mode at token and sequence level, denominator."""
    lines = [
        "| `--aggregation` | framework | token level | sequence level | framework's denominator |",
        "|---|---|---|---|---|",
    ]
    for rule in AGGREGATION_ALIASES:
        spelled = f"`{rule.framework}:{rule.name}`" + (f" or `{rule.name}`" if rule.bare else "")
        token = "—" if rule.token_mode is None else f"`{rule.token_mode}`"
        sequence = "—" if rule.sequence_mode is None else f"`{rule.sequence_mode}`"
        extra = ""
        if rule.default_divisor is not None:
            extra = f"; L defaults to {rule.default_divisor:g} with the prefix"
        if rule.batch_size_samples:
            extra = "; S := `--batch-size`"
        lines.append(f"| {spelled} | {rule.framework} | {token} | {sequence} | {rule.denominator}{extra} |")
    return "\n".join(lines) + "\n"
