"""The tables of a `whatif` report's HTML page (`report.html.render_html` calls `whatif_tables`).

Per correction rule: the data it keeps and the ESS after it (row ``none``: the batch without correction), the
pg loss under each aggregation mode (its change under the rule), and where the rule hits (the fraction of tokens
per step, environment and position bucket, the largest of each rule highlighted).
"""

from __future__ import annotations

import polars as pl

from pgdiag.report.html_cells import _e, _num, _table
from pgdiag.report.report import Report


def _rule_parts(rule: str) -> tuple[str, str]:
    """`token_mis:0.5,2` -> (`token_mis`, `0.5,2`); `none` -> (`none`, `no correction`); a rule without parameters
    (`topr`) -> (`topr`, `defaults`)."""
    family, _, threshold = rule.partition(":")
    return family, threshold or ("no correction" if rule == "none" else "defaults")


def whatif_tables(report: Report) -> str:
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
