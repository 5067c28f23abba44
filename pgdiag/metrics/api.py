"""`compute_metrics`: read a run, check it, compute the metric set per step and pooled, return a `Report`.

This is the library function behind `pgdiag metrics` (the CLI only parses options and renders). It resolves
which streams feed which family (docs/cli.md), reads only those columns, validates them (errors
raise `InvalidInputError`, warnings land in `Report.checks`), then runs the native engine (docs/metrics.md)
or a framework key style on every step and on the pooled ``all`` row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.runs import Run, read_token_batch
from pgdiag.data.validate import CheckSettings
from pgdiag.errors import UsageError
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.gates import gate_policy
from pgdiag.report.report import Report, ReportRow, summary_frame

_CANONICAL = ("rollout", "old", "ref", "new")


def resolve_streams(run: Run, settings: MetricSettings) -> MetricSettings:
    """Settings with every stream name resolved against the run's streams (docs/cli.md).

    new: ``new``, else the single recompute tag, else exit 2 listing the streams; old: ``old``, else ``rollout``;
    mismatch pair: a = ``rollout``, b = ``old`` else ``new``; ref: ``ref`` when present; entropy: the new
    stream's entropy when it is a recompute tag that has one.
    """
    streams = set(run.streams)
    tags = [s for s in run.streams if s not in _CANONICAL]

    def need(name: str | None, what: str) -> str | None:
        if name is not None and name not in streams:
            raise UsageError(
                "E111",
                f"{run.label}: no stream {name!r} for {what}",
                f"streams present: {', '.join(run.streams) or 'none'}",
            )
        return name

    new = need(settings.new, "--new")
    if new is None:
        if "new" in streams:
            new = "new"
        elif len(tags) == 1:
            new = tags[0]
        else:
            listed = ", ".join(run.streams) or "none"
            raise UsageError(
                "E111",
                f"{run.label}: cannot tell which stream is the new policy (streams: {listed})",
                "run `pgdiag logprobs RUN --model CKPT` first, or name one with --new",
            )
    old = need(settings.old, "--old") or (
        "old" if "old" in streams else ("rollout" if "rollout" in streams else None)
    )
    if old is None:
        raise UsageError(
            "E111", f"{run.label}: no old or rollout stream for the policy ratio", "name one with --old"
        )
    stream_a = need(settings.stream_a, "--stream-a") or ("rollout" if "rollout" in streams else None)
    stream_b = need(settings.stream_b, "--stream-b") or ("old" if "old" in streams else new)
    if stream_a is None or stream_a == stream_b:
        stream_a = stream_b = None
    ref = need(settings.ref, "--ref") or ("ref" if "ref" in streams else None)
    entropy = settings.entropy
    if entropy is not None and entropy not in run.entropy_streams:
        raise UsageError(
            "E111",
            f"{run.label}: no entropy for stream {entropy!r}",
            f"streams with entropy: {', '.join(run.entropy_streams) or 'none'}",
        )
    if entropy is None and new in run.entropy_streams:
        entropy = new
    return replace(settings, new=new, old=old, stream_a=stream_a, stream_b=stream_b, ref=ref, entropy=entropy)


def _pair_names(label: str, settings: MetricSettings) -> tuple[str, str | None]:
    policy = f"{label}:{settings.old} vs {label}:{settings.new}"
    mismatch = (
        None if settings.stream_a is None else f"{label}:{settings.stream_a} vs {label}:{settings.stream_b}"
    )
    return policy, mismatch


def default_gates(settings: MetricSettings) -> dict[str, Any]:
    """The gates `metrics` always applies (docs/cli.md): no invalid token, and under `identity` the step-0
    identity check; native metric names are valid gate names even where this report lacks them."""
    from pgdiag.metrics.catalog import METRIC_CATALOG

    if settings.key_style != "pgdiag":
        return gate_policy()
    fail = ["count/tokens_invalid>0"]
    if settings.identity:
        fail.append(f"policy/logratio_absmax>{settings.identity_tol!r}")
    return gate_policy(fail_on=fail, known_metrics=[spec.key for spec in METRIC_CATALOG])


def compute_metrics(
    run: Run,
    settings: MetricSettings | None = None,
    *,
    checks: CheckSettings | None = None,
    **options: Any,
) -> Report:
    """The full metric set of `run`, per step and pooled (``all``), as a `Report`.

    `settings` is a `MetricSettings`; without it, flat keyword options build one
    (``compute_metrics(run, aggregation="constant", divisor=40960, eps_low=0.1)``, `MetricSettings.from_options`).
    `checks` names the check codes to ignore and the examples per issue. Every aggregation mode is always
    reported (``loss/<mode>``); `settings.aggregation` picks the headline ``loss/pg``.
    """
    if settings is None:
        settings = MetricSettings.from_options(**options)
    elif options:
        raise UsageError("E514", "give either a MetricSettings or keyword options, not both")
    checks = checks or CheckSettings()
    settings = resolve_streams(run, settings)

    loaded = read_token_batch(
        run,
        streams=metric_streams(settings),
        entropy=[settings.entropy] if settings.entropy else [],
        ignore=checks.ignore,
        max_examples=checks.max_examples,
    )
    return metrics_report(loaded.batch, settings, run=run, checks=loaded.checks.issues, ignored=checks.ignore)


def metric_streams(settings: MetricSettings) -> list[str]:
    """The streams resolved `settings` read (new, old, the mismatch pair, ref), each once."""
    names = [settings.new, settings.old, settings.stream_a, settings.stream_b, settings.ref]
    return [s for s in dict.fromkeys(names) if s]


def metrics_report(
    batch: TokenBatch,
    settings: MetricSettings,
    *,
    run: Run,
    checks: pl.DataFrame | None = None,
    ignored: Sequence[str] = (),
) -> Report:
    """The metric set of an already read and validated `batch` of `run` under stream-resolved `settings`
    (`resolve_streams`); `compare --metrics` calls it on the batch it read, so no run is read twice."""
    from pgdiag.metrics.engine import compute_by_step, compute_native
    from pgdiag.metrics.styles import compute_step_style

    if settings.key_style == "pgdiag":
        results = compute_native(batch, settings)
    else:
        results = compute_by_step(
            batch,
            settings,
            lambda step, s, n_split: compute_step_style(step, s, groups_split=n_split, partials=True),
        )

    policy_pair, mismatch_pair = _pair_names(run.label, settings)
    rows: list[ReportRow] = []
    steps_meta: list[dict[str, Any]] = []
    notices: list[str] = []
    for step_label, step in results:
        breakdown, bucket = ("all", "all") if step_label == "all" else ("step", str(step_label))
        steps_meta.append({"step": step_label, "status": step.status})
        notices.extend(n for n in step.notices if n not in notices)
        for v in step.values:
            pair = mismatch_pair if (v.key.startswith("mismatch/") and mismatch_pair) else policy_pair
            rows.append(ReportRow(pair, "token", breakdown, bucket, v.key, v.value, v.unit, v.reduction, v.n))

    meta = {
        "command": "metrics",
        "settings": settings.to_dict(),
        "inputs": {
            "runs": [run.label],
            "paths": [str(p) for p in run.paths],
            "streams": metric_streams(settings),
            "entropy": settings.entropy,
            "n_samples": batch.n_samples,
            "n_tokens": batch.n_tokens,
            "ignored_codes": list(ignored),
        },
        "pairs": [p for p in (policy_pair, mismatch_pair) if p],
        "gate_policy": default_gates(settings),
        "steps": steps_meta,
        "notices": notices,
    }
    if checks is None:
        return Report(kind="metrics", summary=summary_frame(rows), meta=meta)
    return Report(kind="metrics", summary=summary_frame(rows), meta=meta, checks=checks)
