"""Which streams `compute_metrics` reads: every role resolved against the run (docs/cli.md), and the pair names.

`resolve_streams` fills the stream names a `MetricSettings` leaves None from the run's streams (E111 when a
role cannot be filled), `metric_streams` lists the streams resolved settings read, `pair_names` the report's
policy and mismatch pair labels.
"""

from __future__ import annotations

from dataclasses import replace

from pgdiag.data.runs import Run
from pgdiag.data.schema import BASE_STREAMS
from pgdiag.errors import Code, UsageError, not_among
from pgdiag.metrics.settings import MetricSettings


def resolve_streams(run: Run, settings: MetricSettings) -> MetricSettings:
    """Settings with every stream name resolved against the run's streams (docs/cli.md).

    new: ``new``, else the single recompute tag, else exit 2 listing the streams; old: ``old``, else ``rollout``;
    mismatch pair: a = ``rollout``, b = ``old`` else ``new``; ref: ``ref`` when present; entropy: the new
    stream's entropy when it is a recompute tag that has one.
    """
    streams = set(run.streams)
    tags = [s for s in run.streams if s not in BASE_STREAMS]

    def need(name: str | None, what: str) -> str | None:
        if name is not None and name not in streams:
            message = f"{run.label}: no stream {name!r} for {what}"
            raise not_among(Code.STREAM_NOT_FOUND, message, "streams present", run.streams)
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
                Code.STREAM_NOT_FOUND,
                f"{run.label}: cannot tell which stream is the new policy (streams: {listed})",
                "run `pgdiag logprobs RUN --model CKPT` first, or name one with --new",
            )
    old = need(settings.old, "--old") or (
        "old" if "old" in streams else ("rollout" if "rollout" in streams else None)
    )
    if old is None:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"{run.label}: no old or rollout stream for the policy ratio",
            "name one with --old",
        )
    stream_a = need(settings.stream_a, "--stream-a") or ("rollout" if "rollout" in streams else None)
    stream_b = need(settings.stream_b, "--stream-b") or ("old" if "old" in streams else new)
    if stream_a is None or stream_a == stream_b:
        stream_a = stream_b = None
    ref = need(settings.ref, "--ref") or ("ref" if "ref" in streams else None)
    entropy = settings.entropy
    if entropy is not None and entropy not in run.entropy_streams:
        message = f"{run.label}: no entropy for stream {entropy!r}"
        raise not_among(Code.STREAM_NOT_FOUND, message, "streams with entropy", run.entropy_streams)
    if entropy is None and new in run.entropy_streams:
        entropy = new
    kept = next((s for s in (stream_b, stream_a, new) if s is not None and s in run.kept_tags), None)
    return replace(
        settings, new=new, old=old, stream_a=stream_a, stream_b=stream_b, ref=ref, entropy=entropy, kept=kept
    )


def pair_names(label: str, settings: MetricSettings) -> tuple[str, str | None]:
    policy = f"{label}:{settings.old} vs {label}:{settings.new}"
    mismatch = (
        None if settings.stream_a is None else f"{label}:{settings.stream_a} vs {label}:{settings.stream_b}"
    )
    return policy, mismatch


def metric_streams(settings: MetricSettings) -> list[str]:
    """The streams resolved `settings` read (new, old, the mismatch pair, ref), each once."""
    names = [settings.new, settings.old, settings.stream_a, settings.stream_b, settings.ref]
    return [s for s in dict.fromkeys(names) if s]
