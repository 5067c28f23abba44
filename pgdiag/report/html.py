"""A one-file HTML report of `metrics`, `compare`, `whatif` or `drift`: verdict, tables, plots, worst tokens, checks,
settings.

What: `render_html(report, verdict=..., plot_set=...)` returns one self-contained page: the verdict line at the
top, the report's tables (metric families per step; the parity table and its breakdowns; the correction rules
with the data they keep, ESS, loss changes and where they hit; the change points and the per-step series), the
plots as base64 PNG images, the worst tokens and sequences (with their decoded text when the comparison had a
tokenizer), the checks and the settings. `write_html` writes it atomically (temp file, then rename).
Why: a reviewer opens one file, offline, in any browser: no network, no JavaScript, no files beside it.
How: every user string (labels, ids, paths, messages, token text) is HTML-escaped; the page's CSS is inline. This
module assembles the page; the tables of each report kind are in `pgdiag.report.metrics_page`, `compare_page`,
`whatif_page`, `drift_page` and `explain_page`, their cells in `pgdiag.report.html_cells`.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pgdiag.errors import Code, UsageError
from pgdiag.report.compare_page import compare_tables, worst_tables
from pgdiag.report.drift_page import drift_tables
from pgdiag.report.html_cells import _e, _table
from pgdiag.report.metrics_page import metrics_tables
from pgdiag.report.plots import Mark, PlotSet, figure_bytes
from pgdiag.report.report import Report
from pgdiag.report.whatif_page import whatif_tables

GOOD_STATUSES = ("agree", "clean", "ok", "pass")
WARN_STATUSES = ("warn", "warning", "warnings")
MAX_LISTED_FINDINGS = 8  # under the verdict line; the tables below hold every one

CSS = """
:root { --fg: #1d2330; --muted: #5b6475; --line: #d9dde5; --bg: #ffffff; --soft: #f5f7fa;
        --good: #1a7f37; --good-bg: #e8f5ec; --bad: #c62828; --bad-bg: #fdecec; --warn: #9a6700;
        --warn-bg: #fff6d6; --info-bg: #eef3fb; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--fg); background: var(--bg); }
header { padding: 18px 28px 12px; border-bottom: 1px solid var(--line); background: var(--soft); }
main { padding: 8px 28px 40px; max-width: 1400px; }
.kicker { color: var(--muted); font-size: 12px; }
h1 { font-size: 20px; margin: 4px 0 12px; word-break: break-word; }
h2 { font-size: 17px; margin: 26px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 14px; margin: 16px 0 6px; }
.verdict { font-size: 16px; padding: 12px 16px; border-radius: 6px; border-left: 6px solid var(--muted);
           background: var(--info-bg); word-break: break-word; }
.verdict .word { font-weight: 700; margin-right: 8px; }
.verdict.good { border-color: var(--good); background: var(--good-bg); }
.verdict.good .word { color: var(--good); }
.verdict.bad { border-color: var(--bad); background: var(--bad-bg); }
.verdict.bad .word { color: var(--bad); }
.verdict.warn { border-color: var(--warn); background: var(--warn-bg); }
.verdict.warn .word { color: var(--warn); }
.findings { margin: 8px 0 0 0; padding-left: 20px; font-size: 13px; }
nav { margin-top: 10px; font-size: 13px; }
nav a { margin-right: 14px; color: #1f5fbf; text-decoration: none; }
.scroll { overflow-x: auto; }
.blocks { display: flex; flex-wrap: wrap; gap: 8px 36px; align-items: flex-start; }
table { border-collapse: collapse; font-size: 12.5px; margin: 4px 0 10px; }
th, td { padding: 3px 10px; border-bottom: 1px solid var(--line); text-align: right; white-space: nowrap; }
th { background: var(--soft); font-weight: 600; position: sticky; top: 0; }
td.name, th.name, td.text { text-align: left; }
td.name { font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
td.text { white-space: pre-wrap; font-family: ui-monospace, "DejaVu Sans Mono", monospace; max-width: 520px; }
td.anomaly { background: var(--bad-bg); color: var(--bad); font-weight: 600; }
td.worst { background: var(--warn-bg); color: var(--warn); font-weight: 600; }
td.unit { color: var(--muted); text-align: left; }
tr.small td { color: var(--muted); }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 14px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 6px; padding: 6px; background: #fff; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 12px; color: var(--muted); margin-top: 4px; }
.note { color: var(--muted); font-size: 12.5px; }
details > summary { cursor: pointer; font-weight: 600; margin: 10px 0 4px; }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
"""


def _status_class(status: str) -> str:
    word = status.lower()
    if word in GOOD_STATUSES:
        return "good"
    if word in WARN_STATUSES:
        return "warn"
    if word in ("info", ""):
        return "info"
    return "bad"


def _verdict_block(status: str, line: str, findings: Sequence[str]) -> str:
    left_out = [f for f in findings if f not in line]  # those the line leaves out
    items = "".join(f"<li>{_e(f)}</li>" for f in left_out[:MAX_LISTED_FINDINGS])
    if len(left_out) > MAX_LISTED_FINDINGS:  # the verdict stays above the fold
        items += f"<li>and {len(left_out) - MAX_LISTED_FINDINGS} more in the tables below</li>"
    word = f'<span class="word">{_e(status)}</span>' if status and status != "info" else ""
    listed = f'<ul class="findings">{items}</ul>' if items else ""
    return f'<div id="verdict" class="verdict {_status_class(status)}">{word}{_e(line)}{listed}</div>'


def _plots(plot_set: PlotSet | None) -> str:
    if plot_set is None or (not plot_set.figures and not plot_set.skipped):
        return "<p class='note'>No plots.</p>"
    figures = []
    for kind, fig in plot_set.figures.items():
        data = base64.b64encode(figure_bytes(fig, fmt="png")).decode("ascii")
        figures.append(
            f'<figure><img alt="{_e(kind)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(kind)}</figcaption></figure>"
        )
    skipped = "".join(f"<li><code>{_e(k)}</code>: {_e(why)}</li>" for k, why in plot_set.skipped.items())
    note = f"<p class='note'>Not drawn:</p><ul class='note'>{skipped}</ul>" if skipped else ""
    return f'<div class="plots">{"".join(figures)}</div>{note}'


def _checks(report: Report) -> str:
    if report.checks.height == 0:
        return "<p class='note'>No findings.</p>"
    body = [
        [c, s, f'<td class="text">{_e(m)}</td>']
        for c, s, m in report.checks.select("code", "severity", "message").iter_rows()
    ]
    return _table(["code", "severity", "message"], body, left=2)


def _flat(prefix: str, value: Any, out: list[tuple[str, str]]) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            _flat(f"{prefix}.{key}" if prefix else str(key), item, out)
        return
    out.append((prefix, value if isinstance(value, str) else json.dumps(value, default=str)))


def _settings(report: Report, argv: Sequence[str] | None) -> str:
    pairs: list[tuple[str, str]] = []
    meta = {k: v for k, v in report.meta.items() if k not in ("steps", "notices", "diagnosis", "verdict")}
    if isinstance(meta.get("change_points"), Mapping):  # the change points have their own table
        meta["change_points"] = {k: v for k, v in meta["change_points"].items() if k != "found"}
    _flat("", meta, pairs)
    body = [[k, f'<td class="text">{_e(v)}</td>'] for k, v in pairs]
    command = f"<p><code>pgdiag {_e(' '.join(argv))}</code></p>" if argv else ""
    notices = "".join(f"<li>{_e(n)}</li>" for n in report.meta.get("notices", []))
    return (
        command + _table(["setting", "value"], body) + (f"<ul class='note'>{notices}</ul>" if notices else "")
    )


def verdict_arguments(verdict: Any) -> dict[str, Any]:
    """`render_html`'s verdict arguments (verdict, status, findings, marks) from a verdict: an object with
    ``line``, ``status`` and ``findings`` (each with ``metric``, ``step``, ``message``) or its dict form."""
    from pgdiag.report.plots import finding_marks

    def get(obj: Any, key: str) -> Any:
        return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

    findings = list(get(verdict, "findings") or ())
    return {
        "verdict": str(get(verdict, "line") or ""),
        "status": str(get(verdict, "status") or "info"),
        "findings": [str(get(f, "message") or "") for f in findings],
        "marks": finding_marks(findings),
    }


def render_html(
    report: Report,
    *,
    verdict: str,
    status: str = "info",
    findings: Sequence[str] = (),
    plot_set: PlotSet | None = None,
    marks: Sequence[Mark] = (),
    argv: Sequence[str] | None = None,
    title: str | None = None,
) -> str:
    """The self-contained page of `report`.

    `verdict` is the one line printed at the top, `status` its word (AGREE, DISAGREE, clean, anomalies, ...;
    "info" shows the line alone), `findings` the lines listed under it; `plot_set` the figures (from
    `plots.build_figures`); `marks` the anomalies highlighted in the metric tables (metrics) and the change
    points in the per-step tables (drift); `argv` the command that made the report.
    """
    from pgdiag import __version__

    pairs = report.meta.get("pairs", [])
    heading = title or f"pgdiag {report.kind}: {', '.join(pairs) if pairs else ''}"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if report.kind == "metrics":
        tables = metrics_tables(report, marks)
    elif report.kind == "whatif":
        tables = whatif_tables(report)
    elif report.kind == "drift":
        tables = drift_tables(report, marks)
    elif report.kind == "explain":
        from pgdiag.report.explain_page import explain_tables

        tables = explain_tables(report)
    else:
        tables = compare_tables(report)
    sections = [
        ("tables", "Tables", tables),
        ("plots", "Plots", _plots(plot_set)),
    ]
    if report.kind == "compare":
        sections.append(("worst", "Worst tokens", worst_tables(report)))
    sections += [("checks", "Checks", _checks(report)), ("settings", "Settings", _settings(report, argv))]
    nav = "".join(f'<a href="#{key}">{_e(name)}</a>' for key, name, _ in sections)
    body = "".join(
        f'<section id="{key}"><h2>{_e(name)}</h2>{content}</section>' for key, name, content in sections
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(heading)}</title><style>{CSS}</style></head><body>"
        f'<header><div class="kicker">pgdiag {_e(__version__)} · {_e(report.kind)} report · {_e(now)}</div>'
        f"<h1>{_e(heading)}</h1>{_verdict_block(status, verdict, findings)}<nav>{nav}</nav></header>"
        f"<main>{body}</main></body></html>\n"
    )


def check_html_path(path: str | Path, *, overwrite: bool = False) -> Path:
    """Refuse an `--html` destination before any work: a directory, or an existing file without `overwrite`."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(
            Code.OUTPUT_EXISTS, f"{path} is a directory", "give a file name for the page, e.g. report.html"
        )
    if path.exists() and not overwrite:
        raise UsageError(Code.OUTPUT_EXISTS, f"{path} exists", "pass --overwrite to replace it")
    return path


def write_html(report: Report, path: str | Path, *, overwrite: bool = False, **page: Any) -> Path:
    """Write `render_html(report, **page)` to `path` atomically (temp file, then rename); returns the path."""
    from pgdiag.data.writing import atomic_write

    path = check_html_path(path, overwrite=overwrite)
    text = render_html(report, **page)
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
