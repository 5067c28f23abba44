"""The tables of an `explain` report's HTML page (`report.html.render_html` calls `explain_tables`).

Read from the report's ``meta["explain"]`` (the `--json` block): the causes with their shares and the k3 and
mean |Δ| before and after each removal, the top cause per response-position bucket and per step, the
signature rules with their values and thresholds, and the configurations run or skipped.
"""

from __future__ import annotations

from typing import Any

from pgdiag.report.html_cells import _e, _num, _table
from pgdiag.report.report import Report


def explain_tables(report: Report) -> str:
    """HTML of the explain tables (module docstring)."""
    if report.meta.get("layers") and not report.meta.get("explain"):
        return _layers_table(report.meta["layers"])
    block: dict[str, Any] = report.meta.get("explain") or {}
    causes = block.get("causes") or []
    parts = [
        f'<p class="note">Pair {_e(" vs ".join(block.get("pair") or []))}: {_e(block.get("n_tokens"))} tokens, '
        f"k3 {_e(_num(block.get('k3'), 'nats'))}, mean |Δ| {_e(_num(block.get('abs_mean'), 'nats'))}. "
        "Causes are removed one after another in a fixed order; share = (k3 before − k3 after) / k3 of the "
        "pair. precision, batch_variance and routing are what the mismatch is consistent with (pgdiag "
        "measures its own kernels).</p>",
        '<h3 id="causes">Causes</h3>',
        _table(
            ("cause", "share", "k3 before", "k3 after", "|Δ| before", "|Δ| after"),
            [
                (
                    c["cause"],
                    f"{100 * c['share']:.1f} %",
                    _num(c["k3_before"], "nats"),
                    _num(c["k3_after"], "nats"),
                    _num(c["abs_mean_before"], "nats"),
                    _num(c["abs_mean_after"], "nats"),
                )
                for c in causes
            ],
        ),
    ]
    for key, title in (("by_position", "By response position"), ("by_step", "By step")):
        groups = block.get(key) or {}
        if groups:
            parts.append(f"<h3>{_e(title)}</h3>")
            parts.append(
                _table(
                    ("bucket", "top cause", "share", "second", "share"),
                    [
                        (
                            bucket,
                            rows[0]["cause"],
                            f"{100 * rows[0]['share']:.1f} %",
                            rows[1]["cause"] if len(rows) > 1 else "",
                            f"{100 * rows[1]['share']:.1f} %" if len(rows) > 1 else "",
                        )
                        for bucket, rows in groups.items()
                    ],
                )
            )
    signatures = block.get("signatures") or []
    if signatures:
        parts.append('<h3 id="signatures">Signatures</h3>')
        parts.append(
            _table(
                ("rule", "cause", "fired", "value", "threshold", "source"),
                [
                    (
                        s["name"],
                        s["cause"],
                        "yes" if s["fired"] else "no",
                        _num(s["value"]),
                        _num(s["threshold"]),
                        s["source"],
                    )
                    for s in signatures
                ],
                left=3,
            )
        )
    configs = ", ".join(block.get("configs") or []) or "none"
    skipped = "; ".join(f"{k}: {v}" for k, v in (block.get("skipped") or {}).items()) or "none"
    parts.append(
        f'<p class="note">Recompute tags: {_e(configs)}. Skipped: {_e(skipped)}. {_e(block.get("cost"))}</p>'
    )
    return "".join(parts)


def _layers_table(layers: dict[str, Any]) -> str:
    """The per-block errors of `explain --layers` and the first divergent layer."""
    first = layers.get("first_divergent")
    rows = [
        (
            "embed" if row["layer"] == -1 else str(row["layer"]),
            _num(row["cumulative"]),
            _num(row["local"]),
            "" if row.get("route_flips") is None else f"{100 * row['route_flips']:.2f} %",
        )
        for row in layers.get("rows") or []
    ]
    where = "none (the error is spread evenly)" if first is None else f"layer {first}"
    skipped = "".join(f" Skipped {_e(k)}: {_e(v)}." for k, v in (layers.get("skipped") or {}).items())
    return (
        f'<p class="note">{_e(layers.get("config_a"))} vs {_e(layers.get("config_b"))} on '
        f"{_e(layers.get('n_tokens'))} tokens. Cumulative error: each configuration fed by its own previous "
        "block; local error: the second configuration's block fed the first's input. First divergent layer "
        f"({_e(layers.get('rule'))}): {_e(where)}.{skipped}</p>"
        + _table(("layer", "cumulative", "local", "route flips"), rows)
    )
