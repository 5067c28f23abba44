"""Rich rendering of reports, checks and gates on the stderr console. No computation happens here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pgdiag.errors import one_line
from pgdiag.report.format import format_value
from pgdiag.report.gates import GateResult
from pgdiag.report.report import Report
from pgdiag.report.verdict import Verdict

FAMILY_ORDER = ("loss", "grad", "policy", "mismatch", "advantage", "entropy", "group", "count")
# The default `metrics` view: what a user looks at first, in this order.
COMPACT_METRICS = (
    "loss/pg",
    "policy/ratio_mean",
    "policy/ratio_min",
    "policy/ratio_max",
    "policy/logratio_absmax",
    "policy/kl_k1",
    "policy/kl_k3",
    "policy/clip_frac_band",
    "policy/clip_frac_binding",
    "policy/ess_token",
    "mismatch/abs_mean",
    "mismatch/kl_k3",
    "mismatch/tmpe",
    "mismatch/frac_out_2x",
    "mismatch/ess_token",
    "advantage/mean",
    "advantage/frac_zero",
    "entropy/mean",
    "count/tokens",
    "count/samples",
    "count/samples_empty",
)


def _family(metric: str) -> str:
    return metric.split("/", 1)[0] if "/" in metric else "metrics"


def _steps_that_fit(width: int, fixed: int, step_widths: Sequence[int]) -> int:
    """How many step columns (each `step_widths[i]` wide plus a 2-character gap) fit beside `fixed` columns."""
    used, count = fixed, 0
    for step_width in step_widths:
        if used + 2 + step_width > width:
            break
        used += 2 + step_width
        count += 1
    return count


def render_metrics(
    console: Console,
    report: Report,
    *,
    show_all: bool = False,
    all_steps: bool = False,
    verbose: bool = False,
    verdict: Verdict | None = None,
) -> None:
    """The metrics table, sized to the console so that no metric name is ever cut.

    Default: the metrics a user looks at first (`COMPACT_METRICS`; under a key style every key), one row each with
    its full name, the pooled value, as many steps as fit and the unit. `show_all`: every metric, one table per
    family, with its reduction. Steps that do not fit are named below the table (`all_steps` prints them in
    further tables instead). Cells of `verdict`'s anomalies are red.
    """
    native = report.meta.get("settings", {}).get("key_style", "pgdiag") == "pgdiag"
    layout = _metrics_layout(report, show_all=show_all, verbose=verbose, native=native, verdict=verdict)
    if layout is None:
        return
    fit = _steps_that_fit(console.width, layout.fixed_width(show_all, verbose), layout.step_widths())
    steps = layout.steps
    blocks = [steps[:fit]]
    if all_steps:
        blocks = [steps[i : i + max(fit, 1)] for i in range(0, len(steps), max(fit, 1))] or [[]]
    for block_index, shown in enumerate(blocks):
        for family in layout.families:
            title = family or "metrics"
            if block_index:
                title += f" (steps {shown[0]}–{shown[-1]})"
            console.print(_metrics_table(layout, family, title, shown, show_all=show_all, verbose=verbose))
    hidden = [] if all_steps else steps[fit:]
    if hidden:
        console.print(
            Text(
                f"{len(hidden)} of {len(steps)} steps not shown at {console.width} columns "
                f"(step{'s' if len(hidden) > 1 else ''} {', '.join(hidden[:8])}{', …' if len(hidden) > 8 else ''}): --all-steps, --json or --out "
                "show them",
                style="dim",
            )
        )
    if not show_all and native:
        console.print(
            Text("the main metrics only: --all shows every metric, --list-metrics explains them", style="dim")
        )
    for notice in report.meta.get("notices", []):
        console.print(Text.assemble(("note: ", "yellow"), notice))


@dataclass(frozen=True)
class _MetricsLayout:
    """What the metrics tables show: rows (pair, metric, value, unit, reduction, n) by family, and the steps."""

    steps: list[str]
    families: dict[str, list[tuple]]  # family ("" when not split) -> pooled rows, in display order
    per_step: dict[tuple[str, str], float]  # (step, metric) -> value
    statuses: dict[str, str]  # step -> status
    flagged: set[tuple[str, str]]  # (step or "all", metric) of the verdict's anomalies
    digits: int

    @property
    def rows(self) -> list[tuple]:
        return [row for rows in self.families.values() for row in rows]

    def cell_width(self, column: str | None) -> int:
        header = "all" if column is None else _step_header(column, self.statuses)
        values = (
            format_value(
                r[2] if column is None else self.per_step.get((column, r[1])), r[3], digits=self.digits
            )
            for r in self.rows
        )
        return max(len(header), *(len(v) for v in values))

    def step_widths(self) -> list[int]:
        return [self.cell_width(step) for step in self.steps]

    def fixed_width(self, show_all: bool, verbose: bool) -> int:
        rows = self.rows
        name_width = max(len("metric"), *(len(r[1]) for r in rows))
        unit_width = max(len("unit"), *(len(r[3]) for r in rows))
        extra = []
        if show_all:
            extra.append(max(len("reduction"), *(len(r[4]) for r in rows)))
        if verbose:
            extra.append(max(len("n"), *(len(f"{r[5]:,}") for r in rows)))
        return name_width + 2 + self.cell_width(None) + 2 + unit_width + sum(2 + w for w in extra)


def _metrics_layout(
    report: Report, *, show_all: bool, verbose: bool, native: bool, verdict: Verdict | None
) -> _MetricsLayout | None:
    """The rows and steps `render_metrics` shows, or None when there is no row."""
    summary = report.summary
    steps = summary.filter(pl.col("breakdown") == "step")["bucket"].unique(maintain_order=True).to_list()
    pooled = summary.filter(pl.col("breakdown") == "all")
    per_step = {
        (bucket, metric): value
        for bucket, metric, value in summary.filter(pl.col("breakdown") == "step")
        .select("bucket", "metric", "value")
        .iter_rows()
    }
    rows = list(pooled.select("pair", "metric", "value", "unit", "reduction", "n").iter_rows())
    if not show_all and native:
        order = {name: i for i, name in enumerate(COMPACT_METRICS)}
        rows = sorted((r for r in rows if r[1] in order), key=lambda r: order[r[1]])
    if not rows:
        return None
    families: dict[str, list[tuple]] = {}
    for row in rows:
        families.setdefault(_family(row[1]) if show_all else "", []).append(row)
    count_at = FAMILY_ORDER.index("count")
    ordered = sorted(families, key=lambda f: FAMILY_ORDER.index(f) if f in FAMILY_ORDER else count_at - 0.5)
    return _MetricsLayout(
        steps=steps,
        families={family: families[family] for family in ordered},
        per_step=per_step,
        statuses={str(s["step"]): s["status"] for s in report.meta.get("steps", [])},
        flagged={(f.step, f.metric) for f in (verdict.findings if verdict is not None else ())},
        digits=6 if show_all or verbose else 4,
    )


def _metrics_table(
    layout: _MetricsLayout, family: str, title: str, shown: list[str], *, show_all: bool, verbose: bool
) -> Table:
    """One family's table over the steps `shown`."""
    rows = layout.rows
    pairs = sorted({r[0] for r in rows})
    name_width = max(len("metric"), *(len(r[1]) for r in rows))
    table = Table(
        title=Text.assemble((title, "bold"), "  ", (", ".join(pairs), "dim")),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    table.add_column("metric", min_width=name_width, no_wrap=True)
    table.add_column("all", justify="right", no_wrap=True)
    for step in shown:
        table.add_column(_step_header(step, layout.statuses), justify="right", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    if show_all:
        table.add_column("reduction", no_wrap=True)
    if verbose:
        table.add_column("n", justify="right", no_wrap=True)
    digits, flagged = layout.digits, layout.flagged
    for _pair, metric, value, unit, reduction, n in layout.families[family]:
        cells = [Text(metric), _cell(value, unit, digits, ("all", metric) in flagged)]
        cells += [
            _cell(layout.per_step.get((step, metric)), unit, digits, (step, metric) in flagged)
            for step in shown
        ]
        cells.append(Text(unit, style="dim"))
        if show_all:
            cells.append(Text(reduction, style="dim"))
        if verbose:
            cells.append(Text(f"{n:,}"))
        table.add_row(*cells)
    return table


def _step_header(step: str, statuses: dict[str, str]) -> str:
    status = statuses.get(step, "ok")
    return f"step {step}" + ("" if status == "ok" else f" ({status})")


def _cell(value: float | None, unit: str, digits: int, flagged: bool) -> Text:
    return Text(format_value(value, unit, digits=digits), style="bold red" if flagged else "")


def render_catalog(console: Console | None = None) -> None:
    """Every native metric (`pgdiag metrics --list-metrics`), on stdout: by family, each key whole on its own
    line with its unit and reduction, then its meaning indented below."""
    from pgdiag.metrics.catalog import METRIC_CATALOG

    if console is None:
        from pgdiag.cli.common import LineConsole

        console = LineConsole(highlight=False, emoji=False)
    family = None
    for entry in METRIC_CATALOG:
        if entry.family != family:
            family = entry.family
            console.print(Text(f"\n{family}", style="bold underline"))
        console.print(Text.assemble((entry.key, "bold"), (f"  {entry.unit}, {entry.reduction}", "dim")))
        console.print(Text(f"    {entry.meaning}"))
    console.print(
        Text(
            "\nreduction: R = --metric-reduction (token, sample or document), tok = over tokens, seq = over "
            "samples, grp = over groups, step = per step, cnt = a count, mode = per aggregation mode. Formulas: "
            "docs/metrics.md.",
            style="dim",
        )
    )


def render_verdict(console: Console, verdict: Verdict) -> None:
    """The verdict line, last; green when clean or AGREE, yellow for warnings, red otherwise."""
    colour = {"clean": "green", "AGREE": "green", "warnings": "yellow"}.get(verdict.status, "red")
    head, _, rest = one_line(verdict.line).partition(": ")
    status, _, detail = rest.partition(" ")
    console.print(
        Text.assemble((f"{head}: ", "bold"), (status, f"bold {colour}"), f" {detail}" if detail else "")
    )


def render_checks(console: Console, checks: pl.DataFrame, hints: Sequence[str | None] = ()) -> None:
    """Check findings, one line each (``warning[W215] message``), each followed by its ``hint:`` if any."""
    rows = checks.select("code", "severity", "message").iter_rows()
    for index, (code, severity, message) in enumerate(rows):
        colour = "red" if severity == "error" else "yellow"
        console.print(f"[{colour}]{severity}{escape(f'[{code}]')}[/] ", end="")
        console.print(one_line(message), markup=False, soft_wrap=True)
        hint = hints[index] if index < len(hints) else None
        if hint:
            console.print(f"  hint: {one_line(hint)}", markup=False, soft_wrap=True)


def render_gates(console: Console, gates: GateResult) -> None:
    """Gate outcomes that did not pass, then a one-line verdict when any gate ran."""
    for gate in gates.gates:
        if gate.status in ("pass", "skipped"):
            continue
        colour = "yellow" if gate.status == "warn" else "red"
        where = f" [{gate.pair}]" if gate.pair else ""
        value = "missing" if gate.value is None else format_value(gate.value, "")
        console.print(
            Text.assemble((f"gate {gate.status}", colour), f" {gate.expr}{where}: {value}"), soft_wrap=True
        )
    if gates.gates:
        colour = {"pass": "green", "warn": "yellow", "fail": "red"}[gates.status]
        console.print(f"[{colour}]gates: {gates.status}[/] ({len(gates.gates)} evaluated)")


def render_written(console: Console, files: Mapping[str, Any]) -> None:
    """What a command wrote, one file a line (the same list as the `files` of its JSON object), then the plots
    left out (``files["plots_skipped"]``) with why."""
    paths: list[tuple[str, str]] = []
    skipped = files.get("plots_skipped") or {}
    for role, value in files.items():
        if role == "plots_skipped":
            continue
        if isinstance(value, Mapping):
            paths += [(f"{role} {kind}", str(path)) for kind, path in value.items()]
        elif value is not None:
            paths.append((role, str(value)))
    if not paths:
        return
    width = max(len(role) for role, _ in paths)
    console.print(Text(f"wrote {len(paths)} file{'s' if len(paths) != 1 else ''}:", style="bold"))
    for role, path in paths:
        console.print(Text.assemble(f"  {role:<{width}}  ", (path, "cyan")), soft_wrap=True)
    for kind, why in skipped.items():
        console.print(Text(f"  skipped {kind}: {why}", style="dim"), soft_wrap=True)


def render_exact(console: Console, exact: Mapping[str, Any]) -> None:
    """`compare --exact`: per pair, identical or the count of tokens with a nonzero Δ, the first one, ULPs."""
    for pair, result in exact.items():
        if result["identical"]:
            console.print(f"exact {pair}: identical, {result['n_tokens']} tokens bit for bit")
            continue
        first = result["first"]
        line = f"exact {pair}: {result['n_nonzero']} of {result['n_tokens']} tokens differ"
        if result["mask_mismatch"]:
            line += f", loss masks differ on {result['mask_mismatch']} positions"
        console.print(line)
        if first is not None:
            console.print(
                f"  first: step {first['step']}, sample {first['sample_id']}, pos {first['pos']}, token "
                f"{first['token_id']}: {first['value_a']!r} vs {first['value_b']!r}"
                + (f" ({first['ulp']} ULP)" if first["ulp"] is not None else "")
            )
        histogram = ", ".join(f"{k}: {v}" for k, v in result["ulp_histogram"].items())
        console.print(f"  ULP distance histogram: {histogram}")


LAG_COLUMNS = (
    "count/tokens",
    "policy/logratio_abs_mean",
    "policy/kl_k3",
    "mismatch/abs_mean",
    "mismatch/kl_k3",
)


LOSS_COLUMNS = (
    "losses/rel_l2",
    "losses/rel_l2_aggregation",
    "losses/rel_l2_factor",
    "losses/grad_norm_ratio",
)


def _breakdown_table(
    console: Console,
    report: Report,
    breakdown: str,
    title: str,
    first: str,
    columns: tuple[str, ...],
    unit: Callable[[str], str],
    header: Callable[[str], str] = str,
) -> None:
    """One row per bucket of the summary's `breakdown` rows, one column per metric of `columns` the report holds;
    nothing when it has no such rows."""
    rows = report.summary.filter(pl.col("breakdown") == breakdown)
    if rows.height == 0:
        return
    values = {(b, m): v for b, m, v in rows.select("bucket", "metric", "value").iter_rows()}
    shown = [c for c in columns if any(m == c for _, m in values)]
    table = Table(title=Text(title, style="bold"), title_justify="left")
    table.add_column(first, justify="left")
    for name in shown:
        table.add_column(header(name), justify="right")
    for bucket in rows["bucket"].unique(maintain_order=True).to_list():
        table.add_row(bucket, *[format_value(values.get((bucket, m)), unit(m)) for m in shown])
    console.print(table)


def render_lag(console: Console, report: Report) -> None:
    """`metrics --by lag`: one row per lag bucket (tokens, the policy and mismatch pairs' mean |d| and k3)."""
    title = "by lag (proximal − sampling version)"
    _breakdown_table(
        console, report, "lag", title, "lag", LAG_COLUMNS, lambda m: "count" if m == "count/tokens" else ""
    )


def render_losses(console: Console, report: Report) -> None:
    """`--losses A,B`: the gradient parity of the two loss definitions (the maximum over the steps)."""
    title = "loss parity (max over steps)"
    _breakdown_table(
        console,
        report,
        "losses",
        title,
        "A vs B",
        LOSS_COLUMNS,
        lambda m: "ratio",
        lambda name: name.removeprefix("losses/"),
    )
