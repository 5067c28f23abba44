"""`pgdiag whatif RUN`: replay off-policy correction rules (TIS, MIS, geometric mask, IcePop) on a saved batch.

Thin shell over `pgdiag.analysis.whatif.whatif` (docs/whatif.md): parse the thresholds -> replay -> render a table
on stderr and the verdict last, `--json` on stdout, `--out` report files, `--plot` the data-kept-vs-ESS figure,
`--html` the one-file page (docs/report.md). Example::

    pgdiag whatif sample_data/run_a --token-tis 2 --icepop 0.5,5 --seq-mis 0.5,2
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.options import (
    STREAMS,
    THRESHOLDS,
    CheckOptions,
    DivisorOpt,
    Fields,
    LossesOpt,
    RunArg,
    RunInputs,
    listed,
    option,
)
from pgdiag.cli.outputs import OutputSettings, finish

HELP = """Replay off-policy corrections on a saved batch: how much data each rule drops, and where.

Behaviour stream (rollout) against the target (old, else the single recompute tag). Rules, each as the
framework that ships it defines it (docs/whatif.md): token TIS, token MIS, sequence TIS and MIS on the product
ratio, geometric masking, IcePop. Without any rule flag the default grid runs (token 1.5/2/3/5, sequence
2/5/10, IcePop 0.5,5). Per rule: fraction of tokens and sequences truncated or dropped, token and sequence ESS
before and after, the change of every loss mode, and the steps, envs and positions that lose the most. The
last line is the verdict: the rules that drop more than 5% of the tokens, each with its worst step.
"""


def _cap_option(flag: str, text: str) -> Any:
    return option(flag, text, THRESHOLDS)


def parse_rules(
    *,
    token_tis: tuple[float, ...],
    token_mis: tuple[str, ...],
    seq_tis: tuple[float, ...],
    seq_mis: tuple[str, ...],
    geo_mask: tuple[str, ...],
    icepop: tuple[str, ...],
    rule: tuple[str, ...] = (),
) -> tuple[Any, ...]:
    """The `CorrectionRule`s named on the command line, in flag order (E503 for a malformed LO,HI)."""
    from pgdiag.analysis.settings import CorrectionRule
    from pgdiag.errors import Code, UsageError

    def band(kind: str, text: str) -> CorrectionRule:
        parts = [p.strip() for p in text.split(",")]
        try:
            lo, hi = (float(p) for p in parts)
        except ValueError:
            raise UsageError(
                Code.UNPARSABLE_OPTION, f"--{kind.replace('_', '-')} {text!r}: give two numbers, 'LO,HI'"
            ) from None
        return CorrectionRule(kind, hi, lo)

    rules = [CorrectionRule("token_tis", c) for c in token_tis]
    rules += [band("token_mis", t) for t in token_mis]
    rules += [CorrectionRule("seq_tis", c) for c in seq_tis]
    rules += [band("seq_mis", t) for t in seq_mis]
    rules += [band("geo_mask", t) for t in geo_mask]
    rules += [band("icepop", t) for t in icepop]
    from pgdiag.analysis.settings import parse_rule

    rules += [parse_rule(spec) for spec in rule]
    return tuple(rules)


TABLE_METRICS = (
    ("whatif/tokens_affected", "tokens hit"),
    ("whatif/seqs_affected", "seqs hit"),
    ("whatif/tokens_kept", "tokens kept"),
    ("whatif/ess_token_after", "ESS tok"),
    ("whatif/ess_seq_after", "ESS seq"),
    ("whatif/signal_kept", "signal kept"),
    ("whatif/grad_coef_ratio", "Σ|g|/Σ|A|"),
    ("whatif/loss_delta/token_mean", "Δ token_mean"),
    ("whatif/loss_delta/sample_mean", "Δ sample_mean"),
)


@dataclass(frozen=True)
class RuleOptions:
    """The correction rules named on the command line (none: the default grid)."""

    token_tis: Annotated[list[float] | None, _cap_option("--token-tis", "Token TIS: truncate e^d at C.")] = (
        None
    )
    token_mis: Annotated[
        list[str] | None, _cap_option("--token-mis", "Token MIS: drop tokens outside LO,HI (verl token_k1).")
    ] = None
    seq_tis: Annotated[
        list[float] | None, _cap_option("--seq-tis", "Sequence TIS: truncate the product ratio at C.")
    ] = None
    seq_mis: Annotated[
        list[str] | None,
        _cap_option("--seq-mis", "Sequence MIS: drop sequences whose product is outside LO,HI."),
    ] = None
    geo_mask: Annotated[
        list[str] | None,
        _cap_option("--geo-mask", "Geometric mask: drop sequences whose geometric mean is outside LO,HI."),
    ] = None
    icepop: Annotated[
        list[str] | None, _cap_option("--icepop", "IcePop: zero the weight of tokens whose ratio leaves A,B.")
    ] = None
    rule: Annotated[
        list[str] | None,
        _cap_option(
            "--rule",
            "Any rule as NAME:PARAMS (opsm:0.1, dppo_tv:0.2,0.2, m2po:0.04,scope=mb:4, "
            "token_k1:0.5,2+seq_max_k2:1; docs/whatif.md lists them).",
        ),
    ] = None

    def rules(self) -> tuple[Any, ...]:
        return parse_rules(**{f.name: listed(getattr(self, f.name)) for f in fields(self)})


BehaviorOpt = Annotated[str, option("--behavior", "The stream that sampled.", STREAMS)]
TargetOpt = Annotated[
    str | None,
    option("--target", "The trainer's stream (default: old, else the single recompute tag).", STREAMS),
]


def whatif(
    run: RunArg,
    *,
    behavior: BehaviorOpt = "rollout",
    target: TargetOpt = None,
    rule: RuleOptions,
    losses: LossesOpt = None,
    divisor: DivisorOpt = None,
    inputs: RunInputs,
    check: CheckOptions,
    output: Annotated[OutputSettings, Fields("json_out", "out", "plot", "html", "overwrite", "quiet")],
) -> None:
    """The `whatif` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.analysis.settings import WhatifSettings
        from pgdiag.analysis.whatif import whatif as replay
        from pgdiag.analysis.whatif import worst_buckets
        from pgdiag.cli.render import render_checks
        from pgdiag.report.plots import plot_whatif
        from pgdiag.report.verdict import whatif_verdict

        output.refuse_existing("whatif")
        settings = WhatifSettings(
            behavior=behavior, target=target, rules=rule.rules(), divisor=divisor, losses=losses
        )
        source = inputs.read(run)
        report = replay(source, settings, checks=check.settings())
        verdict = whatif_verdict(report)
        report = report.with_meta(verdict=verdict.as_dict())
        worst = worst_buckets(report)
        render_checks(screen.notes, report.checks)
        if not output.quiet:
            screen.results.print(_rule_table(report, worst))
        inputs_meta = report.meta["inputs"]
        result = result_object(
            "whatif",
            inputs={k: inputs_meta[k] for k in ("runs", "streams", "n_samples", "n_tokens")},
            pairs=report.meta["pairs"],
            checks=report.checks.to_dicts(),
            summary=report.to_json_dict()["breakdowns"].get("threshold", {}),
            losses=report.to_json_dict()["breakdowns"].get("losses", {}),
            worst=worst,
            settings=report.meta["settings"],
            verdict=verdict.as_dict(),
        )
        result = finish(screen, report, output, result, verdict, draw=plot_whatif)
        return result

    execute("whatif", body, json_out=output.json_out, quiet=output.quiet)


def _rule_table(report: Any, worst: dict[str, Any]) -> Any:
    """One row per rule: its pair, the share hit and kept, ESS after, the signal kept, the loss change, and the
    step that loses the most (a rule that does not apply to the run: why)."""
    from rich.table import Table

    from pgdiag.cli.render import format_value

    table = Table(title=f"whatif {report.meta['pairs'][0]}", title_justify="left")
    table.add_column("rule")
    table.add_column("pair")
    pairs = report.meta["settings"]["pairs"]
    skipped = report.meta["settings"]["not_applicable"]
    for _, header in TABLE_METRICS:
        table.add_column(header, justify="right")
    table.add_column("worst step")
    wide = report.wide().filter(report.wide()["breakdown"] == "threshold")
    for row in wide.iter_rows(named=True):
        name = row["bucket"]
        if name == "none":  # the uncorrected batch: everything kept, ESS before any rule
            row = {**row, "whatif/tokens_kept": 1.0, "whatif/ess_token_after": row.get("whatif/ess_token")}
            row["whatif/ess_seq_after"] = row.get("whatif/ess_seq")
        if name in skipped:
            table.add_row(name, pairs[name], f"n/a: {skipped[name]}", *[""] * len(TABLE_METRICS))
            continue
        cells = [format_value(row.get(metric), "fraction") for metric, _ in TABLE_METRICS]
        top = worst.get(name, {}).get("step", [])
        where = f"{top[0]['bucket']} ({format_value(top[0]['tokens_affected'], 'fraction')})" if top else "—"
        table.add_row(name, pairs.get(name, ""), *cells, where if name != "none" else "")
    return table
