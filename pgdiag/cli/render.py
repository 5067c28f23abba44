"""Rich rendering of reports, checks and gates on the stderr console. No computation happens here."""

from __future__ import annotations

import math
from collections.abc import Sequence

import polars as pl
from rich.console import Console
from rich.table import Table

from pgdiag.report.gates import GateResult
from pgdiag.report.report import Report

MAX_STEP_COLUMNS = 6
FAMILY_ORDER = ("loss", "grad", "policy", "mismatch", "advantage", "entropy", "group", "count")


def format_value(value: float | None, unit: str) -> str:
    """A number for a table cell: counts as integers, others with 6 significant digits; None as '—'."""
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if unit == "count":
        return f"{int(value):,}"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-4):
        return f"{value:.4e}"
    return f"{value:.6g}"


def render_metrics(
    console: Console, report: Report, *, all_steps: bool = False, verbose: bool = False
) -> None:
    """One table per metric family: the pooled value, up to `MAX_STEP_COLUMNS` steps, unit, reduction, n."""
    summary = report.summary
    steps = summary.filter(pl.col("breakdown") == "step")["bucket"].unique(maintain_order=True).to_list()
    shown = steps if (all_steps or len(steps) <= MAX_STEP_COLUMNS) else steps[:MAX_STEP_COLUMNS]
    pooled = summary.filter(pl.col("breakdown") == "all")
    per_step = {
        (bucket, metric): value
        for bucket, metric, value in summary.filter(pl.col("breakdown") == "step")
        .select("bucket", "metric", "value")
        .iter_rows()
    }
    families: dict[str, list[tuple]] = {}
    for pair, metric, value, unit, reduction, n in pooled.select(
        "pair", "metric", "value", "unit", "reduction", "n"
    ).iter_rows():
        family = metric.split("/", 1)[0] if "/" in metric else "metrics"
        families.setdefault(family, []).append((pair, metric, value, unit, reduction, n))
    statuses = {str(s["step"]): s["status"] for s in report.meta.get("steps", [])}
    # native families in their order; a key style's own families (actor/, rollout_corr/, ...) before count/
    count_at = FAMILY_ORDER.index("count")
    ordered = sorted(families, key=lambda f: FAMILY_ORDER.index(f) if f in FAMILY_ORDER else count_at - 0.5)
    for family in ordered:
        rows = families[family]
        pairs = sorted({r[0] for r in rows})
        title = f"{family}  [dim]({', '.join(pairs)})[/]"
        table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        table.add_column("metric", style="bold")
        table.add_column("all", justify="right")
        for step in shown:
            status = statuses.get(step, "ok")
            table.add_column(f"step {step}" + ("" if status == "ok" else f" ({status})"), justify="right")
        table.add_column("unit")
        table.add_column("reduction")
        if verbose:
            table.add_column("n", justify="right")
        for _pair, metric, value, unit, reduction, n in rows:
            cells = [metric, format_value(value, unit)]
            cells += [format_value(per_step.get((step, metric)), unit) for step in shown]
            cells += [unit, reduction]
            if verbose:
                cells.append(f"{n:,}")
            table.add_row(*cells)
        console.print(table)
    if len(shown) < len(steps):
        console.print(f"[dim]{len(steps) - len(shown)} more steps: --all-steps, --json or --out show them[/]")
    for notice in report.meta.get("notices", []):
        console.print(f"[yellow]note:[/] {notice}", soft_wrap=True)


def render_checks(console: Console, checks: pl.DataFrame, hints: Sequence[str | None] = ()) -> None:
    """Check findings, one line each (``warning[W215] message``), each followed by its ``hint:`` if any."""
    rows = checks.select("code", "severity", "message").iter_rows()
    for index, (code, severity, message) in enumerate(rows):
        colour = "red" if severity == "error" else "yellow"
        console.print(f"[{colour}]{severity}[{code}][/] ", end="")
        console.print(message, markup=False, soft_wrap=True)
        hint = hints[index] if index < len(hints) else None
        if hint:
            console.print(f"  hint: {hint}", markup=False, soft_wrap=True)


def render_gates(console: Console, gates: GateResult) -> None:
    """Gate outcomes that did not pass, then a one-line verdict when any gate ran."""
    for gate in gates.gates:
        if gate.status in ("pass", "skipped"):
            continue
        colour = "yellow" if gate.status == "warn" else "red"
        where = f" [{gate.pair}]" if gate.pair else ""
        value = "missing" if gate.value is None else format_value(gate.value, "")
        console.print(f"[{colour}]gate {gate.status}[/] {gate.expr}{where}: {value}", soft_wrap=True)
    if gates.gates:
        colour = {"pass": "green", "warn": "yellow", "fail": "red"}[gates.status]
        console.print(f"[{colour}]gates: {gates.status}[/] ({len(gates.gates)} evaluated)")
