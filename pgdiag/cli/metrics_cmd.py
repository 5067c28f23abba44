"""`pgdiag metrics RUN`: the policy-gradient metric set and the pg loss under every aggregation mode.

Thin shell over `pgdiag.metrics.api.compute_metrics`: parse options -> compute -> gates -> render (rich table on
stderr, `--json` on stdout, `--out` report files). Example::

    pgdiag metrics sample_data/run_a --aggregation constant --divisor 40960 --fail-on 'policy/clip_frac_binding>0.2'
"""

from __future__ import annotations

from enum import StrEnum
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
    ExitZeroOpt,
    FailOnOpt,
    IgnoreOpt,
    JsonOpt,
    KeyStyle,
    LabelOpt,
    MaxExamplesOpt,
    OutOpt,
    OverwriteOpt,
    ProfileOpt,
    QuietOpt,
    RunArg,
    RunNameOpt,
    StepsOpt,
    StrictOpt,
    ToTensorboardOpt,
    ToWandbOpt,
    VerboseOpt,
    WandbDirOpt,
    WarnOnOpt,
    check_settings,
    execute,
    gate_settings,
    list_option,
    result_object,
    step_progress,
    wandb_directory,
)
from pgdiag.data.validate import CheckSettings
from pgdiag.metrics.settings import ClipBand, MetricSettings, StyleOptions

_DEFAULTS = MetricSettings()


class MetricReduction(StrEnum):
    token = "token"
    sample = "sample"
    document = "document"


class Level(StrEnum):
    token = "token"
    sequence = "sequence"


class EmptySeqs(StrEnum):
    count = "count"
    skip = "skip"


def _list_metrics(value: bool) -> None:
    """`--list-metrics`: print the catalogue of native metrics on stdout and exit."""
    if value:
        from pgdiag.cli.render import render_catalog

        render_catalog()
        raise typer.Exit()


def register(app: typer.Typer) -> None:
    """Add the `metrics` command to `app`."""
    app.command("metrics", rich_help_panel=None)(metrics)


def metrics(
    run: RunArg,
    *,
    steps: StepsOpt = None,
    run_name: RunNameOpt = None,
    label: LabelOpt = None,
    attach: AttachOpt = None,
    new: Annotated[
        str | None,
        typer.Option(
            help="Stream of the evaluated policy (default: new, else the single recompute tag).",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    old: Annotated[
        str | None,
        typer.Option(
            help="Stream of the behaviour policy (default: old, else rollout).", rich_help_panel=STREAMS
        ),
    ] = None,
    stream_a: Annotated[
        str | None,
        typer.Option(
            "--stream-a", help="Mismatch pair, sampling side (default: rollout).", rich_help_panel=STREAMS
        ),
    ] = None,
    stream_b: Annotated[
        str | None,
        typer.Option(
            "--stream-b",
            help="Mismatch pair, evaluated side (default: old, else new).",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    ref: Annotated[
        str | None,
        typer.Option(help="Reference-policy stream (default: ref when present).", rich_help_panel=STREAMS),
    ] = None,
    entropy: Annotated[
        str | None, typer.Option(help="Recompute tag whose entropy feeds entropy/*.", rich_help_panel=STREAMS)
    ] = None,
    aggregation: Annotated[
        str | None,
        typer.Option(
            help="Headline loss/pg mode: token_mean, sample_mean, prompt_mean, constant, seq_mean_token_sum, token_sum, gspo_seq_mean, gspo_length_prop, gspo_token_mean, or a framework alias (verl seq-mean-token-sum-norm, TRL dr_grpo, fast-llm:grpo, ...). All modes are always reported. Default: token_mean; under --key-style, the framework's own default.",
            rich_help_panel=METRICS,
        ),
    ] = _DEFAULTS.aggregation,
    divisor: Annotated[
        float | None,
        typer.Option(
            help="L of `constant` (loss = sum / (L * S)); required for it.", rich_help_panel=METRICS
        ),
    ] = None,
    grad_divisor: Annotated[
        float | None,
        typer.Option(
            "--grad-divisor",
            help="Extra gradient scale under a separate divisor G (grad/grad_divisor_*).",
            rich_help_panel=METRICS,
        ),
    ] = None,
    eps_low: Annotated[
        float,
        typer.Option("--eps-low", help="Clip band low side: ratio < 1 - eps-low.", rich_help_panel=METRICS),
    ] = _DEFAULTS.clip.eps_low,
    eps_high: Annotated[
        float,
        typer.Option(
            "--eps-high", help="Clip band high side: ratio > 1 + eps-high.", rich_help_panel=METRICS
        ),
    ] = _DEFAULTS.clip.eps_high,
    dual_clip: Annotated[
        float | None,
        typer.Option(
            "--dual-clip",
            help="Dual clip C > 1 for A < 0 (off by default; verl always uses 3).",
            rich_help_panel=METRICS,
        ),
    ] = None,
    level: Annotated[
        Level,
        typer.Option(help="Ratio level for key styles (token or sequence = GSPO).", rich_help_panel=METRICS),
    ] = Level(_DEFAULTS.level),
    empty_seqs: Annotated[
        EmptySeqs,
        typer.Option(
            "--empty-seqs",
            help="Whether fully masked samples count in S for the loss modes.",
            rich_help_panel=METRICS,
        ),
    ] = EmptySeqs(_DEFAULTS.empty_seqs),
    metric_reduction: Annotated[
        MetricReduction,
        typer.Option(
            "--metric-reduction",
            help="How per-token metrics are averaged: token (sum/N), sample (mean of sample means), document.",
            rich_help_panel=METRICS,
        ),
    ] = MetricReduction(_DEFAULTS.metric_reduction),
    docs_per_step: Annotated[
        int | None,
        typer.Option(
            "--docs-per-step",
            min=1,
            help="Ignore `step`; cut rows, in read order, into steps of N documents (Fast-LLM schedule).",
            rich_help_panel=METRICS,
        ),
    ] = None,
    key_style: Annotated[
        KeyStyle,
        typer.Option(
            "--key-style",
            help="Emit a framework's own keys with its exact definitions.",
            rich_help_panel=METRICS,
        ),
    ] = KeyStyle(_DEFAULTS.key_style),
    zero_std_atol: Annotated[
        float,
        typer.Option(
            "--zero-std-atol", help="Tolerance of the zero-std group test.", rich_help_panel=METRICS
        ),
    ] = _DEFAULTS.zero_std_atol,
    identity: Annotated[
        bool,
        typer.Option(
            "--identity",
            help="Step-0 identity check: fail unless policy/logratio_absmax <= --identity-tol.",
            rich_help_panel=THRESHOLDS,
        ),
    ] = False,
    identity_tol: Annotated[
        float,
        typer.Option(
            "--identity-tol",
            help="Tolerance of --identity in nats (0 = bit-identical).",
            rich_help_panel=THRESHOLDS,
        ),
    ] = _DEFAULTS.identity_tol,
    loss_name: Annotated[
        str | None, typer.Option("--loss-name", help="fast-llm: key prefix (grpo).", rich_help_panel=METRICS)
    ] = None,
    rollout_is: Annotated[
        str | None,
        typer.Option("--rollout-is", help="verl: rollout IS level (token).", rich_help_panel=METRICS),
    ] = None,
    rollout_is_threshold: Annotated[
        float | None,
        typer.Option(
            "--rollout-is-threshold", help="verl: rollout IS threshold (2.0).", rich_help_panel=METRICS
        ),
    ] = None,
    beta: Annotated[
        float | None, typer.Option(help="trl/liger: KL coefficient beta.", rich_help_panel=METRICS)
    ] = None,
    no_vllm_is: Annotated[
        bool,
        typer.Option("--no-vllm-is", help="trl: disable the vLLM IS correction.", rich_help_panel=METRICS),
    ] = False,
    no_kl_bias_correction: Annotated[
        bool,
        typer.Option(
            "--no-kl-bias-correction",
            help="trl: use_bias_correction_kl=False (KL term not multiplied by the ratio).",
            rich_help_panel=METRICS,
        ),
    ] = False,
    pad_width: Annotated[
        int | None, typer.Option("--pad-width", help="liger: padded width T'.", rich_help_panel=METRICS)
    ] = None,
    tis: Annotated[
        bool,
        typer.Option(
            "--tis",
            help="miles: --use-tis (TIS-weighted pg_loss, tis and ois keys).",
            rich_help_panel=METRICS,
        ),
    ] = False,
    mismatch_metrics: Annotated[
        bool,
        typer.Option(
            "--mismatch-metrics",
            help="miles: --get-mismatch-metrics (the same TIS branch: weighted pg_loss, tis and ois keys).",
            rich_help_panel=METRICS,
        ),
    ] = False,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help="pipelinerl: RLConfig.batch_size.", rich_help_panel=METRICS),
    ] = None,
    group_normalize: Annotated[
        bool,
        typer.Option("--group-normalize", help="pipelinerl: group_normalization.", rich_help_panel=METRICS),
    ] = False,
    kl_coef: Annotated[
        float | None, typer.Option("--kl-coef", help="pipelinerl: kl_coef (0.1).", rich_help_panel=METRICS)
    ] = None,
    ignore: IgnoreOpt = None,
    strict: StrictOpt = False,
    max_examples: MaxExamplesOpt = CheckSettings().max_examples,
    fail_on: FailOnOpt = None,
    warn_on: WarnOnOpt = None,
    profile: ProfileOpt = None,
    exit_zero: ExitZeroOpt = False,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    to_tensorboard: ToTensorboardOpt = None,
    to_wandb: ToWandbOpt = None,
    wandb_dir: WandbDirOpt = None,
    overwrite: OverwriteOpt = False,
    show_all: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Show every metric, one table per family (default: the main metrics).",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    all_steps: Annotated[
        bool,
        typer.Option(
            "--all-steps",
            help="Show every step, in further tables when they do not fit the terminal width.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write a one-file HTML report (verdict, tables, trend plots).",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    list_metrics: Annotated[
        bool,
        typer.Option(
            "--list-metrics",
            callback=_list_metrics,
            is_eager=True,
            help="Print every native metric (key, unit, reduction, meaning) and exit.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
) -> None:
    """Compute the policy-gradient metric set and the pg loss under every aggregation mode.

    Per optimizer step plus a pooled [bold]all[/] row, exactly as docs/metrics.md defines them: the policy family
    on (old, new), the mismatch family on (rollout, old) when both exist, advantage, entropy, group and count metrics,
    [bold]loss/<mode>[/] for every aggregation mode and [bold]grad/<mode>_*[/] gradient diagnostics. The input is
    validated first (exit 3 on invalid data). Example:

    [cyan]pgdiag metrics sample_data/run_a --aggregation constant --divisor 40960[/]

    The table shows the main metrics and the steps that fit the terminal (--all: every metric; --json, --out:
    every step); the last line lists the anomalies found, each with its step. --list-metrics explains every key.
    """

    def body(console: Console) -> dict[str, Any]:
        from pgdiag.cli.render import (
            render_checks,
            render_gates,
            render_metrics,
            render_verdict,
            render_written,
        )
        from pgdiag.data.runs import read_run
        from pgdiag.data.writing import check_destination
        from pgdiag.metrics.api import compute_metrics
        from pgdiag.report.gates import outcome
        from pgdiag.report.report import report_files
        from pgdiag.report.verdict import metrics_verdict

        if out is not None:  # refuse an existing or impossible output before any work
            planned = report_files(out, "metrics", worst=False)
            check_destination(planned.report.parent, [planned.report, planned.json], overwrite=overwrite)
        gates = gate_settings(fail_on, warn_on, profile, strict, exit_zero)
        settings = MetricSettings(
            new=new,
            old=old,
            stream_a=stream_a,
            stream_b=stream_b,
            ref=ref,
            entropy=entropy,
            aggregation=aggregation,
            divisor=divisor,
            grad_divisor=grad_divisor,
            clip=ClipBand(eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip),
            level=level.value,
            empty_seqs=empty_seqs.value,
            metric_reduction=metric_reduction.value,
            docs_per_step=docs_per_step,
            key_style=key_style.value,
            zero_std_atol=zero_std_atol,
            identity=identity,
            identity_tol=identity_tol,
            style=StyleOptions(
                loss_name=loss_name,
                rollout_is=rollout_is,
                rollout_is_threshold=rollout_is_threshold,
                beta=beta,
                vllm_is=not no_vllm_is,
                kl_bias_correction=not no_kl_bias_correction,
                pad_width=pad_width,
                tis=tis,
                mismatch_metrics=mismatch_metrics,
                batch_size=batch_size,
                group_normalize=group_normalize,
                kl_coef=kl_coef,
            ),
        )
        checks = check_settings(ignore, max_examples)
        if html is not None:
            from pgdiag.report.html import check_html_path

            check_html_path(html, overwrite=overwrite)
        source = read_run(run, label=label, attach=list_option(attach), steps=steps, run=run_name)
        with step_progress(console, "metrics") as progress:
            report = compute_metrics(source, settings, checks=checks, progress=progress)
        decision = outcome(report, gates)
        verdict = metrics_verdict(report)
        if not quiet:  # rich lays tables out even on a quiet console: skip the work
            render_checks(console, report.checks)
            render_metrics(
                console, report, show_all=show_all, all_steps=all_steps, verbose=verbose, verdict=verdict
            )
            render_gates(console, decision.gates)
        inputs = report.meta["inputs"]
        result = result_object(
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
        )
        json_view = report.to_json_dict()
        result["summary"] = json_view["summary"]
        result["per_step"] = json_view["breakdowns"].get("step", {})
        result["settings"] = report.meta["settings"]
        result["step_status"] = {str(s["step"]): s["status"] for s in report.meta["steps"]}
        result["verdict"] = verdict.as_dict()
        report = report.with_meta(verdict=verdict.as_dict())
        if html is not None:
            from pgdiag.report.html import verdict_arguments, write_html
            from pgdiag.report.plots import build_figures

            page_verdict = verdict_arguments(verdict)  # its findings also ring the trend plots
            page = write_html(
                report,
                html,
                overwrite=overwrite,
                plot_set=build_figures(report, marks=page_verdict["marks"]),
                argv=result["argv"],
                **page_verdict,
            )
            result["files"]["html"] = str(page)
        if to_tensorboard is not None:
            from pgdiag.report.export import export_tensorboard

            result["files"]["tensorboard"] = str(export_tensorboard(report, to_tensorboard))
        if to_wandb is not None:
            from pgdiag.report.export import export_wandb

            run_dir = export_wandb(report, to_wandb, wandb_directory(wandb_dir, out))
            result["files"]["wandb"] = str(run_dir)
        if out is not None:  # written last: its JSON lists every file
            result["files"] = (
                report.write(out, overwrite=overwrite, result=result).as_dict() | result["files"]
            )
        if not quiet:
            render_written(console, result["files"])
            render_verdict(console, verdict)
        return result

    execute("metrics", body, json_out=json_out, quiet=quiet)
