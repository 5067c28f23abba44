"""A one-file HTML report of `metrics`, `compare`, `whatif` or `drift`: verdict, tables, plots, worst tokens, checks,
settings.

What: `render_html(report, verdict=..., plot_set=...)` returns one self-contained page: the verdict line at the
top, the report's tables (metric families per step; the parity table and its breakdowns; the correction rules
with the data they keep, ESS, loss changes and where they hit; the change points and the per-step series), the
plots as base64 PNG images, the worst tokens and sequences (with their decoded text when the comparison had a
tokenizer), the checks and the settings. `write_html` writes it atomically (temp file, then rename).
Why: a reviewer opens one file, offline, in any browser: no network, no JavaScript, no files beside it.
How: every user string (labels, ids, paths, messages, token text) is HTML-escaped; the page's CSS is inline.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from pgdiag.errors import Code, UsageError
from pgdiag.report.format import PARITY_HEADLINE_STATS
from pgdiag.report.html_cells import _e, _num, _table
from pgdiag.report.plots import SMALL_BUCKET, Mark, PlotSet, figure_bytes
from pgdiag.report.report import Report

FAMILY_ORDER = ("policy", "loss", "mismatch", "advantage", "entropy", "group", "grad", "count")
COLLAPSED_FAMILIES = ("grad", "count")  # long and rarely read first: folded
HEADLINE_STATS = PARITY_HEADLINE_STATS  # the parity table's first rows; the other statistics fold under them
BREAKDOWN_STATS = ("abs_mean", "abs_p99", "abs_max", "bias", "kl_k3", "frac_out_clip")
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


def _metrics_tables(report: Report, marks: Sequence[Mark]) -> str:
    summary = report.summary
    steps = summary.filter(pl.col("breakdown") == "step")["bucket"].unique(maintain_order=True).to_list()
    per_step = {
        (bucket, metric): value
        for bucket, metric, value in summary.filter(pl.col("breakdown") == "step")
        .select("bucket", "metric", "value")
        .iter_rows()
    }
    marked = {(m.metric, str(m.step)): m.label for m in marks}
    pooled = summary.filter(pl.col("breakdown") == "all")
    families: dict[str, list[tuple[str, str, float | None, str]]] = {}
    for pair, metric, value, unit in pooled.select("pair", "metric", "value", "unit").iter_rows():
        family = metric.split("/", 1)[0] if "/" in metric else "metrics"
        families.setdefault(family, []).append((pair, metric, value, unit))
    last = len(FAMILY_ORDER)
    ordered = sorted(families, key=lambda f: FAMILY_ORDER.index(f) if f in FAMILY_ORDER else last - 2.5)
    parts = []
    for family in ordered:
        rows = families[family]
        pairs = sorted({r[0] for r in rows})
        body = []
        for _pair, metric, value, unit in rows:
            cells = [metric, _num(value, unit)]
            for step in steps:
                text = _num(per_step.get((step, metric)), unit)
                label = marked.get((metric, str(step)))
                cells.append(f'<td class="anomaly" title="{_e(label)}">{_e(text)}</td>' if label else text)
            cells.append(f'<td class="unit">{_e(unit)}</td>')
            body.append(cells)
        table = _table(["metric", "all", *[f"step {s}" for s in steps], "unit"], body)
        heading = f"{_e(family)} <span class='note'>({_e(', '.join(pairs))})</span>"
        if family in COLLAPSED_FAMILIES:
            parts.append(f"<details><summary>{heading}: {len(rows)} metrics</summary>{table}</details>")
        else:
            parts.append(f"<h3>{heading}</h3>{table}")
    return "".join(parts)


def _compare_tables(report: Report) -> str:
    summary = report.summary
    rows = summary.filter(pl.col("breakdown") == "all")
    parts: list[str] = []
    blocks: list[str] = []
    for pair in rows["pair"].unique(maintain_order=True).to_list():
        part = rows.filter(pl.col("pair") == pair)
        scopes = part["scope"].unique().to_list()
        if scopes == ["batch"]:
            continue
        cells = {(s, m): (v, u) for s, m, v, u in part.select("scope", "metric", "value", "unit").iter_rows()}
        metrics = [
            m for m in part["metric"].unique(maintain_order=True).to_list() if m.startswith("mismatch/")
        ]
        body, rest = [], []
        for metric in metrics:
            tok, seq = cells.get(("token", metric)), cells.get(("sequence", metric))
            unit = (tok or seq)[1]
            stat = metric.split("/", 1)[1]
            (body if stat in HEADLINE_STATS else rest).append(
                [
                    stat,
                    "" if tok is None else _num(tok[0], unit),
                    "" if seq is None else _num(seq[0], unit),
                    f'<td class="unit">{_e(unit)}</td>',
                ]
            )
        body.sort(key=lambda row: HEADLINE_STATS.index(row[0]))
        n_tok = cells.get(("token", "count/mismatch_tokens"), (None, ""))[0]
        n_seq = cells.get(("sequence", "count/samples"), (None, ""))[0]
        blocks.append(
            f"<div><h3>parity <span class='note'>{_e(pair)}<br>Δ = lp_b − lp_a; {_num(n_tok, 'count')} "
            f"tokens, {_num(n_seq, 'count')} sequences</span></h3>"
            + _table(["statistic", "token", "sequence", "unit"], body)
            + f"<details><summary>{len(rest)} more statistics</summary>"
            + _table(["statistic", "token", "sequence", "unit"], rest)
            + "</details></div>"
        )
    batch = rows.filter(pl.col("scope") == "batch")
    if batch.height:
        body = [
            [p, m, _num(v, u), f'<td class="unit">{_e(u)}</td>']
            for p, m, v, u in batch.select("pair", "metric", "value", "unit").iter_rows()
        ]
        parts.append("<details><summary>each run's own metrics (--metrics)</summary>")
        parts.append(_table(["run", "metric", "all", "unit"], body, left=2) + "</details>")
    breakdowns = summary.filter(
        (pl.col("scope") == "token") & ~pl.col("breakdown").is_in(["all", "dlogp"]) & (pl.col("pair") != "")
    )
    for (pair, breakdown), part in breakdowns.group_by(["pair", "breakdown"], maintain_order=True):
        wide = part.pivot(on="metric", index=["bucket", "bucket_lo", "n"], values="value").sort("bucket_lo")
        body, small = [], []
        for row in wide.iter_rows(named=True):
            body.append(
                [str(row["bucket"]), _num(row["n"], "count")]
                + [_num(row.get(f"mismatch/{s}")) for s in BREAKDOWN_STATS]
            )
            small.append(int(row["n"] or 0) < SMALL_BUCKET)
        blocks.append(
            f"<div><h3>by {_e(breakdown)} <span class='note'>{_e(pair)}<br>grey rows: n &lt; {SMALL_BUCKET}"
            "</span></h3>" + _table(["bucket", "n", *BREAKDOWN_STATS], body, small=small) + "</div>"
        )
    return f'<div class="blocks">{"".join(blocks)}</div>' + "".join(parts)


def _rule_parts(rule: str) -> tuple[str, str]:
    """`token_mis:0.5,2` -> (`token_mis`, `0.5,2`); `none` -> (`none`, `no correction`); a rule without parameters
    (`topr`) -> (`topr`, `defaults`)."""
    family, _, threshold = rule.partition(":")
    return family, threshold or ("no correction" if rule == "none" else "defaults")


def _whatif_tables(report: Report) -> str:
    summary = report.summary
    rules = summary.filter(pl.col("breakdown") == "threshold")
    cells = {(b, m): v for b, m, v in rules.select("bucket", "metric", "value").iter_rows()}
    buckets = rules["bucket"].unique(maintain_order=True).to_list()
    n_tok = rules.filter(pl.col("metric") == "whatif/ess_token")["n"].to_list()
    n_seq = rules.filter(pl.col("metric") == "whatif/ess_seq")["n"].to_list()
    size = f"{_num(n_tok[0], 'count')} tokens, {_num(n_seq[0], 'count')} sequences" if n_tok and n_seq else ""
    parts = [
        f"<h3>data kept and ESS <span class='note'>({_e(', '.join(report.meta.get('pairs', [])))}"
        f"{'; ' + size if size else ''}; row <code>none</code>: the batch without correction)</span></h3>"
    ]
    kept_columns = (
        ("whatif/tokens_affected", "tokens hit"),
        ("whatif/seqs_affected", "sequences hit"),
        ("whatif/tokens_kept", "tokens kept"),
        ("whatif/ess_token_after", "token ESS after"),
        ("whatif/ess_seq_after", "sequence ESS after"),
    )
    before = {"whatif/ess_token_after": "whatif/ess_token", "whatif/ess_seq_after": "whatif/ess_seq"}
    body = []
    for bucket in buckets:
        row = [*_rule_parts(bucket)]
        for metric, _ in kept_columns:
            key = before.get(metric, metric) if bucket == "none" else metric
            row.append(_num(cells.get((bucket, key)), "fraction"))
        body.append(row)
    parts.append(_table(["rule", "threshold", *[h for _, h in kept_columns]], body, left=2))
    loss_metrics = [
        m for m in rules["metric"].unique(maintain_order=True).to_list() if m.startswith("whatif/loss")
    ]
    modes = list(dict.fromkeys(m.rsplit("/", 1)[1] for m in loss_metrics))
    if modes:
        body = []
        for bucket in buckets:
            prefix = "whatif/loss" if bucket == "none" else "whatif/loss_delta"
            body.append(
                [*_rule_parts(bucket), *[_num(cells.get((bucket, f"{prefix}/{m}")), "loss") for m in modes]]
            )
        parts.append(
            "<h3>pg loss under each aggregation mode <span class='note'>(row <code>none</code>: the loss "
            "without correction; the others: its change under the rule, at the first mini-batch)</span></h3>"
        )
        parts.append(_table(["rule", "threshold", *modes], body, left=2))
    for breakdown in ("step", "env", "position"):
        local = summary.filter(pl.col("breakdown") == f"threshold/{breakdown}")
        if local.height == 0:
            continue
        split = local.with_columns(
            pl.col("bucket").str.split_exact("|", 1).struct.rename_fields(["rule", "where"]).alias("_parts")
        ).unnest("_parts")
        places = (
            split.select("where", "bucket_lo", "n").unique("where", keep="first", maintain_order=True)
            .sort("bucket_lo", nulls_last=True, maintain_order=True)
        )  # fmt: skip
        header = ["rule", "threshold", f"worst {breakdown}"]
        header += [f"{where} (n={_num(n, 'count')})" for where, _, n in places.iter_rows()]
        values = {(r, w): v for r, w, v in split.select("rule", "where", "value").iter_rows()}
        body = []
        for rule in split["rule"].unique(maintain_order=True).to_list():
            row_values = [values.get((rule, where)) for where, _, _ in places.iter_rows()]
            known = [v for v in row_values if v is not None]
            top = max(known) if known else None
            worst_at = next(
                (w for (w, _, _), v in zip(places.iter_rows(), row_values, strict=True) if v == top), None
            )
            row = [*_rule_parts(rule), f"{worst_at} ({_num(top, 'fraction')})" if top else "—"]
            for value in row_values:
                text = _num(value, "fraction")
                row.append(f'<td class="worst">{_e(text)}</td>' if top and value == top else text)
            body.append(row)
        parts.append(
            f"<h3>where: fraction of tokens hit per {_e(breakdown)} <span class='note'>(the largest of each "
            "rule highlighted)</span></h3>"
        )
        parts.append(_table(header, body, left=2))
    return "".join(parts)


def _series_table(
    per_step: Mapping[tuple[str, str], float | None],
    units: Mapping[str, str],
    steps: Sequence[str],
    metrics: Sequence[str],
    marked: Mapping[tuple[str, str], str],
) -> str:
    """Rows = steps, columns = `metrics` (with their units); cells in `marked` are red with the label as tooltip."""
    header = ["step", *[f"{m} ({units[m]})" if units.get(m) else m for m in metrics]]
    body = []
    for step in steps:
        row = [step]
        for metric in metrics:
            text = _num(per_step.get((step, metric)), units.get(metric, ""))
            label = marked.get((metric, step))
            row.append(f'<td class="anomaly" title="{_e(label)}">{_e(text)}</td>' if label else text)
        body.append(row)
    return _table(header, body)


def _drift_tables(report: Report, marks: Sequence[Mark]) -> str:
    summary = report.summary
    meta = report.meta.get("change_points") or {}
    found = meta.get("found") or []
    score = {(str(cp["metric"]), str(cp["step"])): cp.get("score") for cp in found}
    points = summary.filter(pl.col("breakdown") == "changepoint")
    parts = [
        f"<h3>change points <span class='note'>({len(found)}; {_e(meta.get('method', ''))}, z ≥ "
        f"{_e(_num(meta.get('threshold')))}; the step is the first of the new level)</span></h3>"
    ]
    if points.height:
        body = [
            [
                str(step), metric, pair, _num(lo, unit), _num(hi, unit), _num(jump, unit),
                _num(score.get((metric, str(step)))), f'<td class="unit">{_e(unit)}</td>',
            ]
            for step, metric, pair, lo, hi, jump, unit in points.select(
                "bucket", "metric", "pair", "bucket_lo", "bucket_hi", "value", "unit"
            ).iter_rows()
        ]  # fmt: skip
        parts.append(_table(["step", "metric", "pair", "before", "after", "jump", "z", "unit"], body, left=3))
    else:
        parts.append("<p class='note'>No change point: no searched series changed level.</p>")
    rows = summary.filter(pl.col("breakdown") == "step")
    steps = sorted(
        rows["bucket"].unique().to_list(), key=lambda b: (int(b) if b.lstrip("-").isdigit() else 0, b)
    )
    per_step = {(b, m): v for b, m, v in rows.select("bucket", "metric", "value").iter_rows()}
    units = dict(rows.select("metric", "unit").unique("metric", keep="first").iter_rows())
    present = rows["metric"].unique(maintain_order=True).to_list()
    # the series searched (older reports: those with a change point)
    series = list(
        dict.fromkeys(
            [*(m for m in meta.get("series") or [] if m in present), *(str(cp["metric"]) for cp in found)]
        )
    )
    marked = {(m.metric, str(m.step)): m.label for m in marks}
    if series:
        parts.append(
            "<h3>per-step series searched for change points <span class='note'>(red: the first step of a new "
            "level)</span></h3>"
        )
        parts.append(_series_table(per_step, units, steps, series, marked))
    families: dict[str, list[str]] = {}
    for metric in present:
        families.setdefault(metric.split("/", 1)[0] if "/" in metric else "metrics", []).append(metric)
    for family, metrics in families.items():
        parts.append(
            f"<details><summary>{_e(family)} per step: {len(metrics)} metrics</summary>"
            + _series_table(per_step, units, steps, metrics, marked)
            + "</details>"
        )
    return "".join(parts)


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


def _worst(report: Report) -> str:
    parts = []
    tokens = report.worst_tokens
    if tokens is not None and tokens.height:
        has_text = "context" in tokens.columns and tokens["context"].is_not_null().any()
        has_token_text = "token_text" in tokens.columns and tokens["token_text"].is_not_null().any()
        text_column = "token_text" if has_token_text else None
        header = ["step", "sample", "pos", "resp pos", "token id"]
        header += ["token text"] if text_column else []
        header += ["lp_a", "lp_b", "Δ"] + (["context (±8 loss tokens)"] if has_text else [])
        body = []
        for row in tokens.iter_rows(named=True):
            cells = [
                str(row["step"]),
                str(row["sample_id"]),
                str(row["pos"]),
                str(row.get("resp_pos", "")),
                str(row.get("token_id", "")),
            ]
            if text_column:
                text = row[text_column]  # quoted: a token's leading space or newline stays visible
                cells.append(
                    f'<td class="text">{_e("" if text is None else json.dumps(text, ensure_ascii=False))}</td>'
                )
            cells += [_num(row["lp_a"]), _num(row["lp_b"]), _num(row["dlogp"])]
            if has_text:
                cells.append(f'<td class="text">{_e(row["context"] or "")}</td>')
            body.append(cells)
        parts.append(f"<h3>worst tokens <span class='note'>(largest |Δ|, {tokens.height})</span></h3>")
        if not has_text and not text_column:
            parts.append("<p class='note'>Token text: rerun compare with --tokenizer PATH.</p>")
        parts.append(_table(header, body, left=2))
    seqs = report.worst_seqs
    if seqs is not None and seqs.height:
        columns = [
            c
            for c in (
                "step",
                "sample_id",
                "n_tokens",
                "dlogp_sum",
                "dlogp_mean",
                "abs_dlogp_max",
                "reward",
                "env",
            )
            if c in seqs.columns
        ]
        body = [
            [
                str(row[c])
                if c in ("step", "sample_id", "env")
                else _num(row[c], "count" if c == "n_tokens" else "")
                for c in columns
            ]
            for row in seqs.iter_rows(named=True)
        ]
        parts.append(f"<h3>worst sequences <span class='note'>(largest |Σ Δ|, {seqs.height})</span></h3>")
        parts.append(_table(columns, body, left=2))
    return "".join(parts) or "<p class='note'>No worst-token tables in this report.</p>"


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
        tables = _metrics_tables(report, marks)
    elif report.kind == "whatif":
        tables = _whatif_tables(report)
    elif report.kind == "drift":
        tables = _drift_tables(report, marks)
    elif report.kind == "explain":
        from pgdiag.report.explain_page import explain_tables

        tables = explain_tables(report)
    else:
        tables = _compare_tables(report)
    sections = [
        ("tables", "Tables", tables),
        ("plots", "Plots", _plots(plot_set)),
    ]
    if report.kind == "compare":
        sections.append(("worst", "Worst tokens", _worst(report)))
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
