"""`pgdiag drift RUN`: every metric of `metrics` per step over a whole run, read in chunks of whole steps, and the
change points of the headline series.

Thin shell over `pgdiag.analysis.drift.drift` (docs/drift.md): parse -> per-step metrics -> change points ->
render (a table of change points and the verdict on stderr, `--json` on stdout, `--out` report files, `--plot`
the trend plot, `--html` the one-file page).
Example::

    pgdiag drift sample_data/long_run --key-style verl --out /tmp/drift --plot /tmp/drift.png
"""

from __future__ import annotations

from typing import Annotated, Any

from pgdiag.analysis.settings import ChangePointSettings
from pgdiag.cli.common import Screen, execute, result_object, step_progress
from pgdiag.cli.options import (
    THRESHOLDS,
    CheckOptions,
    Fields,
    MetricOptions,
    RunArg,
    RunInputs,
    listed,
    option,
)
from pgdiag.cli.outputs import OutputSettings, finish

HELP = """Every metric of `metrics` per step over a whole run, and where the headline series jump.

The run is read in chunks of whole steps (memory follows the largest step, not the run). Change points: binary
segmentation on the standardised CUSUM of a mean shift (docs/drift.md), each with its step, metric and jump
size; the last line is the verdict that lists them.
"""

MetricOpt = Annotated[
    list[str] | None,
    option("--metric", "Search this series for change points (repeatable; default: headline).", THRESHOLDS),
]
CpThresholdOpt = Annotated[
    float,
    option("--cp-threshold", "Smallest standardised jump that counts.", THRESHOLDS),
]
_OUTPUTS = Fields(
    "json_out", "out", "plot", "html", "to_tensorboard", "to_wandb", "wandb_dir", "overwrite", "quiet"
)


def drift(
    run: RunArg,
    *,
    metric_options: Annotated[MetricOptions, Fields("new", "old", "aggregation", "divisor", "key_style")],
    metric: MetricOpt = None,
    cp_threshold: CpThresholdOpt = ChangePointSettings().threshold,
    inputs: RunInputs,
    check: CheckOptions,
    output: Annotated[OutputSettings, _OUTPUTS],
) -> None:
    """The `drift` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.analysis.drift import drift as compute_drift
        from pgdiag.cli.render import render_checks
        from pgdiag.report.plots import plot_drift
        from pgdiag.report.verdict import drift_verdict

        output.refuse_existing("drift")
        settings = metric_options.settings()
        change = ChangePointSettings(threshold=cp_threshold, metrics=listed(metric))
        source = inputs.read(run)
        with step_progress(screen.notes, "drift") as progress:
            report = compute_drift(
                source, settings, change=change, checks=check.settings(), progress=progress
            )
        verdict = drift_verdict(report)
        report = report.with_meta(verdict=verdict.as_dict())
        render_checks(screen.notes, report.checks)
        if not output.quiet:
            screen.results.print(_change_table(report, source.label))
        result = result_object(
            "drift",
            inputs={"runs": [source.label], "steps": report.meta["inputs"]["steps"]},
            pairs=report.meta["pairs"],
            checks=report.checks.to_dicts(),
            per_step=report.to_json_dict()["breakdowns"].get("step", {}),
            change_points=report.meta["change_points"]["found"],
            settings=report.meta["settings"],
            verdict=verdict.as_dict(),
        )
        result = finish(screen, report, output, result, verdict, draw=plot_drift)
        return result

    execute("drift", body, json_out=output.json_out, quiet=output.quiet)


def _change_table(report: Any, label: str) -> Any:
    """One row per change point: step, metric, the means before and after, the jump and its z score."""
    from rich.table import Table

    from pgdiag.cli.render import format_value

    found = report.meta["change_points"]["found"]
    n_steps = len(report.meta["inputs"]["steps"])
    table = Table(title=f"drift {label}: {n_steps} steps, {len(found)} change points", title_justify="left")
    for header in ("step", "metric", "before", "after", "jump", "z"):
        table.add_column(header, justify="left" if header == "metric" else "right")
    for cp in found:
        table.add_row(
            str(cp["step"]), cp["metric"], format_value(cp["before"], ""), format_value(cp["after"], ""),
            format_value(cp["jump"], ""), f"{cp['score']:.1f}",
        )  # fmt: skip
    return table
