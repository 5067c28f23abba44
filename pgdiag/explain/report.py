"""`ExplainResult` as a tidy `Report` (kind ``explain``) and its `Verdict`, for `--out`, `--html` and `pgdiag report`.

Rows: one per cause and group, metric ``explain/<cause>`` = its share (unit ``fraction``), breakdown ``all``,
``position`` (response-position bucket) or ``step``; plus ``explain/k3`` and ``explain/abs_mean`` of the pair
and ``explain/k3_after/<cause>`` (the k3 once the cause and those before it are removed) at breakdown ``all``.
"""

from __future__ import annotations

from pgdiag.explain.api import ExplainResult
from pgdiag.report.report import Report, ReportRow, summary_frame
from pgdiag.report.verdict import Verdict


def pair_name(result: ExplainResult) -> str:
    return f"{result.pair[0]} vs {result.pair[1]}"


def explain_report(result: ExplainResult) -> Report:
    """The report of one explain call (module docstring); its meta holds the `--json` block."""
    name, n = pair_name(result), result.n_tokens
    rows = [
        ReportRow(name, "token", "all", "all", "explain/k3", result.k3, "nats", "token-mean", n),
        ReportRow(name, "token", "all", "all", "explain/abs_mean", result.abs_mean, "nats", "token-mean", n),
    ]
    for cause in result.causes:
        rows.append(
            ReportRow(
                name, "token", "all", "all", f"explain/{cause.cause}", cause.share, "fraction", "share", n
            )
        )
        rows.append(
            ReportRow(
                name,
                "token",
                "all",
                "all",
                f"explain/k3_after/{cause.cause}",
                cause.k3_after,
                "nats",
                "token-mean",
                n,
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
