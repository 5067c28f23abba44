"""The settings of `compute_metrics` as frozen dataclasses; the defaults here are the only place they live.

`ClipBand` is the PPO clip band that metrics and compare share; `StyleOptions` holds the settings only a
framework key style reads (docs/key-styles.md); `MetricSettings` holds the native settings and both. Each is
validated once, when it is built (`__post_init__`, `UsageError`, exit 2), so a bad value never reaches the
data. The CLI reads its option defaults from these classes, and the resolved settings are written into every
report header (`MetricSettings.to_dict`, flat) so a number can always be traced back to its choices.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pgdiag.errors import Code, UsageError

KEY_STYLES = ("pgdiag", "fast-llm", "verl", "trl", "liger", "miles", "pipelinerl")
METRIC_REDUCTIONS = ("token", "sample", "document")
LEVELS = ("token", "sequence")
EMPTY_SEQS = ("count", "skip")
METRIC_BREAKDOWNS = ("lag",)  # `metrics --by`: breakdowns beside step and all


def from_flat_options(cls: type, nested: dict[str, type], options: dict[str, Any], what: str) -> Any:
    """`cls` built from flat keyword options, the fields of each `nested` dataclass (field name -> its class)
    gathered into it; UsageError E112 naming every option that is no field of any of them."""
    parts = {name: {f.name for f in fields(part)} for name, part in nested.items()}
    own = {f.name for f in fields(cls)} - set(nested)
    unknown = set(options) - own - set().union(*parts.values())
    if unknown:
        raise UsageError(Code.BAD_OPTION_VALUE, f"unknown {what} option(s): {', '.join(sorted(unknown))}")
    built = {
        name: nested[name](**{k: v for k, v in options.items() if k in names})
        for name, names in parts.items()
    }
    return cls(**{k: v for k, v in options.items() if k in own}, **built)


@dataclass(frozen=True)
class ClipBand:
    """The PPO clip band [1 − eps_low, 1 + eps_high] and the dual-clip constant C (None = off)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"clip band needs 0 <= --eps-low < 1 and --eps-high >= 0, got {self.eps_low}, {self.eps_high}",
            )
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--dual-clip C must be > 1, got {self.dual_clip}")

    @property
    def low_edge(self) -> float:
        return 1.0 - self.eps_low

    @property
    def high_edge(self) -> float:
        return 1.0 + self.eps_high


@dataclass(frozen=True)
class StyleOptions:
    """Settings only a framework key style reads; None (or the default) = that framework's own default."""

    loss_name: str | None = None  # fast-llm key prefix (default "grpo")
    rollout_is: str | None = None  # verl rollout IS level ("token"); None = off
    rollout_is_threshold: float | None = None  # verl (2.0)
    beta: float | None = None  # trl (0.0) / liger (0.04)
    vllm_is: bool = True  # trl: vLLM IS correction when a rollout stream is present
    kl_bias_correction: bool = True  # trl: use_bias_correction_kl (KL term × ratio), TRL 1.16 default
    pad_width: int | None = None  # liger T' (default: longest response in the step)
    tis: bool = False  # miles --use-tis
    mismatch_metrics: bool = False  # miles --get-mismatch-metrics (the same TIS branch as --tis)
    batch_size: int | None = None  # pipelinerl (default: S)
    group_normalize: bool = False  # pipelinerl
    kl_coef: float | None = None  # pipelinerl (0.1)

    def __post_init__(self) -> None:
        """A coefficient, bound or threshold no framework would run with is E503 before any data is read: a
        negative KL coefficient or beta (a reward for moving away from the reference), a TIS threshold <= 0."""
        for name, flag, positive in (
            ("kl_coef", "--kl-coef", False),
            ("beta", "--beta", False),
            ("rollout_is_threshold", "--rollout-is-threshold", True),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                bound = "> 0" if positive else ">= 0"
                raise UsageError(Code.BAD_OPTION_VALUE, f"{flag} must be a number {bound}, got {value}")


@dataclass(frozen=True)
class MetricSettings:
    """Settings of one `compute_metrics` call (docs/metrics.md), validated when built."""

    # streams (None = resolved against the run by `metrics.api.resolve_streams`)
    new: str | None = None
    old: str | None = None
    stream_a: str | None = None  # mismatch pair sampling side (default rollout)
    stream_b: str | None = None  # mismatch pair evaluated side (default old, else new)
    ref: str | None = None
    entropy: str | None = None  # recompute tag whose entropy feeds entropy/*
    kept: str | None = (
        None  # kept-set recompute tag whose kept mass feeds mismatch/kept_mass_* (metrics.kept)
    )
    # loss and clipping
    aggregation: str | None = None  # headline loss/pg; a native mode or alias; None = the style's default
    divisor: float | None = None  # L of `constant`; loss_scale_factor / max_completion_length for aliases
    grad_divisor: float | None = None
    clip: ClipBand = field(default_factory=ClipBand)
    level: str = "token"
    empty_seqs: str = "count"
    # reductions and steps
    metric_reduction: str = "token"
    docs_per_step: int | None = None
    key_style: str = "pgdiag"
    zero_std_atol: float = 0.0
    identity: bool = False
    identity_tol: float = 0.0
    style: StyleOptions = field(default_factory=StyleOptions)
    by: tuple[str, ...] = ()  # breakdowns beside step and all (`METRIC_BREAKDOWNS`: lag)

    def __post_init__(self) -> None:
        """Reject values no computation can honour (UsageError E503, E506, E507; exit 2) before any data is read."""
        choices = {
            "key_style": KEY_STYLES,
            "metric_reduction": METRIC_REDUCTIONS,
            "level": LEVELS,
            "empty_seqs": EMPTY_SEQS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                flag = "--" + name.replace("_", "-")
                raise UsageError(
                    Code.BAD_OPTION_VALUE, f"{flag} {getattr(self, name)!r}: choose {'|'.join(allowed)}"
                )
        for name in ("divisor", "grad_divisor"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise UsageError(
                    Code.BAD_OPTION_VALUE,
                    f"--{name.replace('_', '-')} must be a positive number, got {value}",
                )
        for name in ("zero_std_atol", "identity_tol"):  # tolerances: 0 (exact) or more; NaN is no tolerance
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise UsageError(
                    Code.BAD_OPTION_VALUE, f"--{name.replace('_', '-')} must be a number >= 0, got {value}"
                )
        object.__setattr__(self, "by", tuple(self.by))
        unknown = [b for b in self.by if b not in METRIC_BREAKDOWNS]
        if unknown:
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"--by {unknown[0]!r}: choose {'|'.join(METRIC_BREAKDOWNS)}"
            )
        if self.docs_per_step is not None and self.docs_per_step < 1:
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"--docs-per-step must be at least 1, got {self.docs_per_step}"
            )
        if self.key_style != "pgdiag":
            from pgdiag.metrics.styles import check_style_settings

            check_style_settings(self)

    @classmethod
    def from_options(cls, **options: Any) -> MetricSettings:
        """Settings from flat keyword options (`eps_low=0.1`, `tis=True`, ...): the notebook form of the CLI flags."""
        return from_flat_options(cls, {"clip": ClipBand, "style": StyleOptions}, options, "metric")

    def to_dict(self) -> dict[str, Any]:
        """Every setting by its flat option name (the report header's `settings`)."""
        flat = {k: v for k, v in asdict(self).items() if k not in ("clip", "style")}
        return {**flat, **asdict(self.clip), **asdict(self.style)}
