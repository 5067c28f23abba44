"""`ExplainResult` as a tidy `Report` (kind ``explain``) and its `Verdict`, for `--out`, `--html` and `pgdiag report`.

Rows: one per cause and group, metric ``explain/<cause>`` = its share (unit ``fraction``), breakdown ``all``,
``position`` (response-position bucket) or ``step``; plus ``explain/k3`` and ``explain/abs_mean`` of the pair
and ``explain/k3_after/<cause>`` (the k3 once the cause and those before it are removed) at breakdown ``all``.
"""

from __future__ import annotations

from typing import Any

from pgdiag.explain.api import ExplainResult
from pgdiag.report.report import Report, ReportRow, summary_frame
from pgdiag.report.verdict import Verdict


def pair_name(result: ExplainResult) -> str:
    return f"{result.pair[0]} vs {result.pair[1]}"


def explain_report(result: ExplainResult) -> Report:
    """The report of one explain call (module docstring); its meta holds the `--json` block."""
    name, n = pair_name(result), result.n_tokens
    rows = [
        ReportRow.overall(name, "explain/k3", result.k3, "nats", "token-mean", n),
        ReportRow.overall(name, "explain/abs_mean", result.abs_mean, "nats", "token-mean", n),
    ]
    for cause in result.causes:
        rows.append(ReportRow.overall(name, f"explain/{cause.cause}", cause.share, "fraction", "share", n))
        rows.append(
            ReportRow.overall(
                name, f"explain/k3_after/{cause.cause}", cause.k3_after, "nats", "token-mean", n
            )
        )
    for breakdown, groups in (("position", result.by_position), ("step", result.by_step)):
        for bucket, causes in groups.items():
            for cause in causes:
                rows.append(
                    ReportRow(
                        name,
                        "token",
                        breakdown,
                        bucket,
                        f"explain/{cause.cause}",
                        cause.share,
                        "fraction",
                        "share",
                        n,
                    )
                )
    meta = {
        "pairs": [name],
        "explain": result.to_json(),
        "gate_policy": {"fail_on": [], "default_family": "explain", "known_metrics": []},
    }
    return Report(kind="explain", summary=summary_frame(rows), meta=meta)


def explain_verdict(result: ExplainResult) -> Verdict:
    """``explain <pair>: AGREE|EXPLAINED|UNEXPLAINED <the line naming the top cause, its share and fix>``."""
    if result.nothing_to_explain:
        status = "AGREE"
    else:
        status = "UNEXPLAINED" if result.top_cause == "unexplained" else "EXPLAINED"
    return Verdict("explain", status, f"explain {pair_name(result)}: {status} {result.verdict}")


def layers_report(found: Any) -> Report:
    """The report of `explain --layers`: rows ``layers/cumulative``, ``layers/local`` and ``layers/route_flips``
    per block (breakdown ``layer``, bucket = the block index, ``-1`` the embeddings); meta ``layers``."""
    name = f"{found.config_a} vs {found.config_b}"
    rows = []
    for row in found.rows:
        for metric, value, unit in (
            ("layers/cumulative", row.cumulative, "ratio"),
            ("layers/local", row.local, "ratio"),
            ("layers/route_flips", row.route_flips, "fraction"),
        ):
            if value is not None:
                rows.append(
                    ReportRow(
                        name, "token", "layer", str(row.layer), metric, value, unit, "rms", found.n_tokens
                    )
                )
    meta = {"pairs": [name], "layers": found.to_json()}
    return Report(kind="explain", summary=summary_frame(rows), meta=meta)


def layers_verdict(found: Any) -> Verdict:
    """``layers <A> vs <B>: DIVERGES at layer i`` or ``UNIFORM`` (no block stands out)."""
    name = f"{found.config_a} vs {found.config_b}"
    if found.first_divergent is None:
        return Verdict(
            "explain",
            "UNIFORM",
            f"layers {name}: UNIFORM no block's local error stands out (spread evenly, as precision noise is)",
        )
    row = next(r for r in found.rows if r.layer == found.first_divergent)
    return Verdict(
        "explain",
        "DIVERGES",
        f"layers {name}: DIVERGES first at layer {found.first_divergent} (local error {row.local:.3g})",
    )
