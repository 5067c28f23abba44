"""`pgdiag compare RUN_A [RUN_B]`: the parity of two runs (or two streams of one), with CI gates.

Thin shell over `pgdiag.compare.api.compare_runs` (docs/compare.md): parse options -> settings -> compare ->
gates -> render (the parity table and the verdict on stdout, check findings on stderr) and, with `--out`, the
report, the worst-K tables, the worst trace, the plots and a markdown summary. Without any gate the fail gates of
`--profile recommended` apply, so DISAGREE exits 1. Exit 0 pass (warnings allowed), 1 a fail gate (or a warning
under `--strict`; `--exit-zero` turns 1 into 0), 2 usage, 3 alignment or validation error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.compare_render import (
    render_breakdowns,
    render_parity,
    render_routing,
    render_worst_tokens,
)
from pgdiag.cli.options import (
    ALIGNMENT,
    INPUTS,
    METRICS,
    MODEL,
    OUTPUT,
    STREAMS,
    CheckOptions,
    Fields,
    GateOptions,
    LossesOpt,
    MetricOptions,
    RunArg,
    RunInputs,
    choice_enum,
    loss_folds,
    option,
)
from pgdiag.cli.outputs import OutputSettings, finish
from pgdiag.compare.settings import BREAKDOWNS, JOINS, CompareSettings
from pgdiag.errors import Code, UsageError

_DEFAULTS = CompareSettings()


Join = choice_enum("Join", JOINS)
Breakdown = choice_enum("Breakdown", BREAKDOWNS)


_JOIN = Join(_DEFAULTS.join)


HELP = """Compare two runs token by token: [bold]Δ = lp_b − lp_a[/] on aligned loss tokens.

Aligns samples (sample_id, else seq_hash), checks tokens, masks, shifts, zero fills and NaN (exit 3 on
failure, naming the first bad sample and position), then prints the parity table at token and sequence
scope with breakdowns and diagnoses on stdout. Gates: --fail-on 'k3>1e-3' --profile recommended; without any
gate the fail gates of --profile recommended apply, so DISAGREE exits 1 (--exit-zero: exit 0).
"""


@dataclass(frozen=True)
class CompareOptions:
    """The options of `CompareSettings` that only `compare` has."""

    label_a: Annotated[str | None, option("--label-a", "Label of run a in reports.", INPUTS)] = None
    label_b: Annotated[str | None, option("--label-b", "Label of run b in reports.", INPUTS)] = None
    stream_a: Annotated[
        str | None,
        option("--stream-a", "Side a stream (one run: rollout; two runs: new, old, tag, rollout).", STREAMS),
    ] = None
    stream_b: Annotated[
        str | None,
        option(
            "--stream-b",
            "Side b stream (one run: old, else new or the only tag; two runs: same as a).",
            STREAMS,
        ),
    ] = None
    join: Annotated[
        Join,
        option(
            "--join",
            (
                "auto: (step, sample_id), else (step, seq_hash) when fewer than half the ids match; "
                "hash-any-step: seq_hash in any step (read in pieces: docs/compare.md)."
            ),
            ALIGNMENT,
        ),
    ] = _JOIN
    by: Annotated[
        list[Breakdown] | None,
        option(
            "--by",
            (
                "Breakdown (repeatable; default: every one the data supports but lag, which reads "
                "policy_version: docs/compare.md)."
            ),
            METRICS,
        ),
    ] = None
    side_by_side: Annotated[
        bool,
        option("--metrics", "Add each run's own metric set and the deltas.", METRICS),
    ] = False
    model: Annotated[Path | None, option("--model", "Checkpoint for the exact tau fit.", MODEL)] = None
    tokenizer: Annotated[
        Path | None,
        option("--tokenizer", "tokenizer.json (or its directory) for worst-token text.", MODEL),
    ] = None
    worst_k: Annotated[
        int,
        option("--worst-k", "Worst tokens and sequences listed.", OUTPUT, min=0),
    ] = _DEFAULTS.worst_k
    tokens_out: Annotated[
        Path | None,
        option("--tokens-out", "Write the exploded token table here.", OUTPUT),
    ] = None
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Bitwise agreement: tokens with any nonzero Δ, the first one, a ULP histogram; fails on any.",
        ),
    ] = False
    losses: LossesOpt = None

    def settings(self, metric: MetricOptions, check: CheckOptions) -> CompareSettings:
        """The `CompareSettings`; `metric` gives the clip band and, with --metrics, each run's metric settings."""
        metrics = metric.settings()
        return CompareSettings(
            stream_a=self.stream_a,
            stream_b=self.stream_b,
            join=self.join.value,
            by=None if not self.by else tuple(b.value for b in self.by),
            worst_k=self.worst_k,
            clip=metrics.clip,
            label_a=self.label_a,
            label_b=self.label_b,
            metrics=metrics if self.side_by_side else None,
            checks=check.settings(),
            model=self.model,
            tokenizer=self.tokenizer,
            exact=self.exact,
        )


RunsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="The second run (omit to compare two streams of RUN_A), or several runs: N-way compare against "
        "the baseline (--baseline) on the samples every run holds, with a matrix of mismatch/abs_mean.",
        show_default=False,
    ),
]
BaselineOpt = Annotated[
    str | None,
    option(
        "--baseline",
        "N-way compare: the run every other run is compared with (its path or label; default the first).",
        INPUTS,
    ),
]
RoutingReplayOpt = Annotated[
    str | None,
    option(
        "--routing-replay",
        (
            "MoE, one run: the tag of a `logprobs --routing replay` recompute; with --stream-b the same "
            "run recomputed with --routing recompute, attributes the mismatch to routing per step "
            "(routing/mismatch_share, routing/disagree_frac)."
        ),
        STREAMS,
    ),
]
_METRIC_FIELDS = Fields("aggregation", "divisor", "key_style", "eps_low", "eps_high")
_OUTPUTS = Fields("json_out", "out", "html", "overwrite", "quiet", "verbose")


def compare(
    run_a: RunArg,
    run_b: RunsArg = None,
    *,
    baseline: BaselineOpt = None,
    routing_replay: RoutingReplayOpt = None,
    inputs: Annotated[RunInputs, Fields("steps", "run_name", "attach")],
    options: CompareOptions,
    metric: Annotated[MetricOptions, _METRIC_FIELDS],
    check: CheckOptions,
    gate: GateOptions,
    output: Annotated[OutputSettings, _OUTPUTS],
) -> None:
    """The `compare` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.compare.api import compare_runs
        from pgdiag.compare.worst import token_decoder
        from pgdiag.report.gates import outcome
        from pgdiag.report.verdict import compare_verdict

        others = _refuse_conflicts(run_b, baseline, routing_replay, options, output)
        decode = token_decoder(options.tokenizer) if options.tokenizer is not None else None
        settings = options.settings(metric, check)
        gates = gate.settings()
        sources = [inputs.read(run_a), *(inputs.read(r, first=False) for r in others)]
        if len(sources) > 2:
            return _compare_many(screen, sources, [run_a, *others], baseline, settings, gates, output)
        comparison = compare_runs(
            sources[0],
            sources[1] if others else None,
            settings,
            decode=decode,
            tokens_out=options.tokens_out,
            overwrite=output.overwrite,
            accumulators=loss_folds(sources[0], options.losses, metric.settings().divisor),
        )
        report = comparison.report
        decision = outcome(report, gates)
        verdict = compare_verdict(report, decision.gates)
        _render(screen, report, decision, decode, options.worst_k, output)
        result = _result(report, decision, verdict, two_runs=bool(others))
        if routing_replay is not None:
            result["routing"] = _routing(screen, sources[0], report, routing_replay, output.quiet)
        if comparison.tokens_file is not None:  # written piece by piece as the runs were read
            result["files"]["tokens"] = str(comparison.tokens_file)
        return finish(
            screen,
            report.with_meta(verdict=verdict.as_dict()),
            output,
            result,
            verdict,
            figures=lambda marks: _figures(comparison),
            write_report=lambda out, res: _write_report(comparison, out, res, decision, verdict, output),
        )

    execute("compare", body, json_out=output.json_out, quiet=output.quiet)


def _refuse_conflicts(
    run_b: list[str] | None,
    baseline: str | None,
    routing_replay: str | None,
    options: CompareOptions,
    output: OutputSettings,
) -> list[str]:
    """The runs after RUN_A, once the options that do not fit them are refused (and existing outputs: E502)."""
    from pgdiag.compare.output import planned_outputs
    from pgdiag.data.writing import check_destination

    if options.tokens_out is not None:
        check_destination(
            options.tokens_out.parent,
            [options.tokens_out],
            overwrite=output.overwrite,
            hint="--tokens-out takes a file name",
        )
    output.refuse_existing("compare", planned=planned_outputs)
    others = list(run_b or [])
    if routing_replay is not None and others:
        raise UsageError(Code.OPTIONS_CONFLICT, "--routing-replay compares streams of one run; give one RUN")
    if baseline is not None and len(others) < 2:
        raise UsageError(
            Code.OPTIONS_CONFLICT,
            "--baseline picks the reference of an N-way compare: give three RUNs or more",
        )
    lag = any(b.value == "lag" for b in options.by or [])
    if len(others) >= 2 and (
        options.tokens_out is not None or output.html is not None or options.exact or options.losses or lag
    ):
        raise UsageError(
            Code.OPTIONS_CONFLICT,
            "--tokens-out, --html, --exact, --losses and --by lag compare two runs; drop them for N-way (--out "
            "keeps the report)",
        )
    return others


def _render(
    screen: Screen, report: Any, decision: Any, decode: Any, worst_k: int, output: OutputSettings
) -> None:
    """The parity table, breakdowns (-v), worst tokens and gates on stdout; check findings on stderr."""
    from pgdiag.cli.render import render_checks, render_exact, render_gates, render_losses

    render_checks(screen.notes, report.checks)
    if output.quiet:  # rich lays tables out even on a quiet console: skip the work
        return
    render_parity(screen.results, report, verbose=output.verbose)
    if output.verbose:
        render_breakdowns(screen.results, report)
    limit = worst_k if output.verbose else min(worst_k, 5)
    render_worst_tokens(screen.results, report, limit=limit, decode=decode)
    if "exact" in report.meta:
        render_exact(screen.results, report.meta["exact"])
    render_losses(screen.results, report)
    render_gates(screen.results, decision.gates)


def _result(report: Any, decision: Any, verdict: Any, *, two_runs: bool) -> dict[str, Any]:
    labels, streams, inputs = report.meta["labels"], report.meta["streams"], report.meta["inputs"]
    return result_object(
        "compare",
        status=decision.status,
        exit_code=decision.exit_code,
        inputs={
            "runs": [labels["a"]] + ([labels["b"]] if two_runs else []),
            "streams": [streams["a"], streams["b"]],
            "steps": inputs["steps"],
            "n_samples": inputs["n_matched_samples"],
            "n_tokens": inputs["n_tokens"],
        },
        pairs=report.meta["pairs"],
        summary=report.to_json_dict()["summary"],
        gates=[g.__dict__ for g in decision.gates.gates],
        checks=report.checks.to_dicts(),
        verdict=verdict.as_dict(),
        **({"exact": report.meta["exact"]} if "exact" in report.meta else {}),
        **({"losses": losses} if (losses := report.to_json_dict()["breakdowns"].get("losses")) else {}),
    )


def _routing(screen: Screen, source: Any, report: Any, replay: str, quiet: bool) -> list[dict[str, Any]]:
    """`--routing-replay`: the share of the mismatch routing explains, per step."""
    from pgdiag.compare.routing import routing_attribution

    streams = report.meta["streams"]
    attribution = routing_attribution(source, stream_a=streams["a"], recompute=streams["b"], replay=replay)
    if not quiet:
        render_routing(screen.results, attribution, streams["b"], replay)
    return attribution.to_dicts()


def _figures(comparison: Any) -> Any:
    from pgdiag.report.plots import build_figures

    return build_figures(comparison.report, tokens=comparison.tokens, trace=comparison.trace())


def _write_report(
    comparison: Any, out: Path, result: dict[str, Any], decision: Any, verdict: Any, output: OutputSettings
) -> dict[str, Any]:
    from pgdiag.compare.output import write_outputs as write_comparison

    return write_comparison(
        comparison, out, result=result, gates=decision.gates, verdict=verdict, overwrite=output.overwrite
    )


def _compare_many(
    screen: Screen,
    sources: list[Any],
    paths: list[str],
    baseline: str | None,
    settings: Any,
    gates: Any,
    output: OutputSettings,
) -> dict[str, Any]:
    """`compare A B C ...`: every run against the baseline on the common samples, the matrix, gates per pair."""
    from rich.table import Table
    from rich.text import Text

    from pgdiag.cli.render import format_value, render_checks, render_gates
    from pgdiag.compare.nway import compare_many
    from pgdiag.report.gates import outcome
    from pgdiag.report.verdict import compare_verdict

    if any(x is not None for x in (settings.metrics, settings.model)) or settings.tokenizer is not None:
        raise UsageError(
            Code.OPTIONS_CONFLICT, "--metrics, --model and --tokenizer compare two runs; drop them for N-way"
        )
    index = 0
    if baseline is not None:
        names = [[str(p), Path(p).name, s.label] for p, s in zip(paths, sources, strict=True)]
        matches = [i for i, n in enumerate(names) if baseline in n]
        if len(matches) != 1:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--baseline {baseline!r} names {len(matches)} of the runs; give a path or label",
            )
        index = matches[0]
    nway = compare_many(sources, settings, baseline=index)
    report = nway.report
    decision = outcome(report, gates)
    verdict = compare_verdict(report, decision.gates)
    render_checks(screen.notes, report.checks)
    if not output.quiet:
        render_parity(screen.results, report)
        table = Table(title="mismatch/abs_mean (nats) between every pair", title_justify="left")
        for column in ("run a", "run b", "mean |Δ|"):
            table.add_column(column, justify="right" if column == "mean |Δ|" else "left")
        for row in nway.matrix.iter_rows(named=True):
            table.add_row(Text(row["run_a"]), Text(row["run_b"]), format_value(row["value"], "nats"))
        screen.results.print(table)
        render_gates(screen.results, decision.gates)
    result = result_object(
        "compare",
        status=decision.status,
        exit_code=decision.exit_code,
        inputs={"runs": report.meta["runs"], "baseline": report.meta["baseline"]},
        pairs=report.meta["pairs"],
        summary=report.to_json_dict()["summary"],
        gates=[g.__dict__ for g in decision.gates.gates],
        checks=report.checks.to_dicts(),
        verdict=verdict.as_dict(),
        matrix=nway.matrix.to_dicts(),
    )
    return finish(screen, report.with_meta(verdict=verdict.as_dict()), output, result, verdict)
