"""One computed metric value with its unit, reduction and population size (docs/metrics.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricValue:
    """A metric key (``policy/kl_k3``, or a framework key under a key style) and its value.

    `value` is None when the metric is not computable (zero denominator, missing input); it is never NaN.
    `unit` is one of ``nats``, ``ratio``, ``fraction``, ``prob``, ``count``, ``loss``, ``1``.
    `reduction` is the resolved reduction code of docs/metrics.md (``token``, ``sample``, ``document``,
    ``tok``, ``seq``, ``grp``, ``step``, ``cnt``, ``mode``) or a style's own name.
    `n` is the number of tokens, samples or groups the value was computed over.
    """

    key: str
    value: float | None
    unit: str
    reduction: str
    n: int

    def __post_init__(self) -> None:
        if self.value is not None and math.isnan(self.value):
            object.__setattr__(self, "value", None)
