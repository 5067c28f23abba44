"""Checks of a run's footers: what the importer and the recompute recorded about how log-probs were made.

W402 temperature disagreements · W403 processed log-probs with truncation · W405 re-tokenized ids · W408 TRL
without old log-probs · W409 unknown semantics or a recompute that fell back to T = 1 · W411 head dtypes differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pgdiag.data.runs import Run
from pgdiag.data.schema import stream_column
from pgdiag.data.validate import Issue
from pgdiag.errors import Code


def metadata_checks(
    meta: Mapping[str, Any], streams: Sequence[str], recompute_settings: Mapping[str, Mapping]
) -> list[Issue]:
    """Footer checks: W402 (temperature), W403 (processed with truncation), W405 (retokenized), W408 (TRL
    without old), W409 (unknown semantics), W411 (dtypes).

    `meta` is a decoded rollouts footer; `recompute_settings` maps recompute tags to their ``settings``.
    """
    issues: list[Issue] = []

    def warn(code: Code, text: str, hint: str | None = None) -> None:
        issues.append(Issue(code, "warning", 1, text, hint=hint))

    stream_meta = meta.get("streams") or {}
    sampling = meta.get("sampling") or {}
    truncated = (
        (sampling.get("top_p") not in (None, 1, 1.0))
        or (sampling.get("top_k") not in (None, 0, -1))
        or (sampling.get("min_p") not in (None, 0, 0.0))
    )
    if (meta.get("source") or {}).get("retokenized") is True:
        warn(Code.RETOKENIZED, "ids were re-tokenized from text; expect drift against engine ids")
    dtypes: dict[str, str] = {}
    for stream in streams:
        info = stream_meta.get(stream) or stream_meta.get(stream_column(stream))
        if stream in recompute_settings:
            recorded = recompute_settings[stream]
            if recorded.get("temperature_source") == "default":
                warn(Code.UNKNOWN_SEMANTICS, f"{stream}: recompute fell back to T = 1")
            sampled_t, recompute_t = sampling.get("temperature"), recorded.get("temperature")
            if (
                isinstance(sampled_t, int | float)
                and isinstance(recompute_t, int | float)
                and sampled_t != recompute_t
            ):
                warn(
                    Code.TEMPERATURE_METADATA,
                    f"rollout sampled at T={sampled_t:g} but {stream} used T={recompute_t:g}",
                    hint="recompute with --temperature auto or the sampling temperature",
                )
        elif isinstance(info, Mapping):
            recorded = info
            unknown = [key for key in ("tempered", "logprobs_mode") if info.get(key) == "unknown"]
            if unknown:
                warn(
                    Code.UNKNOWN_SEMANTICS,
                    f"{stream_column(stream)}: {' and '.join(unknown)} unknown",
                    hint="pass --tempered / --logprobs-mode to pgdiag import",
                )
            mode = info.get("logprobs_mode") or sampling.get("logprobs_mode")
            if mode == "processed" and truncated:
                warn(
                    Code.PROCESSED_LOGPROBS,
                    f"{stream_column(stream)}: processed log-probs with top-p/top-k/min-p truncation",
                    hint="log raw log-probs to compare with a trainer",
                )
        else:
            continue
        if recorded.get("head_dtype"):  # the recompute's settings, else the import's stream footer
            dtypes[stream] = str(recorded["head_dtype"])
    tempered = {s: (stream_meta.get(s) or {}).get("tempered") for s in streams if s not in recompute_settings}
    known = {s: t for s, t in tempered.items() if isinstance(t, bool)}
    sampled_t = sampling.get("temperature")
    if isinstance(sampled_t, int | float) and sampled_t != 1 and len(set(known.values())) > 1:
        text = ", ".join(f"{stream_column(s)} tempered={t}" for s, t in known.items())
        warn(
            Code.TEMPERATURE_METADATA, f"sampled at T={sampled_t:g} but streams disagree on tempering: {text}"
        )
    if (meta.get("source") or {}).get("framework") == "trl" and "old" not in streams:
        warn(
            Code.NO_OLD_STREAM,
            "old_logprobs absent: with one iteration only sampling log-probs describe the behaviour policy",
        )
    if len(set(dtypes.values())) > 1:
        text = " vs ".join(f"{s} head {d}" for s, d in dtypes.items())
        warn(Code.PRECISION_MISMATCH, f"precision mismatch: {text}")
    return issues


def recompute_settings(run: Run) -> dict[str, Mapping]:
    """The recorded ``settings`` of each recompute tag attached to `run` (from its first part's footer)."""
    import pyarrow.parquet as pq

    from pgdiag.data.schema import decode_footer

    out: dict[str, Mapping] = {}
    for tag, directory in run.recompute.items():
        parts = sorted(directory.rglob("*.parquet"))
        parts = [p for p in parts if not p.name.startswith(("_", "."))]
        if parts:
            meta = decode_footer(pq.read_schema(parts[0]).metadata).get("recompute") or {}
            out[tag] = meta.get("settings") or {} if isinstance(meta, Mapping) else {}
    return out
