"""Which settings a framework key style accepts (docs/key-styles.md): its flags, its loss modes, and the modes
that need `--divisor`.

What: `StyleRules` declares a style's flags and loss-mode table once; `StyleRules.check` rejects a style-only
flag the framework does not have (`check_flags`), resolves `--aggregation` to the framework's own mode
(`resolve_alias`) and demands `--divisor` where that mode needs one, in that order (exit 2, `UsageError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pgdiag.errors import Code, UsageError

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
class StyleRules:
    """A style's flags and loss modes: `modes` maps every accepted `--aggregation` spelling to the framework's
    mode, `default` is the mode without one, and `divisor_needed` maps a mode that needs `--divisor` to the
    (message, hint) of the error when it is missing."""

    style: str
    flags: frozenset[str]
    modes: Mapping[str, str]
    default: str
    divisor_needed: Mapping[str, tuple[str, str | None]] = field(default_factory=dict)

    def mode(self, settings: MetricSettings) -> str:
        """The framework loss mode `settings.aggregation` names under this style."""
        return resolve_alias(self.style, settings.aggregation, self.modes, self.default)

    def check(self, settings: MetricSettings) -> str:
        """Reject flags the framework has no setting for, an unknown loss mode, and a mode missing its
        `--divisor`; returns the mode."""
        check_flags(self.style, settings, self.flags)
        mode = self.mode(settings)
        message, hint = self.divisor_needed.get(mode, ("", None))
        require_divisor(settings, mode in self.divisor_needed, message, hint)
        return mode


def require_at_least(flag: str, given: int | None, minimum: int) -> None:
    """`UsageError` BAD_OPTION_VALUE (exit 2) when `flag` is given below `minimum`."""
    if given is not None and given < minimum:
        raise UsageError(Code.BAD_OPTION_VALUE, f"{flag} must be >= {minimum} (got {given})")


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
