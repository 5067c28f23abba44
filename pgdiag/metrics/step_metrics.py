"""`StepMetrics`: the native metrics of one step (values, status, notices), and the rules that combine them.

What: the result type of every metric engine (native and key styles), the status order (`STATUS_ORDER`),
`mark_partial` for the final partial step of `--docs-per-step` and `average_loss_over_steps`, which gives the
``all`` row's `loss/*` and `grad/*` keys as the unweighted mean over the steps (docs/metrics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pgdiag.metrics.values import MetricValue

STATUS_ORDER = ("ok", "partial", "nonfinite", "empty")  # a later status wins when two apply


@dataclass(frozen=True)
class StepMetrics:
    """The native metrics of one step: values, a status and human-readable notices.

    status: ``ok``; ``partial`` (final partial step of `--docs-per-step`); ``nonfinite`` (masked-in tokens
    failed the finiteness test and were excluded); ``empty`` (no loss positions).
    """

    values: tuple[MetricValue, ...]
    status: str
    notices: tuple[str, ...]

    def by_key(self) -> dict[str, MetricValue]:
        """The values indexed by key."""
        return {v.key: v for v in self.values}


def average_loss_over_steps(pooled: StepMetrics, steps: list[StepMetrics]) -> StepMetrics:
    """Replace the ``mode``-reduced values of the pooled row (`loss/*`, `grad/*`, a style's loss keys) by their
    unweighted mean over the steps with a value."""
    per_step = [s.by_key() for s in steps]
    values = []
    for value in pooled.values:
        if value.reduction == "mode" or value.key.startswith(("loss/", "grad/")):
            found = [row[value.key].value for row in per_step if value.key in row]
            numbers = [v for v in found if v is not None]
            if not numbers:
                mean = None
            elif all(math.isfinite(v) for v in numbers):
                mean = math.fsum(numbers) / len(numbers)
            else:
                mean = sum(numbers) / len(numbers)  # ±inf propagates; inf − inf is NaN, stored as null
            value = MetricValue(value.key, mean, value.unit, value.reduction, len(numbers))
        values.append(value)
    return replace(pooled, values=tuple(values))


def mark_partial(metrics: StepMetrics, label: str) -> StepMetrics:
    """`metrics` of the final step of `--docs-per-step` when it holds fewer than N documents."""
    return replace(
        metrics,
        status=_worse(metrics.status, "partial"),
        notices=(*metrics.notices, f"step {label}: final partial step of --docs-per-step"),
    )


def _worse(a: str, b: str) -> str:
    """The more severe of two statuses."""
    return a if STATUS_ORDER.index(a) >= STATUS_ORDER.index(b) else b
