"""`pgdiag metrics RUN`: the policy-gradient metric set and the pg loss under every aggregation mode.

Thin shell over `pgdiag.metrics.api.compute_metrics`: parse options -> settings -> compute -> gates -> render
(the table and the verdict on stdout, check findings on stderr, `--json` on stdout alone, the files of
`cli.outputs.write_outputs`). Example::

    pgdiag metrics sample_data/run_a --aggregation constant --divisor 40960 --fail-on 'policy/clip_frac_binding>0.2'
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from pgdiag.cli.common import Screen, execute, result_object, step_progress
from pgdiag.cli.options import (
    OUTPUT,
    CheckOptions,
    Fields,
    GateOptions,
    LossesOpt,
    MetricOptions,
    RunArg,
    RunInputs,
    loss_folds,
    option,
)
from pgdiag.cli.outputs import OutputSettings, finish

HELP = """Compute the policy-gradient metric set and the pg loss under every aggregation mode.

Per optimizer step plus a pooled [bold]all[/] row, exactly as docs/metrics.md defines them: the policy family
on (old, new), the mismatch family on (rollout, old) when both exist, advantage, entropy, group and count metrics,
[bold]loss/<mode>[/] for every aggregation mode and [bold]grad/<mode>_*[/] gradient diagnostics. The input is
validated first (exit 3 on invalid data). Example:

[cyan]pgdiag metrics sample_data/run_a --aggregation constant --divisor 40960[/]

The table shows the main metrics and the steps that fit the terminal (--all: every metric; --json, --out:
every step) on stdout; the last line lists the anomalies found, each with its step. --list-metrics explains
every key.
"""


def _list_metrics(value: bool) -> None:
    """`--list-metrics`: print the catalogue of native metrics on stdout and exit."""
    if value:
        from pgdiag.cli.render import render_catalog

        render_catalog()
        raise typer.Exit()


ShowAllOpt = Annotated[
    bool,
    option("--all", "Show every metric, one table per family (default: the main metrics).", OUTPUT),
]
AllStepsOpt = Annotated[
    bool,
    option(
        "--all-steps", "Show every step, in further tables when they do not fit the terminal width.", OUTPUT
    ),
]
ListMetricsOpt = Annotated[
    bool,
    option(
        "--list-metrics",
        "Print every native metric (key, unit, reduction, meaning) and exit.",
        OUTPUT,
        callback=_list_metrics,
        is_eager=True,
    ),
]
_OUTPUTS = Fields(
    "json_out", "out", "html", "to_tensorboard", "to_wandb", "wandb_dir", "overwrite", "quiet", "verbose"
)


def metrics(
    run: RunArg,
    *,
    inputs: RunInputs,
    metric: MetricOptions,
    check: CheckOptions,
    gate: GateOptions,
    output: Annotated[OutputSettings, _OUTPUTS],
    show_all: ShowAllOpt = False,
    all_steps: AllStepsOpt = False,
    list_metrics: ListMetricsOpt = False,
    losses: LossesOpt = None,
) -> None:
    """The `metrics` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.cli.render import render_checks, render_gates, render_lag, render_losses, render_metrics
        from pgdiag.metrics.api import compute_metrics
        from pgdiag.report.gates import outcome
        from pgdiag.report.verdict import metrics_verdict

        output.refuse_existing("metrics")
        settings, gates = metric.settings(), gate.settings()
        source = inputs.read(run)
        folds = loss_folds(source, losses, settings.divisor)
        with step_progress(screen.notes, "metrics") as progress:
            report = compute_metrics(
                source, settings, checks=check.settings(), progress=progress, accumulators=folds
            )
        decision = outcome(report, gates)
        verdict = metrics_verdict(report)
        report = report.with_meta(verdict=verdict.as_dict())
        render_checks(screen.notes, report.checks)
        if not output.quiet:  # rich lays tables out even on a quiet console: skip the work
            render_metrics(
                screen.results,
                report,
                show_all=show_all,
                all_steps=all_steps,
                verbose=output.verbose,
                verdict=verdict,
            )
            render_lag(screen.results, report)
            render_losses(screen.results, report)
            render_gates(screen.results, decision.gates)
        result = finish(screen, report, output, _result(report, decision, verdict), verdict)
        return result

    execute("metrics", body, json_out=output.json_out, quiet=output.quiet)


def _result(report: Any, decision: Any, verdict: Any) -> dict[str, Any]:
    """The `pgdiag.result/v1` object of a metrics report: every step, the settings, each step's status."""
    inputs = report.meta["inputs"]
    json_view = report.to_json_dict()
    return result_object(
        "metrics",
        status=decision.status,
        exit_code=decision.exit_code,
        inputs={
            "runs": inputs["runs"],
            "streams": inputs["streams"],
            "steps": [s["step"] for s in report.meta["steps"] if s["step"] != "all"],
            "n_samples": inputs["n_samples"],
            "n_tokens": inputs["n_tokens"],
        },
        pairs=report.meta["pairs"],
        gates=[g.__dict__ for g in decision.gates.gates],
        checks=report.checks.to_dicts(),
        summary=json_view["summary"],
        per_step=json_view["breakdowns"].get("step", {}),
        **{k: json_view["breakdowns"][k] for k in ("lag", "losses") if k in json_view["breakdowns"]},
        settings=report.meta["settings"],
        step_status={str(s["step"]): s["status"] for s in report.meta["steps"]},
        verdict=verdict.as_dict(),
    )
