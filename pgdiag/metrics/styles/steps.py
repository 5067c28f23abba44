"""A framework key style over steps: `compute_step_style` (one step), `StyleStream` (a run read in chunks of whole
steps) and `compute_by_step` (a batch in memory), each with the native `count/*` keys and step status beside the
framework's own keys (docs/key-styles.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.metrics.engine import compute_step_native
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.step_metrics import StepMetrics, mark_partial
from pgdiag.metrics.step_split import StepCut, split_steps, step_index_of, straddling_groups
from pgdiag.metrics.styles import STYLES, check_style_settings
from pgdiag.metrics.styles.inputs import read_inputs
from pgdiag.metrics.styles.pooled import pool_style_steps, public_values, step_partials

__all__ = ["StyleStream", "compute_by_step", "compute_step_style"]


def compute_step_style(
    batch: TokenBatch, settings: MetricSettings, *, groups_split: int | None = None, partials: bool = False
) -> StepMetrics:
    """The `settings.key_style` framework's keys for the step `batch`, then the native `count/*` keys.

    `groups_split` is `count/groups_split` (prompt groups straddling a step boundary), known only to the
    caller that cut the steps; when it is None that key is left out rather than guessed. `partials` adds
    the few extra per-step values (reduction ``partial``) `pool_style_steps` needs to pool every key
    exactly; strip them with `public_values` before reporting a step.
    """
    check_style_settings(settings)
    _, compute = STYLES[settings.key_style]
    inputs = read_inputs(batch, settings)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # NaN/inf as the frameworks get them
        style = compute(inputs, settings)
        extra = step_partials(inputs, settings) if partials else ()
    notices = list(style.notices)
    if settings.metric_reduction != "token":
        notices.append(
            f"--metric-reduction {settings.metric_reduction} ignored: --key-style {settings.key_style} "
            "fixes every reduction"
        )
    native_settings = replace(
        settings, key_style="pgdiag", aggregation="token_mean", metric_reduction="token"
    )
    native = compute_step_native(batch, native_settings, groups_split=groups_split or 0)
    counts = tuple(
        v
        for v in native.values
        if v.key.startswith("count/") and (groups_split is not None or v.key != "count/groups_split")
    )
    return StepMetrics(style.values + counts + extra, native.status, tuple(notices))


class StyleStream:
    """A framework key style over a run read in chunks of whole steps: each step with the style's own
    function, the ``all`` row from the step rows alone (`styles.pooled.pool_style_steps`, docs/key-styles.md)."""

    quantiles_exact = True  # a style's all row holds no token quantile of pooled tokens

    def __init__(self, settings: MetricSettings) -> None:
        self.settings = settings
        self.steps: list[tuple[str, StepMetrics]] = []  # reported step rows
        self._with_partials: list[StepMetrics] = []  # the same with the values pooling needs

    def add(self, batch: TokenBatch, cut: StepCut | None = None) -> list[tuple[str, StepMetrics]]:
        """The per-step rows of one chunk (step order); `cut` when the caller cut the batch's steps over the
        whole run (`StepCut`: counts the straddling groups and marks the final partial step as
        `compute_by_step` does)."""
        if cut is None:
            rows = [
                (label, compute_step_style(step_batch, self.settings, groups_split=0, partials=True))
                for label, step_batch, _ in split_steps(batch, self.settings)
            ]
        else:
            rows = []
            bounds = (np.flatnonzero(np.diff(batch.step)) + 1).tolist()
            ranges = (
                list(zip([0, *bounds], [*bounds, batch.n_samples], strict=True)) if batch.n_samples else []
            )
            for position, (lo, hi) in enumerate(ranges):
                step_batch = batch.slice(lo, hi)
                n_split = int(np.count_nonzero(np.isin(np.unique(step_batch.group), cut.split_groups)))
                metrics = compute_step_style(step_batch, self.settings, groups_split=n_split, partials=True)
                label = str(int(batch.step[lo]))
                if cut.partial_last and position == len(ranges) - 1:
                    metrics = mark_partial(metrics, label)
                rows.append((label, metrics))
        self._with_partials.extend(m for _, m in rows)
        public = [(label, public_values(m)) for label, m in rows]
        self.steps.extend(public)
        return public

    def finish(self) -> tuple[str, StepMetrics]:
        """The ``all`` row pooled from the step rows (with their partials)."""
        return "all", pool_style_steps(self._with_partials, self.settings)


def compute_by_step(
    batch: TokenBatch,
    settings: MetricSettings,
    compute_step: Callable[[TokenBatch, MetricSettings, int], StepMetrics],
) -> list[tuple[str, StepMetrics]]:
    """Per-step rows plus the ``all`` row for a key style's per-step function.

    `compute_step(step_batch, settings, groups_split)` computes one step; the steps, their statuses and the
    groups straddling a `--docs-per-step` cut are the same as `compute_native`'s. The ``all`` row is pooled
    from the step rows alone (`pool_style_steps`, docs/key-styles.md); the steps' ``partial`` values are
    consumed there and left out of the step rows.
    """
    parts = split_steps(batch, settings)
    step_index = step_index_of(batch, settings)
    if settings.docs_per_step is None:
        split_groups = np.zeros(0, dtype=np.int64)  # groups are prompts within a step: none can straddle
    else:
        split_groups = straddling_groups(np.asarray(batch.group), step_index)
    rows: list[tuple[str, StepMetrics]] = []
    for label, step_batch, status in parts:
        n_split = int(np.count_nonzero(np.isin(np.unique(step_batch.group), split_groups)))
        metrics = compute_step(step_batch, settings, n_split)
        if status == "partial":
            metrics = mark_partial(metrics, label)
        rows.append((label, metrics))
    pooled_metrics = pool_style_steps([m for _, m in rows], settings)
    return [(label, public_values(m)) for label, m in rows] + [("all", pooled_metrics)]
