"""The one line a person reads first: the verdict of `metrics`, `compare`, `whatif`, `drift` and `check`.

What: `metrics_verdict(report)` lists the anomalies of a metrics report, each with its step (ESS below 0.1,
ratio max above 10, a KL jump, binding clip fraction above 0.2, an empty step); `compare_verdict(report, gates)`
says AGREE or DISAGREE with the worst statistic and where it is worst (position bucket, step, token);
`whatif_verdict(report)` names the correction rules that drop more than 5% of the tokens, else the rule that
touches the most, each with the step that loses the most; `drift_verdict(report)` lists the change points, each
with its step, series and jump; `check_verdict(result)` says clean or names the first problem;
`report_verdict(report, gates)` is the verdict of a saved report of any kind. Why: a table of 100 numbers hides
the one that matters; the CLI prints `Verdict.line` last, `--json`, saved reports and the HTML page carry
`Verdict.as_dict()`, and notebooks call the same functions. How: thresholds live in the frozen
`VerdictThresholds` (docs/cli.md lists them); a verdict only reads a report, it never changes an exit code (gates
do that).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import polars as pl

from pgdiag.data.validate import CheckResult
from pgdiag.report.findings import Finding
from pgdiag.report.gates import GateResult
from pgdiag.report.report import Report


@dataclass(frozen=True)
class VerdictThresholds:
    """Where a value becomes an anomaly (metrics) or a disagreement (compare, when no gate was given)."""

    ess_min: float = 0.1  # policy/ess_token below this: a few tokens carry the whole update
    ratio_max: float = 10.0  # policy/ratio_max above this
    kl_jump_factor: float = 10.0  # policy/kl_k3 of a step above this times the median of the steps ...
    kl_jump_floor: float = 1e-3  # ... and above this many nats
    clip_frac_max: float = 0.2  # policy/clip_frac_binding above this
    whatif_lost_max: float = 0.05  # a correction rule that drops more than this fraction of the loss tokens
    # compare without gates: the fail thresholds of `--profile recommended`
    agree: tuple[tuple[str, float], ...] = (
        ("mismatch/abs_mean", 0.02),
        ("mismatch/kl_k3", 1e-2),
        ("mismatch/tmpe", 1.05),
        ("mismatch/frac_out_2x", 1e-3),
    )


@dataclass(frozen=True)
class Verdict:
    """A command's verdict: its status word, the one line printed last, and the findings behind it."""

    command: str  # metrics | compare | whatif | drift | check
    # metrics: clean|anomalies; drift: clean|anomalies|NO DATA; compare: AGREE|DISAGREE|NO DATA;
    # whatif: clean|warnings|NO DATA;
    # check: clean|warnings|errors
    status: str
    line: str
    findings: tuple[Finding, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict (`--json`'s ``verdict``, saved reports)."""
        return {
            "command": self.command,
            "status": self.status,
            "line": self.line,
            "findings": [asdict(f) for f in self.findings],
        }


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.3g}"


def _per_step(report: Report, metric: str) -> list[tuple[str, float]]:
    frame = report.summary.filter(
        (pl.col("breakdown") == "step") & (pl.col("metric") == metric) & pl.col("value").is_not_null()
    )
    return [(str(b), float(v)) for b, v in frame.select("bucket", "value").iter_rows()]


def _joined(findings: Sequence[Finding], limit: int = 3) -> str:
    shown = "; ".join(f.message for f in findings[:limit])
    more = len(findings) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


def metrics_verdict(report: Report, thresholds: VerdictThresholds = VerdictThresholds()) -> Verdict:
    """The anomalies of a metrics report, per step, in step order (see `VerdictThresholds`)."""
    t = thresholds
    findings: list[Finding] = []
    for step in report.meta.get("steps", []):
        if str(step.get("step")) != "all" and step.get("status", "ok") != "ok":
            findings.append(
                Finding(
                    "empty_step",
                    None,
                    str(step["step"]),
                    None,
                    None,
                    f"step {step['step']}: {step['status']}",
                )
            )
    for bucket, value in _per_step(report, "count/tokens"):
        if value == 0 and not any(f.step == bucket for f in findings):
            findings.append(Finding("empty_step", "count/tokens", bucket, 0.0, None, f"step {bucket}: empty"))
    limits = (  # (kind, metric, threshold, whether the anomaly is a value below it)
        ("ess_low", "policy/ess_token", t.ess_min, True),
        ("ratio_max", "policy/ratio_max", t.ratio_max, False),
        ("clip_frac", "policy/clip_frac_binding", t.clip_frac_max, False),
    )
    for kind, metric, limit, below in limits:
        for bucket, value in _per_step(report, metric):
            if value < limit if below else value > limit:
                sign = "<" if below else ">"
                message = f"step {bucket}: {metric} {_fmt(value)} {sign} {_fmt(limit)}"
                findings.append(Finding(kind, metric, bucket, value, limit, message))
    kl = _per_step(report, "policy/kl_k3")
    if len(kl) >= 2:
        median = statistics.median(v for _, v in kl)
        limit = max(t.kl_jump_factor * median, t.kl_jump_floor)
        for bucket, value in kl:
            if value > limit:
                findings.append(
                    Finding(
                        "kl_jump",
                        "policy/kl_k3",
                        bucket,
                        value,
                        limit,
                        f"step {bucket}: policy/kl_k3 jumps to {_fmt(value)} nats "
                        f"(median of the steps {_fmt(median)})",
                    )
                )
    findings.sort(key=lambda f: (_step_key(f.step), f.kind))
    if findings:
        noun = "anomaly" if len(findings) == 1 else "anomalies"
        return Verdict(
            "metrics", "anomalies", f"metrics: {len(findings)} {noun}: {_joined(findings)}", tuple(findings)
        )
    checked = "policy/ess_token" in report.summary["metric"].to_list()
    line = (
        "metrics: no anomaly (ESS, ratio max, KL jumps, binding clip fraction, empty steps)"
        if checked
        else "metrics: no empty step; the anomaly checks read native keys (run without --key-style)"
    )
    return Verdict("metrics", "clean", line)


def _step_key(step: str | None) -> tuple[int, float | str]:
    if step is None:
        return (0, 0.0)
    try:
        return (1, float(step))
    except ValueError:
        return (2, step)


def _excess(metric: str, value: float, threshold: float) -> float:
    """How far past its threshold a value is, on a common scale (1 = at the threshold)."""
    if metric.endswith("/tmpe"):  # a ratio >= 1: compare the distance from 1
        return (value - 1.0) / (threshold - 1.0)
    return value / threshold


def _worst_bucket(report: Report, pair: str, breakdown: str, metric: str) -> tuple[str, float, int] | None:
    frame = report.summary.filter(
        (pl.col("pair") == pair)
        & (pl.col("scope") == "token")
        & (pl.col("breakdown") == breakdown)
        & (pl.col("metric") == metric)
        & pl.col("value").is_not_null()
    )
    if frame.height == 0:
        return None
    bucket, value, n = frame.sort("value", descending=True).select("bucket", "value", "n").row(0)
    return str(bucket), float(value), int(n)


def _where(report: Report, pair: str, metric: str) -> str:
    """Where `metric` is worst: position bucket, step and the worst token."""
    parts = []
    position = _worst_bucket(report, pair, "position", metric)
    if position is not None:
        parts.append(f"position {position[0]} ({_fmt(position[1])}, n={position[2]:,})")
    step = _worst_bucket(report, pair, "step", metric)
    if step is not None:
        parts.append(f"step {step[0]} ({_fmt(step[1])})")
    tokens = report.worst_tokens
    if tokens is not None and tokens.height:
        rows = tokens.filter(pl.col("pair") == pair) if "pair" in tokens.columns else tokens
        if rows.height:
            row = rows.row(0, named=True)
            text = row.get("context") or row.get("text")
            token = (
                f"token step {row['step']} sample {row['sample_id']} pos {row['pos']} (Δ {_fmt(row['dlogp'])}"
            )
            token += f", {text!r})" if text else ")"
            parts.append(token)
    return "worst at " + ", ".join(parts) if parts else ""


def compare_verdict(
    report: Report, gates: GateResult | None = None, thresholds: VerdictThresholds = VerdictThresholds()
) -> Verdict:
    """AGREE or DISAGREE: by the fail gates when any ran, else by `thresholds.agree` (the recommended profile's
    fail thresholds) on the pooled token-scope rows. Names the worst statistic and where it is worst."""
    pooled = report.summary.filter(
        (pl.col("breakdown") == "all") & (pl.col("scope") == "token") & pl.col("value").is_not_null()
    )
    values = {(p, m): float(v) for p, m, v in pooled.select("pair", "metric", "value").iter_rows()}
    pairs = [p for p in report.meta.get("pairs", []) if any(k[0] == p for k in values)]
    gate_list = gates.gates if gates is not None else ()
    failing = [g for g in gate_list if g.kind == "fail" and g.status in ("fail", "missing")]
    if failing:
        gate_findings = tuple(
            Finding(
                "disagree",
                g.metric,
                None,
                g.value,
                None,
                f"{g.pair + ': ' if g.pair else ''}gate {g.expr} ({_fmt(g.value)})",
            )
            for g in failing
        )
        first = failing[0]
        where = _where(report, first.pair, first.metric) if first.pair and first.metric else ""
        line = f"compare: DISAGREE ({len(gate_list)} gates): {_joined(gate_findings)}"
        return Verdict("compare", "DISAGREE", line + (f"; {where}" if where else ""), gate_findings)
    # no fail gate triggered: the worst statistic relative to the agreement thresholds
    findings: list[Finding] = []
    worst: tuple[float, str, str, float, float] | None = None  # (excess, pair, metric, value, threshold)
    for pair in pairs:
        for metric, threshold in thresholds.agree:
            value = values.get((pair, metric))
            if value is None:
                continue
            excess = _excess(metric, value, threshold)
            if worst is None or excess > worst[0]:
                worst = (excess, pair, metric, value, threshold)
            if value > threshold and not gate_list:
                findings.append(
                    Finding(
                        "disagree",
                        metric,
                        None,
                        value,
                        threshold,
                        f"{pair}: {metric} {_fmt(value)} > {_fmt(threshold)}",
                    )
                )
    if worst is None:
        return Verdict("compare", "NO DATA", "compare: NO DATA (no parity statistic could be computed)")
    _, pair, metric, value, threshold = worst
    where = _where(report, pair, metric)
    if gate_list:
        status, basis = "AGREE", f"{len(gate_list)} gates passed"
    else:
        status = "DISAGREE" if findings else "AGREE"
        basis = "recommended thresholds"
    relation = ">" if value > threshold else "≤"
    line = f"compare: {status} ({basis}): worst {metric} {_fmt(value)} {relation} {_fmt(threshold)}"
    if len(pairs) > 1:
        line += f" [{pair}]"
    if where:
        line += f"; {where}"
    return Verdict("compare", status, line, tuple(findings))


def _percent(value: float) -> str:
    return f"{100 * value:.3g}%"


def _worst_step(report: Report, rule: str) -> tuple[str, float] | None:
    """The step where `rule` affects the largest fraction of the tokens (first such step), with that fraction."""
    frame = report.summary.filter(
        (pl.col("breakdown") == "threshold/step")
        & pl.col("bucket").str.starts_with(f"{rule}|")
        & pl.col("value").is_not_null()
    )
    if frame.height == 0:
        return None
    bucket, value = frame.sort("value", descending=True, maintain_order=True).select("bucket", "value").row(0)
    return str(bucket).split("|", 1)[1], float(value)


def whatif_verdict(report: Report, thresholds: VerdictThresholds = VerdictThresholds()) -> Verdict:
    """`warnings` when a correction rule drops more than `whatif_lost_max` of the loss tokens (1 − tokens kept)
    or the uncorrected token ESS is below `ess_min`, else `clean`. The line names those rules (most data lost
    first), or else the rule that truncates or drops the most tokens, each with its worst step, and the
    uncorrected ESS."""
    t = thresholds
    rows = report.summary.filter(pl.col("breakdown") == "threshold")
    values = {(b, m): v for b, m, v in rows.select("bucket", "metric", "value").iter_rows()}
    rules = [b for b in rows["bucket"].unique(maintain_order=True).to_list() if b != "none"]
    if not rules:
        return Verdict("whatif", "NO DATA", "whatif: NO DATA (no correction rule in the report)")

    def where(rule: str) -> str:
        worst = _worst_step(report, rule)
        return f" (worst step {worst[0]}: {_percent(worst[1])})" if worst is not None and worst[1] > 0 else ""

    def sequences(rule: str) -> str:
        seqs = values.get((rule, "whatif/seqs_affected"))
        return f", {_percent(seqs)} of the sequences" if seqs is not None else ""

    ess_token, ess_seq = values.get(("none", "whatif/ess_token")), values.get(("none", "whatif/ess_seq"))
    ess = f"uncorrected ESS: token {_fmt(ess_token)}, sequence {_fmt(ess_seq)}"
    findings: list[Finding] = []
    if ess_token is not None and ess_token < t.ess_min:
        findings.append(
            Finding(
                "ess_low",
                "whatif/ess_token",
                None,
                ess_token,
                t.ess_min,
                f"uncorrected token ESS {_fmt(ess_token)} < {_fmt(t.ess_min)}",
            )
        )
    lossy = [
        (rule, kept)
        for rule in rules
        if (kept := values.get((rule, "whatif/tokens_kept"))) is not None and kept < 1.0 - t.whatif_lost_max
    ]
    lossy.sort(key=lambda item: item[1])  # the most data lost first
    for rule, kept in lossy:
        findings.append(
            Finding(
                "data_lost",
                "whatif/tokens_kept",
                None,
                kept,
                1.0 - t.whatif_lost_max,
                f"{rule} drops {_percent(1.0 - kept)} of the tokens{sequences(rule)}{where(rule)}",
            )
        )
    from pgdiag.report.whatif_findings import whatif_signal_findings

    findings += whatif_signal_findings(report)
    if findings:
        head = (
            f"{len(lossy)} of {len(rules)} rules drop more than {_percent(t.whatif_lost_max)} of the tokens"
            if lossy
            else f"no rule drops more than {_percent(t.whatif_lost_max)} of the tokens"
        )
        return Verdict("whatif", "warnings", f"whatif: {head}: {_joined(findings)}; {ess}", tuple(findings))
    touched = [(values.get((r, "whatif/tokens_affected")) or 0.0, r) for r in rules]
    top, rule = max(touched, key=lambda item: item[0])
    most = (
        f"most affected: {rule} truncates or drops {_percent(top)} of the tokens{sequences(rule)}{where(rule)}"
        if top > 0
        else "no rule truncates or drops any token"
    )
    line = (
        f"whatif: no rule of {len(rules)} drops more than {_percent(t.whatif_lost_max)} of the tokens; "
        f"{most}; {ess}"
    )
    return Verdict("whatif", "clean", line)


def drift_verdict(report: Report) -> Verdict:
    """`anomalies` when change points were found, each with its step, series, the levels before and after and
    its z score (in step order); `NO DATA` when the run has too few steps to search; else `clean` with the steps
    and series searched."""
    meta = report.meta.get("change_points") or {}
    found = sorted(meta.get("found") or [], key=lambda cp: (int(cp["step"]), str(cp["metric"])))
    n_steps = len((report.meta.get("inputs") or {}).get("steps") or [])
    findings = tuple(
        Finding(
            "change_point",
            str(cp["metric"]),
            str(cp["step"]),
            float(cp["jump"]),
            None,
            f"step {cp['step']}: {cp['metric']} {_fmt(cp['before'])} → {_fmt(cp['after'])} "
            f"(jump {float(cp['jump']):+.3g}, z {float(cp['score']):.1f})",
        )
        for cp in found
    )
    if findings:
        noun = "change point" if len(findings) == 1 else "change points"
        line = f"drift: {len(findings)} {noun} over {n_steps} steps: {_joined(findings)}"
        return Verdict("drift", "anomalies", line, findings)
    min_steps = meta.get("min_steps")
    if min_steps is not None and n_steps < int(min_steps):  # no series was searched
        line = f"drift: NO DATA: {n_steps} steps, fewer than the {min_steps} a change-point search needs"
        return Verdict("drift", "NO DATA", line)
    series = meta.get("series")
    searched = f" in {len(series)} series" if series is not None else ""
    threshold = meta.get("threshold")
    rule = f" (z ≥ {_fmt(threshold)})" if threshold is not None else ""
    return Verdict("drift", "clean", f"drift: no change point{searched} over {n_steps} steps{rule}")


def report_verdict(report: Report, gates: GateResult | None = None) -> Verdict:
    """The verdict of a saved report of any kind, from its stored values (`gates`: compare's fail gates; None:
    the report's default gates, as `outcome` applies them)."""
    if report.kind == "compare":
        if gates is None:
            from pgdiag.report.gates import outcome

            gates = outcome(report).gates
        return compare_verdict(report, gates)
    if report.kind == "whatif":
        return whatif_verdict(report)
    if report.kind == "drift":
        return drift_verdict(report)
    return metrics_verdict(report)


def check_verdict(result: CheckResult) -> Verdict:
    """clean, or the first problem (errors before warnings) with its code."""
    rows = result.issues.select("code", "severity", "message").rows()
    findings = tuple(
        Finding(sev, None, None, None, None, f"{sev}[{code}] {message}") for code, sev, message in rows
    )
    if result.n_errors:
        first = next(f for f in findings if f.kind == "error")
        status, extra = (
            "errors",
            f"{_count(result.n_errors, 'error')}, {_count(result.n_warnings, 'warning')}",
        )
    elif result.n_warnings:
        first = findings[0]
        status, extra = "warnings", _count(result.n_warnings, "warning")
    else:
        return Verdict("check", "clean", "check: clean")
    return Verdict("check", status, f"check: {status} ({extra}); first: {first.message}", findings)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
