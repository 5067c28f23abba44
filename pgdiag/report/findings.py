"""`Finding`: one anomaly or problem a verdict names (`report.verdict`, `report.whatif_findings`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One anomaly or problem: what, where (step, bucket or token) and by how much."""

    kind: str  # ess_low | ratio_max | kl_jump | clip_frac | empty_step | disagree | data_lost | change_point
    # | error | warning | signal_low | one_sign | length_collapse | chi2_negative | psis_unreliable
    metric: str | None
    step: str | None  # step id as in the report ("0", "1", ...), None when pooled or not step-bound
    value: float | None
    threshold: float | None
    message: str
