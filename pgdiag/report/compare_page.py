"""The tables of a `compare` report's HTML page (`report.html.render_html` calls `compare_tables` and
`worst_tables`).

The parity table of each pair (token and sequence scope; the headline statistics first, the others folded), each
run's own metrics (``--metrics``), one table per breakdown (buckets with n < `SMALL_BUCKET` in grey), and the
worst tokens and sequences (with their decoded text when the comparison had a tokenizer).
"""

from __future__ import annotations

import json

import polars as pl

from pgdiag.report.format import PARITY_HEADLINE_STATS
from pgdiag.report.html_cells import _e, _num, _table
from pgdiag.report.plots import SMALL_BUCKET
from pgdiag.report.report import Report

HEADLINE_STATS = PARITY_HEADLINE_STATS  # the parity table's first rows; the other statistics fold under them
BREAKDOWN_STATS = ("abs_mean", "abs_p99", "abs_max", "bias", "kl_k3", "frac_out_clip")


def compare_tables(report: Report) -> str:
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


def worst_tables(report: Report) -> str:
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
