"""`--losses A,B` of `metrics` and `compare`: the gradient parity of two loss definitions folded over a run's pieces.

What: `LossParityFold` is the accumulator `metrics` and `compare` are given (`pgdiag.metrics.accumulators`):
`add(batch)` per piece of whole steps computes the `losses/step` rows of that piece with the one computation
`whatif --losses` uses (`analysis.losses.loss_parity_rows`, docs/whatif.md), `finish()` returns them with the
`losses` rows (the maximum over every step of the run). `loss_parity_fold(run, settings)` builds it for a run,
resolving the behaviour and proximal streams as `whatif` does.
Why: the two loss forms are replayed on the batch a stage already reads, without a second reading loop; the stages
below `analysis` (metrics, compare) cannot import the rules, so the command line hands them this fold.
"""

from __future__ import annotations

from dataclasses import dataclass

from pgdiag.analysis.losses import loss_parity_rows, worst_step_rows
from pgdiag.analysis.replay import replay_of, rule_effect
from pgdiag.analysis.settings import LossForm, WhatifSettings, parse_losses
from pgdiag.analysis.whatif import resolve_whatif_streams
from pgdiag.data.batch import TokenBatch
from pgdiag.data.runs import Run
from pgdiag.errors import Code, UsageError
from pgdiag.report.report import ReportRow


@dataclass(frozen=True)
class LossParitySettings:
    """`--losses A,B` (each `FORM@MODE`, docs/whatif.md) with the streams and the `constant` divisor it uses.

    `behavior` is the stream that sampled (μ), `target` the proximal one (None: ``old``, else the single recompute
    tag); a ``new`` stream, when the run has one, is θ for the proximal→θ forms."""

    losses: str
    behavior: str = "rollout"
    target: str | None = None
    divisor: float | None = None

    def __post_init__(self) -> None:
        parse_losses(self.losses)


class LossParityFold:
    """The `losses/step` rows of every piece, then the `losses` maxima (module docstring)."""

    def __init__(
        self,
        forms: tuple[LossForm, LossForm],
        behavior: str,
        target: str,
        new: str | None,
        divisor: float | None,
    ) -> None:
        self.forms, self.behavior, self.target, self.new, self.divisor = forms, behavior, target, new, divisor
        self.step_rows: list[ReportRow] = []
        self.failed = False  # a step's aggregation weights were not computable: no rows, as one read gives

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams (besides the stage's own) each piece must hold."""
        return (self.behavior, self.target) + ((self.new,) if self.new else ())

    def add(self, batch: TokenBatch) -> None:
        """The per-step parity of one piece of whole steps (nothing without advantages)."""
        if batch.advantages is None or batch.n_samples == 0:
            return
        replays = {False: replay_of(batch, self.behavior, self.target)}
        if self.new is not None:
            replays[True] = replay_of(batch, self.target, self.new)
        pair = f"{batch.label}:{self.behavior} vs {batch.label}:{self.target}"
        rows = loss_parity_rows(batch, self.forms, replays, rule_effect, self.divisor, pair)
        self.failed = self.failed or not rows
        self.step_rows += [r for r in rows if r.breakdown == "losses/step"]

    def finish(self) -> list[ReportRow]:
        """Every step's rows and the maxima over the steps (none when a step's weights were not computable)."""
        return [] if self.failed else self.step_rows + worst_step_rows(self.step_rows)


def loss_parity_fold(run: Run, settings: LossParitySettings) -> LossParityFold:
    """The fold of `settings` for `run`: streams resolved as `whatif` resolves them (E111 when missing), `new` the
    run's ``new`` stream when it is neither of them; E506 when the run has no advantages."""
    if (
        "advantages" not in run.lazy.collect_schema().names()
        and "advantage" not in run.lazy.collect_schema().names()
    ):
        raise UsageError(Code.MISSING_SETTING, f"{run.label}: --losses needs advantages (the run has none)")
    behavior, target = resolve_whatif_streams(
        run, WhatifSettings(behavior=settings.behavior, target=settings.target)
    )
    new = "new" if "new" in run.streams and "new" not in (behavior, target) else None
    return LossParityFold(parse_losses(settings.losses), behavior, target, new, settings.divisor)
