"""`pgdiag explain RUN --model CKPT`: why two streams disagree, attributed to causes (docs/explain.md).

Thin shell over `pgdiag.explain.api.explain_run` (and `explain.layers.compare_layers` for ``--layers``):
parse -> settings -> one library call -> render (the cause table and the verdict on stderr, `--json` on
stdout, `--out` report files, `--html` the one-file page).
Example::

    pgdiag explain runs/step_100 --model ckpt/ --tokens 200000 --out /tmp/explain --html /tmp/explain.html
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pgdiag.cli.common import (
    MODEL,
    PERFORMANCE,
    STREAMS,
    JsonOpt,
    OutOpt,
    OverwriteOpt,
    QuietOpt,
    RunArg,
    check_report_outputs,
    execute,
    result_object,
    write_report_outputs,
)


def register(app: typer.Typer) -> None:
    """Add the `explain` command to `app`."""
    app.command("explain")(explain)


def explain(
    run: RunArg,
    *,
    model: Annotated[Path, typer.Option("--model", help="HF checkpoint directory.", rich_help_panel=MODEL)],
    pair: Annotated[
        str, typer.Option("--pair", help="Streams A,B (A samples).", rich_help_panel=STREAMS)
    ] = "rollout,old",
    tokens: Annotated[
        int,
        typer.Option("--tokens", help="Loss-token budget, stratified by step.", rich_help_panel=PERFORMANCE),
    ] = 200_000,
    seed: Annotated[
        int, typer.Option("--seed", help="Which samples the budget takes.", rich_help_panel=PERFORMANCE)
    ] = 0,
    tp: Annotated[
        int, typer.Option("--tp", help="Tensor-parallel degree of the matrix.", rich_help_panel=PERFORMANCE)
    ] = 1,
    device: Annotated[
        str | None, typer.Option("--device", help="cuda or cpu.", rich_help_panel=PERFORMANCE)
    ] = None,
    layers: Annotated[
        tuple[str, str] | None,
        typer.Option(
            "--layers",
            help="Per-layer divergence of two configurations (e.g. ref bf16).",
            rich_help_panel=MODEL,
        ),
    ] = None,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    html: Annotated[Path | None, typer.Option("--html", help="Write a one-file HTML report.")] = None,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Attribute the mismatch of two streams to causes: logprobs_mode, temperature, sampling_truncation,
    tokenization, staleness, weights, routing, batch_variance, precision, unexplained.

    Runs a recompute matrix on a stratified token budget (the cost is printed first), removes the causes in a
    fixed order and prints each one's share; the last line names the top cause, its share and its fix.
    """

    def body(console: Console) -> dict[str, Any]:
        from pgdiag.cli.explain_render import render_explain, render_layers
        from pgdiag.cli.render import render_verdict
        from pgdiag.explain.settings import ExplainSettings

        check_report_outputs("explain", out, None, overwrite=overwrite, html=html)
        settings = ExplainSettings(
            pair=tuple(p.strip() for p in pair.split(",")), tokens=tokens, seed=seed, tp=tp, device=device
        )
        if layers is not None:
            from pgdiag.explain.layers import compare_layers
            from pgdiag.explain.report import layers_report, layers_verdict

            found = compare_layers(run, model, layers[0], layers[1], settings)
            verdict = layers_verdict(found)
            if not quiet:
                render_layers(console, found)
            outcome = result_object("explain", inputs={"runs": [str(run)]}, layers=found.to_json())
            outcome["verdict"] = verdict.as_dict()
            write_report_outputs(
                console, layers_report(found).with_meta(verdict=verdict.as_dict()), outcome, out=out, plot=None,
                draw=lambda r: None, overwrite=overwrite, html=html, verdict=verdict,
            )  # fmt: skip
            if not quiet:
                render_verdict(console, verdict)
            return outcome
        from pgdiag.explain.api import explain_run
        from pgdiag.explain.report import explain_report, explain_verdict

        work = None if out is None else (out if out.suffix != ".parquet" else out.parent)
        result = explain_run(
            run, model, settings, out=work, overwrite=overwrite, on_cost=lambda line: console.print(line, markup=False),
            progress=None if quiet else lambda line: console.print(line, markup=False, style="dim"),
        )  # fmt: skip
        report, verdict = explain_report(result), explain_verdict(result)
        if not quiet:
            render_explain(console, result)
        outcome = result_object(
            "explain",
            inputs={"runs": [str(run)], "streams": list(result.pair), "n_tokens": result.n_tokens},
            pairs=report.meta["pairs"],
            causes=[c.as_dict() for c in result.causes],
            top_cause=result.top_cause,
            explain=result.to_json(),
            verdict=verdict.as_dict(),
        )
        write_report_outputs(
            console, report.with_meta(verdict=verdict.as_dict()), outcome, out=out, plot=None,
            draw=lambda r: None, overwrite=overwrite, html=html, verdict=verdict,
        )  # fmt: skip
        if not quiet:
            render_verdict(console, verdict)
        return outcome

    execute("explain", body, json_out=json_out, quiet=quiet)
