"""Every setting of docs/metrics.md, after alias resolution, as one frozen dataclass.

The CLI builds it from options and `compute_metrics` from keyword arguments; the defaults here are the
only place the defaults live (the CLI imports them). The resolved settings are written into every report
header so a number can always be traced back to the choices that produced it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pgdiag.errors import UsageError

KEY_STYLES = ("pgdiag", "fast-llm", "verl", "trl", "liger", "miles", "pipelinerl")
METRIC_REDUCTIONS = ("token", "sample", "document")
LEVELS = ("token", "sequence")
EMPTY_SEQS = ("count", "skip")


@dataclass(frozen=True)
class MetricSettings:
    """Settings of one `compute_metrics` call (docs/metrics.md)."""

    # streams (None = not used / resolved by the reader)
    new: str | None = None
    old: str | None = None
    stream_a: str | None = None  # mismatch pair sampling side (default rollout)
    stream_b: str | None = None  # mismatch pair evaluated side (default old, else new)
    ref: str | None = None
    entropy: str | None = None  # recompute tag whose entropy feeds entropy/*
    # loss and clipping
    aggregation: str | None = None  # headline loss/pg; a native mode or alias; None = the style's default
    divisor: float | None = None  # L of `constant`; loss_scale_factor / max_completion_length for aliases
    grad_divisor: float | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    level: str = "token"
    empty_seqs: str = "count"
    # reductions and steps
    metric_reduction: str = "token"
    docs_per_step: int | None = None
    key_style: str = "pgdiag"
    zero_std_atol: float = 0.0
    identity: bool = False
    identity_tol: float = 0.0
    # style-only settings; None = the framework's default
    loss_name: str | None = None  # fast-llm key prefix (default "grpo")
    rollout_is: str | None = None  # verl rollout IS level ("token"); None = off
    rollout_is_threshold: float | None = None  # verl (2.0)
    beta: float | None = None  # trl (0.0) / liger (0.04)
    vllm_is: bool = True  # trl: vLLM IS correction when a rollout stream is present
    pad_width: int | None = None  # liger T' (default: longest response in the step)
    tis: bool = False  # miles --use-tis
    mismatch_metrics: bool = False  # miles --get-mismatch-metrics (same TIS branch as --tis)
    batch_size: int | None = None  # pipelinerl (default: S)
    group_normalize: bool = False  # pipelinerl
    kl_coef: float | None = None  # pipelinerl (0.1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        """Reject values no computation can honour (UsageError E503, exit 2); called before any data is read."""
        choices = {
            "key_style": KEY_STYLES,
            "metric_reduction": METRIC_REDUCTIONS,
            "level": LEVELS,
            "empty_seqs": EMPTY_SEQS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                flag = "--" + name.replace("_", "-")
                raise UsageError("E503", f"{flag} {getattr(self, name)!r}: choose {'|'.join(allowed)}")
        for name in ("divisor", "grad_divisor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UsageError("E503", f"--{name.replace('_', '-')} must be > 0 (got {value})")
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise UsageError(
                "E503",
                f"clip band needs 0 <= --eps-low < 1 and --eps-high >= 0, got {self.eps_low}, {self.eps_high}",
            )
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise UsageError("E503", f"--dual-clip C must be > 1, got {self.dual_clip}")
        if self.docs_per_step is not None and self.docs_per_step < 1:
            raise UsageError("E503", f"--docs-per-step must be at least 1, got {self.docs_per_step}")
