"""Shared pieces of the framework key styles (docs/key-styles.md): inputs, guarded means, clamps, flags.

What: every style reads the same flat token arrays of one step and reduces them with its framework's own
denominator guard. This module resolves those arrays once (`StyleInputs`), gives each guard a name
(`mean_eps` for verl's ``Σ m x / (Σ m + 1e-8)``, `mean_guard` for the ``max(Σ m, 1)`` of TRL, Liger, miles
and Fast-LLM, `sample_mean_guard` for miles' ``SM``, `document_mean` for Fast-LLM's per-document weights),
and checks that a style is only given flags its framework has.

Why: the guards, clamps and reductions are exactly where the frameworks disagree (docs/key-styles.md), so they
live in one place with one name each, and the style modules read like the tables of docs/key-styles.md.

How: all arithmetic is float64 numpy over the flat (M,) token arrays of `TokenBatch`; per-sample sums use
`np.bincount` on `TokenBatch.token_sample()`. Only loss positions are in a batch, so ``m = 1`` on every
token and ``Σ m = M``. Non-finite inputs propagate as the framework propagates them; a NaN result becomes
``None`` in `MetricValue`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

# Style-only and style-sensitive settings: (attribute, CLI flag, value meaning "not given").
_FLAG_DEFAULTS: tuple[tuple[str, str, object], ...] = (
    ("dual_clip", "--dual-clip", None),
    ("divisor", "--divisor", None),
    ("grad_divisor", "--grad-divisor", None),
    ("empty_seqs", "--empty-seqs", "count"),
    ("level", "--level", "token"),
    ("zero_std_atol", "--zero-std-atol", 0.0),
    ("loss_name", "--loss-name", None),
    ("rollout_is", "--rollout-is", None),
    ("rollout_is_threshold", "--rollout-is-threshold", None),
    ("beta", "--beta", None),
    ("vllm_is", "--no-vllm-is", True),
    ("kl_bias_correction", "--no-kl-bias-correction", True),
    ("pad_width", "--pad-width", None),
    ("tis", "--tis", False),
    ("mismatch_metrics", "--mismatch-metrics", False),
    ("batch_size", "--batch-size", None),
    ("group_normalize", "--group-normalize", False),
    ("kl_coef", "--kl-coef", None),
)


@dataclass(frozen=True)
class StyleOutput:
    """What one style computes for one step: its keys in table order plus notices for the report."""

    values: tuple[MetricValue, ...]
    notices: tuple[str, ...] = ()


@dataclass(frozen=True)
class StyleInputs:
    """The arrays of one step that the styles read; a None array means that input is absent."""

    token_sample: np.ndarray  # (M,) int64 sample of each token
    n_loss: np.ndarray  # (S,) int64 loss positions per sample (N_i)
    document: np.ndarray  # (S,) int64 document of each sample
    group: np.ndarray  # (S,) int64 prompt group of each sample
    seq_len: np.ndarray  # (S,) int64 len(input_ids)
    prompt_len: np.ndarray  # (S,) int64
    lp_new: np.ndarray | None  # (M,)
    lp_old: np.ndarray | None  # (M,)
    lp_a: np.ndarray | None  # (M,) mismatch pair, sampling side (rollout)
    lp_b: np.ndarray | None  # (M,) mismatch pair, evaluated side (train)
    lp_ref: np.ndarray | None  # (M,)
    entropy: np.ndarray | None  # (M,)
    adv: np.ndarray | None  # (M,) per-token advantage
    reward: np.ndarray | None  # (S,)

    @property
    def n_samples(self) -> int:
        return int(self.n_loss.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.token_sample.shape[0])

    @property
    def has_policy(self) -> bool:
        return self.lp_new is not None and self.lp_old is not None

    @property
    def has_pair(self) -> bool:
        return self.lp_a is not None and self.lp_b is not None

    def sample_sum(self, x: np.ndarray) -> np.ndarray:
        """(S,) Σ_t x over each sample's tokens (NaN and inf propagate)."""
        return np.bincount(self.token_sample, weights=x, minlength=self.n_samples).astype(np.float64)

    def per_token(self, x_sample: np.ndarray) -> np.ndarray:
        """(M,) a per-sample array broadcast to the sample's tokens."""
        return x_sample[self.token_sample]

    def sample_mean_adv(self) -> np.ndarray:
        """(S,) Ā_i = Σ_t A / N_i, 0 for an empty sample (TRL/Liger take one advantage per sample)."""
        assert self.adv is not None
        return div_array(self.sample_sum(self.adv), self.n_loss, empty=0.0)

    def seq_mean_logratio(self) -> np.ndarray:
        """(S,) δ̄_i = Σ_t d / max(N_i, 1) (the GSPO log-ratio; 0 for an empty sample)."""
        assert self.lp_new is not None and self.lp_old is not None
        return self.sample_sum(self.lp_new - self.lp_old) / np.maximum(self.n_loss, 1)


def read_inputs(batch: TokenBatch, settings: MetricSettings) -> StyleInputs:
    """The style inputs of `batch` under the stream roles of `settings` (docs/key-styles.md)."""

    def stream(name: str | None, what: str) -> np.ndarray | None:
        if name is None:
            return None
        if name not in batch.streams:
            present = ", ".join(batch.streams) or "none"
            raise UsageError(
                Code.STREAM_NOT_FOUND, f"{batch.label}: no stream {name!r} for {what}", f"streams: {present}"
            )
        return np.asarray(batch.streams[name], dtype=np.float64)

    entropy = None
    if settings.entropy is not None:
        if settings.entropy not in batch.entropy:
            present = ", ".join(batch.entropy) or "none"
            raise UsageError(
                Code.STREAM_NOT_FOUND,
                f"{batch.label}: no entropy for {settings.entropy!r}",
                f"entropy of: {present}",
            )
        entropy = np.asarray(batch.entropy[settings.entropy], dtype=np.float64)
    lp_a = stream(settings.stream_a, "--stream-a")
    lp_b = stream(settings.stream_b, "--stream-b")
    if lp_a is None or lp_b is None:
        lp_a = lp_b = None
    return StyleInputs(
        token_sample=batch.token_sample(),
        n_loss=batch.n_loss.astype(np.int64),
        document=batch.documents(),
        group=np.asarray(batch.group, dtype=np.int64),
        seq_len=np.asarray(batch.seq_len, dtype=np.int64),
        prompt_len=np.asarray(batch.prompt_len, dtype=np.int64),
        lp_new=stream(settings.new, "--new"),
        lp_old=stream(settings.old, "--old"),
        lp_a=lp_a,
        lp_b=lp_b,
        lp_ref=stream(settings.ref, "--ref"),
        entropy=entropy,
        adv=None if batch.advantages is None else np.asarray(batch.advantages, dtype=np.float64),
        reward=None if batch.reward is None else np.asarray(batch.reward, dtype=np.float64),
    )


def div(num: float, den: float) -> float:
    """num / den with torch's semantics: x/0 = ±inf, 0/0 = NaN (never a Python ZeroDivisionError)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(num) / np.float64(den))


def div_array(num: np.ndarray, den: np.ndarray, *, empty: float) -> np.ndarray:
    """Elementwise num / den where den > 0, `empty` where den == 0."""
    out = np.full(num.shape, empty, dtype=np.float64)
    nonzero = den > 0
    out[nonzero] = num[nonzero] / den[nonzero]
    return out


def total(x: np.ndarray) -> float:
    """Σ x in float64 (numpy pairwise summation)."""
    return float(np.sum(x, dtype=np.float64))


def mean_eps(x: np.ndarray, eps: float = 1e-8) -> float:
    """verl `masked_mean`: Σ m x / (Σ m + 1e-8); 0 on an empty step."""
    return div(total(x), x.shape[0] + eps)


def mean_guard(x: np.ndarray) -> float:
    """TRL/Liger/miles/Fast-LLM token mean: Σ m x / max(Σ m, 1); 0 on an empty step."""
    return div(total(x), max(x.shape[0], 1))


def sample_mean_guard(inputs: StyleInputs, x: np.ndarray) -> float:
    """miles `SM(x)` = (1/S) Σ_i Σ_t m x / max(N_i, 1): empty samples add 0 and count in S."""
    per_sample = inputs.sample_sum(x) / np.maximum(inputs.n_loss, 1)  # (S,)
    return div(total(per_sample), inputs.n_samples)


def extremum(x: np.ndarray, kind: str) -> float | None:
    """max or min over the step's tokens; None when there are none (the frameworks raise or log nothing)."""
    if x.shape[0] == 0:
        return None
    return float(np.max(x) if kind == "max" else np.min(x))


def clip_ratio(r: np.ndarray, eps_low: float, eps_high: float) -> np.ndarray:
    """clip(r) = min(max(r, 1 − ε_l), 1 + ε_h), NaN kept (torch.clamp semantics)."""
    return np.clip(r, 1.0 - eps_low, 1.0 + eps_high)


def ppo_token_loss(ratio: np.ndarray, adv: np.ndarray, eps_low: float, eps_high: float) -> np.ndarray:
    """ℓ = max(−A r, −A clip(r)) per token (docs/metrics.md), NaN propagated as torch.maximum does."""
    return np.maximum(-adv * ratio, -adv * clip_ratio(ratio, eps_low, eps_high))


def k3_ref(lp_ref: np.ndarray, lp_new: np.ndarray) -> np.ndarray:
    """TRL/Liger reference KL per token: e^(lp_ref − lp_new) − (lp_ref − lp_new) − 1, unclamped."""
    x = lp_ref - lp_new
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(x) - x - 1.0


def exp(x: np.ndarray) -> np.ndarray:
    """np.exp without overflow warnings (an overflow is +inf, as in torch)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(x)


def value(key: str, v: float | None, unit: str, reduction: str, n: int) -> MetricValue:
    """A `MetricValue` with the value cast to a Python float (NaN becomes None in `MetricValue`)."""
    return MetricValue(key, None if v is None else float(v), unit, reduction, int(n))


def check_flags(style: str, settings: MetricSettings, allowed: frozenset[str]) -> None:
    """Reject every style-only setting that `style`'s framework does not have (docs/key-styles.md, exit 2);
    a dual-clip constant <= 1 never gets here (`ClipBand` rejects it)."""
    given = settings.to_dict()
    for attr, flag, unset in _FLAG_DEFAULTS:
        if attr in allowed:
            continue
        if given[attr] != unset:
            raise UsageError(
                Code.NOT_IN_KEY_STYLE,
                f"{flag} is not a setting of --key-style {style} (got {given[attr]!r})",
                "see docs/key-styles.md for the flags each style accepts",
            )


def require_divisor(settings: MetricSettings, needed: bool, message: str, hint: str | None = None) -> None:
    """`UsageError` MISSING_SETTING (exit 2) saying `message` when the framework's loss mode needs a divisor
    (`needed`) and `--divisor` is not given."""
    if needed and settings.divisor is None:
        raise UsageError(Code.MISSING_SETTING, message, hint)


def resolve_alias(style: str, aggregation: str | None, table: Mapping[str, str], default: str) -> str:
    """The framework loss mode named by `--aggregation` under `style`: its own spelling, with or without
    the ``style:`` prefix, or the equivalent native mode name; None means the framework default."""
    if aggregation is None:
        return default
    name = aggregation.split(":", 1)[1] if aggregation.startswith(f"{style}:") else aggregation
    if name in table:
        return table[name]
    accepted = ", ".join(sorted(table))
    raise UsageError(
        Code.NOT_IN_KEY_STYLE,
        f"--aggregation {aggregation!r} is not a loss aggregation of --key-style {style}",
        f"accepted: {accepted}",
    )
