"""Framework key styles (`--key-style`, docs/key-styles.md): one framework's own keys for one step.

What: `compute_step_style(batch, settings)` returns the keys that Fast-LLM, verl, TRL, Liger, miles or
PipelineRL would log for this step, with their exact names, formulas, clamps, epsilons and reductions, for
one whole step = one micro-batch on one process. The native `count/*` keys and the step status come from
the native engine, so clamped or zeroed extremes stay visible next to the framework's numbers.

Why: parity checks compare a trainer's logged values with a recompute; the frameworks disagree on the
definitions behind similar names (band vs binding clip, KL direction, `max(N, 1)` vs `+ 1e-8`, per-sample vs
per-token advantages), so each style is reproduced separately rather than mapped from native keys.

How: `check_style_settings` (which `MetricSettings` runs when built) rejects any flag the framework has no setting for (`UsageError`, exit 2) and any
`--aggregation` it cannot name (each style's `flags.StyleRules`); each style module (`fast_llm`, `verl`, `trl`, `liger`, `miles`,
`pipelinerl`) computes from `inputs.StyleInputs`. `--metric-reduction` is ignored (the style fixes every
reduction) with a notice. `steps.compute_step_style` computes one step, `steps.StyleStream` a run read in
chunks; the run's `all` row is pooled from the step results (`pooled.pool_style_steps`). This package's own
module imports no engine, so `metrics.settings` can run the checks without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.styles.fast_llm import check_fast_llm_settings, compute_fast_llm
from pgdiag.metrics.styles.inputs import StyleInputs, StyleOutput
from pgdiag.metrics.styles.liger import check_liger_settings, compute_liger
from pgdiag.metrics.styles.miles import check_miles_settings, compute_miles
from pgdiag.metrics.styles.pipelinerl import check_pipelinerl_settings, compute_pipelinerl
from pgdiag.metrics.styles.trl import check_trl_settings, compute_trl
from pgdiag.metrics.styles.verl import check_verl_settings, compute_verl

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings

__all__ = ["STYLES", "STYLE_NAMES", "check_style_settings"]

_StyleCompute = Callable[[StyleInputs, "MetricSettings"], StyleOutput]
STYLES: dict[str, tuple[Callable[[MetricSettings], None], _StyleCompute]] = {
    "fast-llm": (check_fast_llm_settings, compute_fast_llm),
    "verl": (check_verl_settings, compute_verl),
    "trl": (check_trl_settings, compute_trl),
    "liger": (check_liger_settings, compute_liger),
    "miles": (check_miles_settings, compute_miles),
    "pipelinerl": (check_pipelinerl_settings, compute_pipelinerl),
}
STYLE_NAMES = tuple(STYLES)


def check_style_settings(settings: MetricSettings) -> None:
    """Raise `UsageError` for a style flag `settings.key_style`'s framework does not have (docs/key-styles.md)."""
    if settings.key_style not in STYLES:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"--key-style {settings.key_style!r} is not a framework style",
            f"choose {'|'.join(STYLE_NAMES)}; the native keys need no --key-style",
        )
    check, _ = STYLES[settings.key_style]
    check(settings)
