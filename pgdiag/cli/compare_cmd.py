"""`pgdiag compare RUN_A [RUN_B]`: the parity of two runs (or two streams of one), with CI gates.

Thin shell over `pgdiag.compare.api.compare_runs` (docs/compare.md): parse options, compare,
render the parity table on stderr, evaluate `--fail-on`/`--warn-on`/`--profile` (default family `mismatch`),
and with `--out` write the report, the worst-K tables, the worst trace, the plots and a markdown summary.
Exit 0 pass (warnings allowed), 1 a fail gate (or a warning under `--strict`; `--exit-zero` turns 1 into 0),
2 usage, 3 alignment or validation error.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pgdiag.cli.common import (
    ALIGNMENT,
    INPUTS,
    METRICS,
    MODEL,
    OUTPUT,
    STREAMS,
    AttachOpt,
    ExitZeroOpt,
    FailOnOpt,
    IgnoreOpt,
    JsonOpt,
    KeyStyle,
    MaxExamplesOpt,
    OutOpt,
    OverwriteOpt,
    ProfileOpt,
    QuietOpt,
    RunArg,
    RunNameOpt,
    StepsOpt,
    StrictOpt,
    VerboseOpt,
    WarnOnOpt,
    check_settings,
    execute,
    gate_settings,
    list_option,
    result_object,
)
from pgdiag.compare.settings import CompareSettings
from pgdiag.errors import UsageError
from pgdiag.metrics.settings import ClipBand, MetricSettings

_DEFAULTS = CompareSettings()
_METRIC_DEFAULTS = MetricSettings()


class Join(StrEnum):
    auto = "auto"
    id = "id"
    hash = "hash"
    hash_any_step = "hash-any-step"


class Breakdown(StrEnum):
    position = "position"
    prob_bucket = "prob_bucket"
    entropy_bucket = "entropy_bucket"
    length = "length"
    step = "step"
    env = "env"


TABLE_STATS = (
    "bias",
    "sd",
    "rms",
    "abs_mean",
    "abs_p50",
    "abs_p95",
    "abs_p99",
    "abs_max",
    "pearson_r",
    "fit_slope",
    "fit_intercept",
    "frac_out_strict",
    "frac_out_1pct",
    "frac_out_10pct",
    "frac_out_clip",
    "frac_out_2x",
    "kl_k1",
    "kl_k3",
    "kl_rev_k1",
    "kl_rev_k3",
    "tmpe",
    "chi2_token",
    "chi2_seq",
    "ess_token",
    "ess_seq",
    "abs_dprob_mean",
    "first_token_ratio",
    "tau_hint",
)


def register(app: typer.Typer) -> None:
    """Add the `compare` command to `app`."""
    app.command("compare")(compare)


def compare(
    run_a: RunArg,
    run_b: Annotated[
        list[str] | None,
        typer.Argument(
            help="The second run (omit to compare two streams of RUN_A), or several runs: N-way compare against "
            "the baseline (--baseline) on the samples every run holds, with a matrix of mismatch/abs_mean.",
            show_default=False,
        ),
    ] = None,
    *,
    steps: StepsOpt = None,
    run_name: RunNameOpt = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            help="N-way compare: the run every other run is compared with (its path or label; default the first).",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    label_a: Annotated[
        str | None, typer.Option("--label-a", help="Label of run a in reports.", rich_help_panel=INPUTS)
    ] = None,
    label_b: Annotated[
        str | None, typer.Option("--label-b", help="Label of run b in reports.", rich_help_panel=INPUTS)
    ] = None,
    attach: AttachOpt = None,
    stream_a: Annotated[
        str | None,
        typer.Option(
            "--stream-a",
            help="Side a stream (one run: rollout; two runs: new, old, tag, rollout).",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    stream_b: Annotated[
        str | None,
        typer.Option(
            "--stream-b",
            help="Side b stream (one run: old, else new or the only tag; two runs: same as a).",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    routing_replay: Annotated[
        str | None,
        typer.Option(
            "--routing-replay",
            help="MoE, one run: the tag of a `logprobs --routing replay` recompute; with --stream-b the same "
            "run recomputed with --routing recompute, attributes the mismatch to routing per step "
            "(routing/mismatch_share, routing/disagree_frac).",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    join: Annotated[
        Join,
        typer.Option(
            "--join",
            help="auto: (step, sample_id), else (step, seq_hash) when fewer than half the ids match; "
            "hash-any-step: seq_hash in any step (read in pieces: docs/compare.md).",
            rich_help_panel=ALIGNMENT,
        ),
    ] = Join(_DEFAULTS.join),
    ignore: IgnoreOpt = None,
    strict: StrictOpt = False,
    max_examples: MaxExamplesOpt = _DEFAULTS.checks.max_examples,
    eps_low: Annotated[
        float,
        typer.Option(
            "--eps-low",
            help="Clip band low side: mismatch/frac_out_clip and, with --metrics, policy/clip_frac_*.",
            rich_help_panel=METRICS,
        ),
    ] = _DEFAULTS.clip.eps_low,
    eps_high: Annotated[
        float, typer.Option("--eps-high", help="Clip band high side.", rich_help_panel=METRICS)
    ] = _DEFAULTS.clip.eps_high,
    by: Annotated[
        list[Breakdown] | None,
        typer.Option(
            "--by",
            help="Breakdown (repeatable; default: every one the data supports).",
            rich_help_panel=METRICS,
        ),
    ] = None,
    side_by_side: Annotated[
        bool,
        typer.Option(
            "--metrics", help="Add each run's own metric set and the deltas.", rich_help_panel=METRICS
        ),
    ] = False,
    aggregation: Annotated[
        str | None,
        typer.Option("--aggregation", help="With --metrics: headline loss mode.", rich_help_panel=METRICS),
    ] = None,
    divisor: Annotated[
        float | None,
        typer.Option("--divisor", help="With --metrics: L of `constant`.", rich_help_panel=METRICS),
    ] = None,
    key_style: Annotated[
        KeyStyle,
        typer.Option(
            "--key-style",
            help="With --metrics: a framework's own keys (docs/key-styles.md).",
            rich_help_panel=METRICS,
        ),
    ] = KeyStyle(_METRIC_DEFAULTS.key_style),
    model: Annotated[
        Path | None, typer.Option("--model", help="Checkpoint for the exact tau fit.", rich_help_panel=MODEL)
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer",
            help="tokenizer.json (or its directory) for worst-token text.",
            rich_help_panel=MODEL,
        ),
    ] = None,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Bitwise agreement: tokens with any nonzero Δ, the first one, a ULP histogram; fails on any.",
        ),
    ] = False,
    fail_on: FailOnOpt = None,
    warn_on: WarnOnOpt = None,
    profile: ProfileOpt = None,
    exit_zero: ExitZeroOpt = False,
    json_out: JsonOpt = False,
    out: OutOpt = None,
    overwrite: OverwriteOpt = False,
    worst_k: Annotated[
        int,
        typer.Option("--worst-k", min=0, help="Worst tokens and sequences listed.", rich_help_panel=OUTPUT),
    ] = _DEFAULTS.worst_k,
    tokens_out: Annotated[
        Path | None,
        typer.Option("--tokens-out", help="Write the exploded token table here.", rich_help_panel=OUTPUT),
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html", help="Write a one-file HTML report (verdict, tables, plots).", rich_help_panel=OUTPUT
        ),
    ] = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Compare two runs token by token: [bold]Δ = lp_b − lp_a[/] on aligned loss tokens.

    Aligns samples (sample_id, else seq_hash), checks tokens, masks, shifts, zero fills and NaN (exit 3 on
    failure, naming the first bad sample and position), then prints the parity table at token and sequence
    scope with breakdowns and diagnoses. Gates: --fail-on 'k3>1e-3' --profile recommended.
    """

    def body(console: Console) -> dict[str, Any]:
        from pgdiag.cli.render import (
            render_checks,
            render_exact,
            render_gates,
            render_verdict,
            render_written,
        )
        from pgdiag.compare.api import compare_runs
        from pgdiag.compare.output import planned_outputs
        from pgdiag.compare.worst import token_decoder
        from pgdiag.data.runs import read_run
        from pgdiag.data.writing import check_destination
        from pgdiag.report.gates import outcome
        from pgdiag.report.verdict import compare_verdict

        # refuse an existing or impossible output, or a bad tokenizer, before any work
        if tokens_out is not None:
            check_destination(
                tokens_out.parent, [tokens_out], overwrite=overwrite, hint="--tokens-out takes a file name"
            )
        if out is not None:
            directory, planned = planned_outputs(out)
            check_destination(directory, planned, overwrite=overwrite)
        decode = token_decoder(tokenizer) if tokenizer is not None else None
        gates = gate_settings(fail_on, warn_on, profile, strict, exit_zero)
        clip = ClipBand(eps_low=eps_low, eps_high=eps_high)
        side_metrics = None
        if side_by_side:
            side_metrics = MetricSettings(
                aggregation=aggregation,
                divisor=divisor,
                key_style=key_style.value,
                clip=clip,
            )
        settings = CompareSettings(
            stream_a=stream_a,
            stream_b=stream_b,
            join=join.value,
            by=None if not by else tuple(b.value for b in by),
            worst_k=worst_k,
            clip=clip,
            label_a=label_a,
            label_b=label_b,
            metrics=side_metrics,
            checks=check_settings(ignore, max_examples),
            model=model,
            tokenizer=tokenizer,
            exact=exact,
        )
        if html is not None:
            from pgdiag.report.html import check_html_path

            check_html_path(html, overwrite=overwrite)
        others = list(run_b or [])
        if routing_replay is not None and others:
            raise UsageError("E112", "--routing-replay compares streams of one run; give one RUN")
        if baseline is not None and len(others) < 2:
            raise UsageError(
                "E503", "--baseline picks the reference of an N-way compare: give three RUNs or more"
            )
        if len(others) >= 2 and (tokens_out is not None or html is not None or exact):
            raise UsageError(
                "E503",
                "--tokens-out, --html and --exact compare two runs; drop them for N-way (--out keeps the report)",
            )
        source_a = read_run(run_a, attach=list_option(attach), steps=steps, run=run_name)
        if len(others) >= 2:
            sources = [source_a, *(read_run(r, steps=steps, run=run_name) for r in others)]
            return _compare_many(
                console, sources, [run_a, *others], baseline, settings, gates, out, overwrite, quiet
            )
        source_b = None if not others else read_run(others[0], steps=steps, run=run_name)
        comparison = compare_runs(
            source_a, source_b, settings, decode=decode, tokens_out=tokens_out, overwrite=overwrite
        )
        report = comparison.report
        decision = outcome(report, gates)
        verdict = compare_verdict(report, decision.gates)
        if not quiet:  # rich lays tables out even on a quiet console: skip the work
            render_parity(console, report, verbose=verbose)
            if verbose:
                render_breakdowns(console, report)
            render_worst_tokens(console, report, limit=worst_k if verbose else min(worst_k, 5), decode=decode)
            if exact:
                render_exact(console, report.meta["exact"])
            render_checks(console, report.checks)
            render_gates(console, decision.gates)
        labels, streams, inputs = report.meta["labels"], report.meta["streams"], report.meta["inputs"]
        result = result_object(
            "compare",
            status=decision.status,
            exit_code=decision.exit_code,
            inputs={
                "runs": [labels["a"]] + ([labels["b"]] if others else []),
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
        )
        if exact:
            result["exact"] = report.meta["exact"]
        if routing_replay is not None:
            from pgdiag.compare.routing import routing_attribution

            attribution = routing_attribution(
                source_a, stream_a=streams["a"], recompute=streams["b"], replay=routing_replay
            )
            result["routing"] = attribution.to_dicts()
            if not quiet:
                _render_routing(console, attribution, streams["b"], routing_replay)
        if comparison.tokens_file is not None:  # written piece by piece as the runs were read
            result["files"]["tokens"] = str(comparison.tokens_file)
        if html is not None:
            from pgdiag.report.html import verdict_arguments, write_html
            from pgdiag.report.plots import build_figures

            page = write_html(
                report.with_meta(verdict=verdict.as_dict()),
                html,
                overwrite=overwrite,
                plot_set=build_figures(report, tokens=comparison.tokens, trace=comparison.trace()),
                argv=result["argv"],
                **verdict_arguments(verdict),
            )
            result["files"]["html"] = str(page)
        if out is not None:  # written last: its JSON lists every file
            from pgdiag.compare.output import write_outputs

            result["files"] = write_outputs(
                comparison, out, result=result, gates=decision.gates, verdict=verdict, overwrite=overwrite
            )
        if not quiet:
            render_written(console, result["files"])
            render_verdict(console, verdict)
        return result

    execute("compare", body, json_out=json_out, quiet=quiet)


def _compare_many(
    console: Console,
    sources: list[Any],
    paths: list[str],
    baseline: str | None,
    settings: Any,
    gates: Any,
    out: Path | None,
    overwrite: bool,
    quiet: bool,
) -> dict[str, Any]:
    """`compare A B C ...`: every run against the baseline on the common samples, the matrix, gates per pair."""
    from rich.table import Table
    from rich.text import Text

    from pgdiag.cli.render import format_value, render_checks, render_gates, render_verdict, render_written
    from pgdiag.compare.nway import compare_many
    from pgdiag.report.gates import outcome
    from pgdiag.report.verdict import compare_verdict

    if any(x is not None for x in (settings.metrics, settings.model)) or settings.tokenizer is not None:
        raise UsageError("E503", "--metrics, --model and --tokenizer compare two runs; drop them for N-way")
    index = 0
    if baseline is not None:
        names = [[str(p), Path(p).name, s.label] for p, s in zip(paths, sources, strict=True)]
        matches = [i for i, n in enumerate(names) if baseline in n]
        if len(matches) != 1:
            raise UsageError(
                "E503", f"--baseline {baseline!r} names {len(matches)} of the runs; give a path or label"
            )
        index = matches[0]
    nway = compare_many(sources, settings, baseline=index)
    report = nway.report
    decision = outcome(report, gates)
    verdict = compare_verdict(report, decision.gates)
    if not quiet:
        render_parity(console, report)
        table = Table(title="mismatch/abs_mean (nats) between every pair", title_justify="left")
        for column in ("run a", "run b", "mean |Δ|"):
            table.add_column(column, justify="right" if column == "mean |Δ|" else "left")
        for row in nway.matrix.iter_rows(named=True):
            table.add_row(Text(row["run_a"]), Text(row["run_b"]), format_value(row["value"], "nats"))
        console.print(table)
        render_checks(console, report.checks)
        render_gates(console, decision.gates)
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
    )
    result["matrix"] = nway.matrix.to_dicts()
    if out is not None:
        files = report.with_meta(verdict=verdict.as_dict()).write(out, overwrite=overwrite, result=result)
        result["files"] = files.as_dict()
    if not quiet:
        render_written(console, result["files"])
        render_verdict(console, verdict)
    return result


def _render_routing(console: Console, attribution: Any, recompute: str, replay: str) -> None:
    """One line per step: mean |Δ| with the router's experts and with the engine's, the share routing explains."""

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    console.print(
        f"routing attribution ({recompute} = router's experts, {replay} = engine's experts):", markup=False
    )
    for step, rc, rp, share, disagree in attribution.iter_rows():
        console.print(
            f"  step {step:>5}: |Δ| {fmt(rc, '.4g')} -> {fmt(rp, '.4g')} with replay, "
            f"routing/mismatch_share {fmt(share, '.1%')}, routing/disagree_frac {fmt(disagree, '.2%')}",
            markup=False,
        )


def render_parity(console: Console, report: Any, *, verbose: bool = False) -> None:
    """The parity table: one row per statistic, token and sequence scope side by side, with units."""
    import polars as pl
    from rich.table import Table
    from rich.text import Text

    from pgdiag.cli.render import format_value

    rows = report.summary.filter(pl.col("breakdown") == "all")
    for pair in rows["pair"].unique(maintain_order=True).to_list():
        part = rows.filter(pl.col("pair") == pair)
        if part["scope"].unique().to_list() == ["batch"]:
            continue
        cells: dict[tuple[str, str], tuple[float | None, str]] = {
            (scope, metric): (value, unit)
            for scope, metric, value, unit in part.select("scope", "metric", "value", "unit").iter_rows()
        }
        table = Table(
            title=Text.assemble(("parity", "bold"), "  ", (f"{pair}  (Δ = lp_b − lp_a)", "dim")),
            title_justify="left",
            show_edge=False,
        )
        for name, justify in (
            ("metric", "left"),
            ("token", "right"),
            ("sequence", "right"),
            ("unit", "left"),
        ):
            table.add_column(name, justify=justify, no_wrap=True)
        stats = TABLE_STATS if not verbose else tuple(dict.fromkeys(m.split("/", 1)[1] for _, m in cells))
        for stat in stats:
            key = f"mismatch/{stat}"
            tok, seq = cells.get(("token", key)), cells.get(("sequence", key))
            if tok is None and seq is None:
                continue
            unit = (tok or seq)[1]
            table.add_row(
                stat,
                "" if tok is None else format_value(tok[0], unit),
                "" if seq is None else format_value(seq[0], unit),
                unit,
            )
        n_tok = cells.get(("token", "count/mismatch_tokens"), (None, ""))[0]
        n_seq = cells.get(("sequence", "count/samples"), (None, ""))[0]
        table.caption = f"{format_value(n_tok, 'count')} tokens, {format_value(n_seq, 'count')} sequences"
        console.print(table)


def render_breakdowns(console: Console, report: Any) -> None:
    """One table per token-scope breakdown: n, mean |Δ|, p99 |Δ|, max |Δ|, k3 and the clip-band share per bucket."""
    import polars as pl
    from rich.table import Table
    from rich.text import Text

    from pgdiag.cli.render import format_value

    stats = ("abs_mean", "abs_p99", "abs_max", "bias", "kl_k3", "frac_out_clip")
    rows = report.summary.filter(
        (pl.col("scope") == "token") & ~pl.col("breakdown").is_in(["all", "dlogp"]) & (pl.col("pair") != "")
    )
    for (pair, breakdown), part in rows.group_by(["pair", "breakdown"], maintain_order=True):
        wide = part.pivot(on="metric", index=["bucket", "bucket_lo", "n"], values="value").sort("bucket_lo")
        table = Table(
            title=Text.assemble((f"by {breakdown}", "bold"), "  ", (pair, "dim")),
            title_justify="left",
            show_edge=False,
        )
        for name in ("bucket", "n", *stats):
            table.add_column(name, justify="left" if name == "bucket" else "right")
        for row in wide.iter_rows(named=True):
            cells = [str(row["bucket"]), format_value(row["n"], "count")]
            cells += [format_value(row.get(f"mismatch/{s}"), "") for s in stats]
            table.add_row(*cells)
        console.print(table)


def render_worst_tokens(console: Console, report: Any, *, limit: int, decode: Any = None) -> None:
    """The tokens with the largest |Δ|: where they are, both log-probs, Δ and, with --tokenizer, their text."""
    from rich.table import Table
    from rich.text import Text

    from pgdiag.cli.render import format_value

    tokens = report.worst_tokens
    if tokens is None or tokens.height == 0 or limit <= 0:
        return
    tokens = tokens.head(limit)
    has_text = tokens["context"].null_count() < tokens.height
    table = Table(
        title=Text.assemble(("worst tokens", "bold"), "  ", ("largest |Δ| first", "dim")),
        title_justify="left",
        show_edge=False,
    )
    for name in ("step", "sample", "pos", "token", "lp_a", "lp_b", "Δ"):
        table.add_column(name, justify="left" if name == "sample" else "right", no_wrap=True)
    if has_text:
        table.add_column("text (±8 tokens)", overflow="fold")
    for row in tokens.iter_rows(named=True):
        cells = [
            Text(str(row["step"])),
            Text(str(row["sample_id"])),
            Text(str(row["pos"])),
            Text(repr(decode([row["token_id"]])) if decode is not None else str(row["token_id"])),
            Text(format_value(row["lp_a"], "", digits=4)),
            Text(format_value(row["lp_b"], "", digits=4)),
            Text(format_value(row["dlogp"], "", digits=3), style="bold"),
        ]
        if has_text:
            cells.append(Text(row["context"] or ""))
        table.add_row(*cells)
    console.print(table)
    if not has_text:
        console.print(Text("--tokenizer PATH shows each token's text", style="dim"))
