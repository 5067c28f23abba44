"""Settings of `whatif` as frozen dataclasses; the default grid lives only here (docs/whatif.md).

A `CorrectionRule` is one off-policy correction with its thresholds: token/sequence TIS (truncate the weight at
C), token/sequence MIS (mask outside [lo, hi]), geometric masking and IcePop. `WhatifSettings` holds the
streams, the rules (the default grid unless the user names rules) and the loss settings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.loss import GSPO_MODES, NATIVE_MODES

RULE_KINDS = ("token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mask", "icepop")
BOUNDED_KINDS = ("token_mis", "seq_mis", "geo_mask", "icepop")
DEFAULT_TOKEN_CAPS = (1.5, 2.0, 3.0, 5.0)
DEFAULT_SEQ_CAPS = (2.0, 5.0, 10.0)
DEFAULT_ICEPOP = (0.5, 5.0)
POSITION_EDGES = (0, 64, 256, 1024, 4096)
# the shipped defaults or documented settings of the landed corrections (docs/whatif.md, "Default grid")
DEFAULT_NAMED = (
    "opsm:0.1",  # Trinity-RFT#420 finds δ 0.05-0.2 reasonable
    "dppo_tv:0.2,0.2",  # prime-rl DefaultLossConfig dppo_mask_low/high
    "ipo:0.1",  # prime-rl IPOLossConfig ipo_threshold
    "dppo_kl:0.2,0.2",  # SkyRL DPPO delta_low/high
    "rollout_is:0.2,0.2",  # SkyRL eps_clip_low/high
    "seq_mask_tis:0.999,1.002",  # NeMo-RL's reference bounds (the MLPerf recipe)
    "seq_mean_is:2",
    "seq_logprob_error:2",  # NeMo-RL's setting on Nemotron-3-Nano
    "token_veto:0.0001",  # DR.Kernel MRS
    "m2po:0.04",  # the M2PO paper's τ (AReaL ships no default)
    "cispo:0.2,0.2",  # verl clip_ratio
    "sapo:1,1.05",  # AReaL sapo_tau_pos/neg
    "gmpo:0.2,0.2",  # verl clip_ratio
    "topr",  # ROLL topr_positive/negative_weight 1, 1
)


@dataclass(frozen=True)
class CorrectionRule:
    """One rule. The six classic kinds (RULE_KINDS): `hi` is the cap C (TIS) or the upper bound, `lo` the lower
    bound. Every other rule of `pgdiag.analysis.rules.NAMED_RULES` (and `verl_chain`) carries its arguments as
    written after `NAME:` in `args`, checked here."""

    kind: str
    hi: float | None = None
    lo: float | None = None
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from pgdiag.analysis.rules import NAMED_RULES, VERL_RS_OPTIONS, parse_rule_args

        if self.kind == "verl_chain":
            for part in self.args:
                name, _, text = part.partition(":")
                if name not in VERL_RS_OPTIONS:
                    raise UsageError(
                        Code.BAD_OPTION_VALUE, f"--rule {part}: only verl rejection options chain with '+'"
                    )
                parse_rule_args(name, tuple(text.split(",")) if text else ())
            return
        if self.kind in NAMED_RULES:
            parse_rule_args(self.kind, self.args)
            return
        if self.kind not in RULE_KINDS:
            known = ", ".join((*RULE_KINDS, *NAMED_RULES))
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"unknown correction rule {self.kind!r}", f"one of {known}"
            )
        bounded = self.kind in BOUNDED_KINDS
        if bounded != (self.lo is not None) or self.hi is None:
            need = "LO,HI" if bounded else "one cap C"
            raise UsageError(Code.BAD_OPTION_VALUE, f"--{self.kind.replace('_', '-')} takes {need}")
        if not (math.isfinite(self.hi) and self.hi > 0):
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--{self.kind.replace('_', '-')}: bound must be a positive number, got {self.hi}",
            )
        if self.lo is not None and not (math.isfinite(self.lo) and 0 < self.lo <= self.hi):
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--{self.kind.replace('_', '-')}: need 0 < LO <= HI, got {self.lo},{self.hi}",
            )

    @property
    def label(self) -> str:
        """`token_tis:2`, `icepop:0.5,5`, `opsm:0.1`, `token_k1:0.5,2+seq_max_k2:1`: the report bucket."""
        if self.kind == "verl_chain":
            return "+".join(self.args)
        if self.kind not in RULE_KINDS:
            return f"{self.kind}:{','.join(self.args)}" if self.args else self.kind
        if self.lo is None:
            return f"{self.kind}:{self.hi:g}"
        return f"{self.kind}:{self.lo:g},{self.hi:g}"

    @property
    def pair(self) -> str:
        """Which ratio the rule acts on: `behaviour→proximal` or `proximal→θ` (docs/whatif.md)."""
        from pgdiag.analysis.rules import BEHAVIOUR_PROXIMAL, NAMED_RULES

        return NAMED_RULES[self.kind][0] if self.kind in NAMED_RULES else BEHAVIOUR_PROXIMAL

    @property
    def sequence_level(self) -> bool:
        from pgdiag.analysis.rules import NAMED_RULES

        if self.kind in NAMED_RULES:
            return NAMED_RULES[self.kind][2]
        return self.kind in ("seq_tis", "seq_mis", "geo_mask")


def parse_rule(spec: str) -> CorrectionRule:
    """`--rule NAME:PARAMS` (e.g. `opsm:0.1`, `token_tis:2`, `icepop:0.5,5`, `token_k1:0.5,2+seq_max_k2:1`,
    `m2po:0.04,scope=mb:4`, `topr`) as a rule; E503 for an unknown name or malformed parameters."""
    text = spec.strip()
    if "+" in text:
        return CorrectionRule("verl_chain", args=tuple(p.strip() for p in text.split("+")))
    name, _, params = text.partition(":")
    args = tuple(p.strip() for p in params.split(",")) if params else ()
    if name == "m2po" and params:  # m2po:TAU,scope=mb:N keeps the colon of its scope
        head, _, scope = params.partition(",")
        args = (head.strip(), scope.strip()) if scope else (head.strip(),)
    if name in RULE_KINDS:
        try:
            numbers = [float(a) for a in args]
        except ValueError:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--rule {spec}: not a number") from None
        if name in BOUNDED_KINDS and len(numbers) == 2:
            return CorrectionRule(name, numbers[1], numbers[0])
        if name not in BOUNDED_KINDS and len(numbers) == 1:
            return CorrectionRule(name, numbers[0])
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"--rule {spec}: {name} takes {'LO,HI' if name in BOUNDED_KINDS else 'one cap C'}",
        )
    return CorrectionRule(name, args=args)


def default_grid() -> tuple[CorrectionRule, ...]:
    """Token TIS/MIS at C in 1.5/2/3/5 (MIS band [1/C, C]), sequence TIS/MIS at 2/5/10, IcePop [0.5, 5], and
    DEFAULT_NAMED: one common setting of each landed correction."""
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
    rules += [parse_rule(spec) for spec in DEFAULT_NAMED]
    return tuple(rules)


LOSS_MODES = tuple(m for m in NATIVE_MODES if m not in GSPO_MODES)
_SPEC = re.compile(r"\s*([^@]+)@(\w+)\s*(?:,|$)")


@dataclass(frozen=True)
class LossForm:
    """One loss definition: the per-token form (None: vanilla policy gradient) and the aggregation mode."""

    rule: CorrectionRule | None
    mode: str
    label: str


def parse_losses(text: str) -> tuple[LossForm, LossForm]:
    """`A,B` with A and B each `FORM@MODE` (E503 unless exactly two well-formed definitions)."""
    found = [(m.group(1).strip(), m.group(2)) for m in _SPEC.finditer(text)]
    if len(found) != 2 or sum(len(m.group(0)) for m in _SPEC.finditer(text)) != len(text):
        raise UsageError(
            Code.UNPARSABLE_OPTION, f"--losses {text!r}: give two definitions, FORM@MODE,FORM@MODE"
        )
    forms = []
    for form, mode in found:
        if mode not in LOSS_MODES:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--losses: unknown aggregation {mode!r}",
                f"one of {', '.join(LOSS_MODES)}",
            )
        rule = None if form == "vanilla" else parse_rule(form)
        forms.append(LossForm(rule, mode, f"{form}@{mode}"))
    return forms[0], forms[1]


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
    losses: str | None = None  # `FORM@MODE,FORM@MODE`: gradient parity of two loss definitions

    def __post_init__(self) -> None:
        if self.divisor is not None and not self.divisor > 0:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--divisor must be > 0, got {self.divisor}")
        if self.losses is not None:
            parse_losses(self.losses)

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
            raise UsageError(Code.BAD_OPTION_VALUE, f"--cp-threshold must be > 0, got {self.threshold}")
        if self.min_segment < 1:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--min-segment must be >= 1, got {self.min_segment}")
