"""Framework key styles (`--key-style`, docs/key-styles.md): one framework's own keys for one step.

What: `compute_step_style(batch, settings)` returns the keys that Fast-LLM, verl, TRL, Liger, miles or
PipelineRL would log for this step, with their exact names, formulas, clamps, epsilons and reductions, for
one whole step = one micro-batch on one process. The native `count/*` keys and the step status come from
the native engine, so clamped or zeroed extremes stay visible next to the framework's numbers.

Why: parity checks compare a trainer's logged values with a recompute; the frameworks disagree on the
definitions behind similar names (band vs binding clip, KL direction, `max(N, 1)` vs `+ 1e-8`, per-sample vs
per-token advantages), so each style is reproduced separately rather than mapped from native keys.

How: `check_style_settings` rejects any flag the framework has no setting for (`UsageError`, exit 2) and any
`--aggregation` it cannot name; each style module (`fast_llm`, `verl`, `trl`, `liger`, `miles`,
`pipelinerl`) computes from `common.StyleInputs`. `--metric-reduction` is ignored (the style fixes every
reduction) with a notice. The run's `all` row is pooled from the step results (`pooled.pool_style_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.errors import UsageError
from pgdiag.metrics.engine import StepMetrics, compute_step_native
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles.common import StyleInputs, StyleOutput, read_inputs
from pgdiag.metrics.styles.fast_llm import check_fast_llm_settings, compute_fast_llm
from pgdiag.metrics.styles.liger import check_liger_settings, compute_liger
from pgdiag.metrics.styles.miles import check_miles_settings, compute_miles
from pgdiag.metrics.styles.pipelinerl import check_pipelinerl_settings, compute_pipelinerl
from pgdiag.metrics.styles.pooled import pool_style_steps, public_values, step_partials
from pgdiag.metrics.styles.trl import check_trl_settings, compute_trl
from pgdiag.metrics.styles.verl import check_verl_settings, compute_verl

__all__ = ["STYLE_NAMES", "check_style_settings", "compute_step_style", "pool_style_steps", "public_values"]

_StyleCompute = Callable[[StyleInputs, MetricSettings], StyleOutput]
_STYLES: dict[str, tuple[Callable[[MetricSettings], None], _StyleCompute]] = {
    "fast-llm": (check_fast_llm_settings, compute_fast_llm),
    "verl": (check_verl_settings, compute_verl),
    "trl": (check_trl_settings, compute_trl),
    "liger": (check_liger_settings, compute_liger),
    "miles": (check_miles_settings, compute_miles),
    "pipelinerl": (check_pipelinerl_settings, compute_pipelinerl),
}
STYLE_NAMES = tuple(_STYLES)


def check_style_settings(settings: MetricSettings) -> None:
    """Raise `UsageError` for a style flag `settings.key_style`'s framework does not have (docs/key-styles.md)."""
    if settings.key_style not in _STYLES:
        raise UsageError(
            "E503",
            f"--key-style {settings.key_style!r} is not a framework style",
            f"choose {'|'.join(STYLE_NAMES)}; the native keys need no --key-style",
        )
    check, _ = _STYLES[settings.key_style]
    check(settings)


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
    _, compute = _STYLES[settings.key_style]
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
