"""Settings of `whatif` as frozen dataclasses; the default grid lives only here (docs/whatif.md).

A `CorrectionRule` is one off-policy correction with its thresholds: token/sequence TIS (truncate the weight at
C), token/sequence MIS (mask outside [lo, hi]), geometric masking and IcePop. `WhatifSettings` holds the
streams, the rules (the default grid unless the user names rules) and the loss settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pgdiag.errors import UsageError

RULE_KINDS = ("token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mask", "icepop")
BOUNDED_KINDS = ("token_mis", "seq_mis", "geo_mask", "icepop")
DEFAULT_TOKEN_CAPS = (1.5, 2.0, 3.0, 5.0)
DEFAULT_SEQ_CAPS = (2.0, 5.0, 10.0)
DEFAULT_ICEPOP = (0.5, 5.0)
POSITION_EDGES = (0, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class CorrectionRule:
    """One rule: `kind` in RULE_KINDS; `hi` is the cap C (TIS) or the upper bound; `lo` the lower bound."""

    kind: str
    hi: float
    lo: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise UsageError(
                "E503", f"unknown correction rule {self.kind!r}", f"one of {', '.join(RULE_KINDS)}"
            )
        bounded = self.kind in BOUNDED_KINDS
        if bounded != (self.lo is not None):
            need = "LO,HI" if bounded else "one cap C"
            raise UsageError("E503", f"--{self.kind.replace('_', '-')} takes {need}")
        if not (math.isfinite(self.hi) and self.hi > 0):
            raise UsageError(
                "E503", f"--{self.kind.replace('_', '-')}: bound must be a positive number, got {self.hi}"
            )
        if self.lo is not None and not (math.isfinite(self.lo) and 0 < self.lo <= self.hi):
            raise UsageError(
                "E503", f"--{self.kind.replace('_', '-')}: need 0 < LO <= HI, got {self.lo},{self.hi}"
            )

    @property
    def label(self) -> str:
        """`token_tis:2`, `icepop:0.5,5`: the report bucket of this rule."""
        if self.lo is None:
            return f"{self.kind}:{self.hi:g}"
        return f"{self.kind}:{self.lo:g},{self.hi:g}"

    @property
    def sequence_level(self) -> bool:
        return self.kind in ("seq_tis", "seq_mis", "geo_mask")


def default_grid() -> tuple[CorrectionRule, ...]:
    """Token TIS/MIS at C in 1.5/2/3/5 (MIS band [1/C, C]), sequence TIS/MIS at 2/5/10, IcePop [0.5, 5]."""
    rules: list[CorrectionRule] = []
    for cap in DEFAULT_TOKEN_CAPS:
        rules.append(CorrectionRule("token_tis", cap))
    for cap in DEFAULT_TOKEN_CAPS:
        rules.append(CorrectionRule("token_mis", cap, 1.0 / cap))
    for cap in DEFAULT_SEQ_CAPS:
        rules.append(CorrectionRule("seq_tis", cap))
    for cap in DEFAULT_SEQ_CAPS:
        rules.append(CorrectionRule("seq_mis", cap, 1.0 / cap))
    rules.append(CorrectionRule("icepop", DEFAULT_ICEPOP[1], DEFAULT_ICEPOP[0]))
    return tuple(rules)


@dataclass(frozen=True)
class WhatifSettings:
    """Streams, rules and loss settings of `whatif`.

    `behavior` is the stream that sampled (default ``rollout``), `target` the trainer's (None: ``old``, else the
    single recompute tag). `rules` empty = the default grid; otherwise exactly the rules given.
    `divisor` is the `constant` loss mode's L (None: that mode is not computable).
    """

    behavior: str = "rollout"
    target: str | None = None
    rules: tuple[CorrectionRule, ...] = ()
    divisor: float | None = None

    def __post_init__(self) -> None:
        if self.divisor is not None and not self.divisor > 0:
            raise UsageError("E503", f"--divisor must be > 0, got {self.divisor}")

    def grid(self) -> tuple[CorrectionRule, ...]:
        """The rules to replay: the user's, else the default grid."""
        return self.rules if self.rules else default_grid()


DRIFT_HEADLINE = (
    "policy/kl_k3",
    "policy/clip_frac_binding",
    "policy/ess_token",
    "mismatch/abs_mean",
    "mismatch/kl_k3",
    "mismatch/ess_token",
    "loss/pg",
)


@dataclass(frozen=True)
class ChangePointSettings:
    """Binary segmentation on the standardised CUSUM of a mean shift (docs/drift.md).

        `threshold`: the smallest standardised jump |μ_after − μ_before|·√(k(n−k)/n)/σ that counts, σ the robust
        noise scale of the series (MAD of first differences / (0.6745·√2)). `min_segment`: steps on each side;
    `min_steps`: shorter series are not searched.
        `metrics`: the series searched (default: the headline metrics the report has; with a key style, all).
    """

    threshold: float = 6.0
    min_segment: int = 2
    min_steps: int = 8  # fewer steps: no search (the noise scale cannot be estimated)
    metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise UsageError("E503", f"--cp-threshold must be > 0, got {self.threshold}")
        if self.min_segment < 1:
            raise UsageError("E503", f"--min-segment must be >= 1, got {self.min_segment}")
