"""The tables of `pgdiag compare`: the parity table, the breakdowns (-v), the worst tokens and the routing
attribution, on the results console."""

from __future__ import annotations

from typing import Any

from rich.console import Console

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


def render_routing(console: Console, attribution: Any, recompute: str, replay: str) -> None:
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
