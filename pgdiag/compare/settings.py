"""`CompareSettings`: every choice of one `compare_runs` call, as one frozen dataclass validated when built.

The defaults here are the only place they live; `pgdiag compare` reads its option defaults from this class.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pgdiag.data.validate import CheckSettings
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.settings import ClipBand, MetricSettings, from_flat_options

JOINS = ("auto", "id", "hash", "hash-any-step")
BREAKDOWNS = ("position", "prob_bucket", "entropy_bucket", "length", "step", "env", "lag")  # `lag` on request


DEFAULT_PROFILE = "recommended"  # its fail gates apply when `compare` is given no gate (docs/cli.md)


@dataclass(frozen=True)
class CompareSettings:
    """Settings of one comparison (docs/compare.md).

    `metrics` turns on each run's own metric set beside the parity table (None = off); those metrics use this
    comparison's clip band, so `clip` moves the parity table's ``frac_out_clip`` and the side-by-side
    ``policy/clip_frac_*`` together.
    """

    stream_a: str | None = None  # None: one run, rollout; two runs, new, old, the only tag, rollout
    stream_b: str | None = None  # None: one run, old (else new, the only tag); two runs, stream_a
    join: str = "auto"  # auto | id | hash | hash-any-step
    by: tuple[str, ...] | None = None  # breakdowns; None = every one the data supports
    worst_k: int = 20  # worst tokens and sequences listed
    clip: ClipBand = field(default_factory=ClipBand)
    label_a: str | None = None
    label_b: str | None = None
    metrics: MetricSettings | None = None  # side-by-side metric settings; None = no side-by-side metrics
    checks: CheckSettings = field(default_factory=CheckSettings)
    model: Path | None = None  # checkpoint for the exact temperature fit from logits
    tokenizer: Path | None = None  # tokenizer.json (or its folder) for the worst tokens' text
    chunk_rows: int = 16_384  # rows (both runs) read at a time: consecutive whole steps (docs/compare.md)
    exact: bool = False  # bitwise agreement: ULP histogram, first divergent token, the `exact` gate

    def __post_init__(self) -> None:
        if self.join not in JOINS:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--join {self.join!r}: choose {'|'.join(JOINS)}")
        if self.by is not None:
            object.__setattr__(self, "by", tuple(self.by))
            unknown = [b for b in self.by if b not in BREAKDOWNS]
            if unknown:
                raise UsageError(Code.BAD_OPTION_VALUE, f"--by {unknown[0]!r}: choose {'|'.join(BREAKDOWNS)}")
        if self.chunk_rows < 1:
            raise UsageError(Code.BAD_OPTION_VALUE, f"chunk_rows must be >= 1 (got {self.chunk_rows})")
        if self.worst_k < 0:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--worst-k must be >= 0 (got {self.worst_k})")
        if (
            self.exact and Code.NON_FINITE not in self.checks.ignore
        ):  # --exact compares NaN and inf, never refuses them
            object.__setattr__(
                self, "checks", replace(self.checks, ignore=(*self.checks.ignore, Code.NON_FINITE))
            )
        if self.metrics is not None and self.metrics.clip != self.clip:
            object.__setattr__(self, "metrics", replace(self.metrics, clip=self.clip))

    @classmethod
    def from_options(cls, **options: Any) -> CompareSettings:
        """Settings from flat keyword options (`eps_low=0.1`, `ignore=["E306"]`, `by=["step"]`, ...)."""
        return from_flat_options(cls, {"clip": ClipBand, "checks": CheckSettings}, options, "compare")
