"""`pgdiag drift RUN`: every metric of `metrics` per step over a whole run, read in chunks of whole steps, and the
change points of the headline series.

Thin shell over `pgdiag.analysis.drift.drift` (docs/drift.md): parse -> per-step metrics -> change points ->
render (a table of change points and the verdict on stderr, `--json` on stdout, `--out` report files, `--plot`
the trend plot, `--html` the one-file page).
Example::

    pgdiag drift sample_data/long_run --key-style verl --out /tmp/drift --plot /tmp/drift.png
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pgdiag.cli.common import (
    METRICS,
    OUTPUT,
    STREAMS,
    THRESHOLDS,
    AttachOpt,
    IgnoreOpt,
    JsonOpt,
    KeyStyle,
    LabelOpt,
    MaxExamplesOpt,
    OutOpt,
    OverwriteOpt,
    QuietOpt,
    RunArg,
    RunNameOpt,
    StepsOpt,
    ToTensorboardOpt,
    ToWandbOpt,
    WandbDirOpt,
    check_report_outputs,
    execute,
    list_option,
    result_object,
    step_progress,
    wandb_directory,
    write_report_outputs,
)


def register(app: typer.Typer) -> None:
    """Add the `drift` command to `app`."""
    app.command("drift")(drift)


def drift(
    run: RunArg,
    *,
    new: Annotated[
        str | None, typer.Option("--new", help="New-policy stream (as metrics).", rich_help_panel=STREAMS)
    ] = None,
    old: Annotated[
        str | None, typer.Option("--old", help="Old-policy stream (as metrics).", rich_help_panel=STREAMS)
    ] = None,
    aggregation: Annotated[
        str, typer.Option("--aggregation", help="Headline loss mode (loss/pg).", rich_help_panel=METRICS)
    ] = "token_mean",
    divisor: Annotated[
        float | None, typer.Option("--divisor", help="L of the `constant` mode.", rich_help_panel=METRICS)
    ] = None,
    key_style: Annotated[
        KeyStyle,
        typer.Option(
            "--key-style", help="A framework's own keys (docs/key-styles.md).", rich_help_panel=METRICS
        ),
    ] = KeyStyle.pgdiag,
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            help="Search this series for change points (repeatable; default: headline).",
            rich_help_panel=THRESHOLDS,
        ),
    ] = None,
    cp_threshold: Annotated[
        float,
        typer.Option(
            "--cp-threshold", help="Smallest standardised jump that counts.", rich_help_panel=THRESHOLDS
        ),
    ] = 6.0,
    steps: StepsOpt = None,
    run_name: RunNameOpt = None,
    label: LabelOpt = None,
    attach: AttachOpt = None,
    ignore: IgnoreOpt = None,
    max_examples: MaxExamplesOpt = 5,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot", help="Write the trend plot with change points (.png/.svg/.pdf).", rich_help_panel=OUTPUT
        ),
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write a one-file HTML report (verdict, change points, per-step series, plots).",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    to_tensorboard: ToTensorboardOpt = None,
    to_wandb: ToWandbOpt = None,
    wandb_dir: WandbDirOpt = None,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Every metric of `metrics` per step over a whole run, and where the headline series jump.

    The run is read in chunks of whole steps (memory follows the largest step, not the run). Change points: binary segmentation on
    the standardised CUSUM of a mean shift (docs/drift.md), each with its step, metric and jump size; the last
    line is the verdict that lists them.
    """

    def body(console: Console) -> dict[str, Any]:
        from rich.table import Table

        check_report_outputs("drift", out, plot, overwrite=overwrite, html=html)
        from pgdiag.analysis.drift import drift as compute_drift
        from pgdiag.analysis.settings import ChangePointSettings
        from pgdiag.cli.render import format_value, render_checks, render_verdict
        from pgdiag.data.runs import read_run
        from pgdiag.data.validate import CheckSettings
        from pgdiag.metrics.settings import MetricSettings
        from pgdiag.report.verdict import drift_verdict

        settings = MetricSettings(
            new=new, old=old, aggregation=aggregation, divisor=divisor, key_style=key_style.value
        )
        change = ChangePointSettings(threshold=cp_threshold, metrics=tuple(list_option(metric)))
        checks = CheckSettings(ignore=tuple(list_option(ignore)), max_examples=max_examples)
        source = read_run(run, label=label, attach=list_option(attach), steps=steps, run=run_name)
        with step_progress(console, "drift") as progress:
            report = compute_drift(source, settings, change=change, checks=checks, progress=progress)
        verdict = drift_verdict(report)
        report = report.with_meta(verdict=verdict.as_dict())
        found = report.meta["change_points"]["found"]
        if not quiet:
            render_checks(console, report.checks)
            n_steps = len(report.meta["inputs"]["steps"])
            table = Table(
                title=f"drift {source.label}: {n_steps} steps, {len(found)} change points",
                title_justify="left",
            )
            for header in ("step", "metric", "before", "after", "jump", "z"):
                table.add_column(header, justify="left" if header == "metric" else "right")
            for cp in found:
                table.add_row(
                    str(cp["step"]), cp["metric"], format_value(cp["before"], ""), format_value(cp["after"], ""),
                    format_value(cp["jump"], ""), f"{cp['score']:.1f}",
                )  # fmt: skip
            console.print(table)
        result = result_object(
            "drift",
            inputs={"runs": [source.label], "steps": report.meta["inputs"]["steps"]},
            pairs=report.meta["pairs"],
            checks=report.checks.to_dicts(),
        )
        json_view = report.to_json_dict()
        result["per_step"] = json_view["breakdowns"].get("step", {})
        result["change_points"] = found
        result["settings"] = report.meta["settings"]
        result["verdict"] = verdict.as_dict()
        from pgdiag.report.plots import plot_drift

        write_report_outputs(
            console, report, result, out=out, plot=plot, draw=plot_drift, overwrite=overwrite, html=html,
            verdict=verdict,
        )  # fmt: skip
        if to_tensorboard is not None:
            from pgdiag.report.export import export_tensorboard

            events = export_tensorboard(report, to_tensorboard)
            result.setdefault("files", {})["tensorboard"] = str(events)
            console.print(f"tensorboard events written to {events}", markup=False)
        if to_wandb is not None:
            from pgdiag.report.export import export_wandb

            run_dir = export_wandb(report, to_wandb, wandb_directory(wandb_dir, out))
            result.setdefault("files", {})["wandb"] = str(run_dir)
            console.print(f"wandb run written to {run_dir}", markup=False)
        if not quiet:
            render_verdict(console, verdict)
        return result

    execute("drift", body, json_out=json_out, quiet=quiet)
