"""Everything `pgdiag compare --out` writes: report, worst-K tables, worst trace, plots, markdown summary.

What: `write_outputs(comparison, out, ...)` writes, beside each other,
``<name>.parquet`` / ``<name>.json`` / ``<name>.worst_tokens.parquet`` / ``<name>.worst_seqs.parquet`` (through
`Report.write`), ``<name>.worst_trace.parquet`` (both streams along the worst sequence, so `pgdiag plot` can
redraw the trace), ``<name>.plots/<kind>.png`` and ``<name>.md`` (a short summary for CI comments).
Why: one directory holds a comparison a reviewer can open without the runs. How: `out` is a directory (name
``compare``) or a ``.parquet`` file name; every file is written atomically; existing files need `overwrite`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from pgdiag.report.format import PARITY_HEADLINE_STATS
from pgdiag.report.gates import GateResult
from pgdiag.report.report import REPORT_SCHEMA_ID, Report
from pgdiag.report.verdict import Verdict


def output_paths(out: str | Path) -> tuple[Path, str]:
    """(directory, name) of a report destination: a directory (name ``compare``) or ``<name>.parquet``."""
    out = Path(out)
    if out.suffix == ".parquet":
        return out.parent, out.stem
    return out, "compare"


def planned_outputs(out: str | Path) -> tuple[Path, list[Path]]:
    """(directory, every file `write_outputs(..., out)` may write): checked before any work is done."""
    from pgdiag.report.plots import COMPARE_KINDS
    from pgdiag.report.report import report_files

    directory, name = output_paths(out)
    report = report_files(directory / f"{name}.parquet", "compare")
    files = [p for p in (report.report, report.json, report.worst_tokens, report.worst_seqs) if p is not None]
    files += [directory / f"{name}.worst_trace.parquet", directory / f"{name}.md"]
    files += [directory / f"{name}.plots" / f"{kind}.png" for kind in COMPARE_KINDS]
    return directory, files


@dataclass(frozen=True)
class PlotFiles:
    """Figures written by `draw_plots` ({kind: path}) and the kinds left out ({kind: why})."""

    written: dict[str, str]
    skipped: dict[str, str]


def trace_path(report_path: str | Path) -> Path:
    """The worst-trace file that sits beside a report file."""
    report_path = Path(report_path)
    return report_path.with_name(f"{report_path.stem}.worst_trace.parquet")


def draw_plots(
    report: Report,
    trace: pl.DataFrame | None,
    tokens: Any,
    directory: Path,
    *,
    kinds: tuple[str, ...] = ("all",),
    fmt: str = "png",
    dpi: int = 120,
) -> PlotFiles:
    """Draw `kinds` ("all" = every kind the data supports) into `directory`; token plots need `tokens` (an
    AlignedPair or token frame), the trace plot `trace`. A kind named explicitly whose data is absent raises
    UsageError; under "all" it is listed in `PlotFiles.skipped` with the reason."""
    from pgdiag.report import plots

    plot_set = plots.build_figures(report, kinds=kinds, tokens=tokens, trace=trace)
    return PlotFiles(plots.save_figures(plot_set, directory, fmt=fmt, dpi=dpi), plot_set.skipped)


def summary_markdown(report: Report, gates: GateResult | None, verdict: Verdict | None = None) -> str:
    """A short markdown summary: the verdict, pairs, headline numbers at both scopes, checks and gates."""
    rows = report.summary.filter(pl.col("breakdown") == "all")
    lines = ["# pgdiag compare", ""]
    if verdict is not None:
        lines += [f"**{verdict.line}**", ""]
    for pair in report.meta.get("pairs", []):
        part = rows.filter(pl.col("pair") == pair)
        cell = {(s, m): (v, u) for s, m, v, u in part.select("scope", "metric", "value", "unit").iter_rows()}
        n_tok = cell.get(("token", "count/mismatch_tokens"), (None, ""))[0]
        lines += [f"## `{pair}`", "", f"{int(n_tok or 0):,} matched tokens. Δ = lp_b − lp_a.", ""]
        lines += ["| metric | token | sequence | unit |", "|---|---|---|---|"]
        for stat in PARITY_HEADLINE_STATS:
            tok = cell.get(("token", f"mismatch/{stat}"))
            seq = cell.get(("sequence", f"mismatch/{stat}"))
            if tok is None and seq is None:
                continue
            unit = (tok or seq)[1]
            lines.append(f"| {stat} | {_fmt(tok)} | {_fmt(seq)} | {unit} |")
        lines.append("")
    if report.checks.height:
        lines += ["## Checks", ""]
        lines += [
            f"- **{c}** ({s}): {m}"
            for c, s, m in report.checks.select("code", "severity", "message").iter_rows()
        ]
        lines.append("")
    if gates is not None and gates.gates:
        lines += [f"## Gates: {gates.status}", "", "| gate | pair | value | status |", "|---|---|---|---|"]
        for g in gates.gates:
            lines.append(f"| `{g.expr}` | {g.pair or ''} | {_fmt((g.value, ''))} | {g.status} |")
        lines.append("")
    return "\n".join(lines)


def _fmt(cell: tuple[float | None, str] | None) -> str:
    if cell is None or cell[0] is None:
        return "—"
    return f"{cell[0]:.6g}"


def write_outputs(
    comparison: Any,
    out: str | Path,
    *,
    result: Mapping[str, Any] | None = None,
    gates: GateResult | None = None,
    verdict: Verdict | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write every output of `comparison` (a `compare.pair_report.Comparison`) under `out`; returns the JSON `files`
    (with those already in ``result["files"]``), which the saved ``<name>.json`` lists too. `verdict` is saved
    in the report's meta and heads the markdown summary."""
    from pgdiag.data.writing import atomic_write, check_destination, write_parquet
    from pgdiag.report.report import report_files

    directory, name = output_paths(out)
    check_destination(directory, planned_outputs(out)[1], overwrite=overwrite)
    md_path, trace_file, plot_dir = (
        directory / f"{name}.md",
        directory / f"{name}.worst_trace.parquet",
        directory / f"{name}.plots",
    )
    report: Report = comparison.report
    if verdict is not None:
        report = report.with_meta(verdict=verdict.as_dict())
    trace = comparison.trace()
    write_parquet(trace, trace_file, metadata={"pgdiag.schema": REPORT_SCHEMA_ID})
    plots = draw_plots(report, trace, comparison.tokens, plot_dir)
    text = summary_markdown(report, gates, verdict)
    atomic_write(md_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    planned = report_files(directory / f"{name}.parquet", "compare")
    files: dict[str, Any] = {  # the report and its JSON are written last, listing every file
        **(dict(result.get("files") or {}) if result is not None else {}),
        "report": str(planned.report),
        "json": str(planned.json),
        **({"worst_tokens": str(planned.worst_tokens)} if report.worst_tokens is not None else {}),
        **({"worst_seqs": str(planned.worst_seqs)} if report.worst_seqs is not None else {}),
        "worst_trace": str(trace_file),
        "markdown": str(md_path),
        "plots": plots.written,
        "plots_skipped": plots.skipped,
    }
    saved = {**result, "files": files} if result is not None else None
    report.write(directory / f"{name}.parquet", overwrite=overwrite, result=saved)
    return files
