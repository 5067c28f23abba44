"""`whatif`: replay off-policy correction rules on a saved run and show what each one costs (docs/whatif.md).

The rules and their replay are in `pgdiag.analysis.replay` (the classic kinds) and `pgdiag.analysis.rules` (the
landed corrections); `whatif` reads the run in pieces of whole steps (`pgdiag.data.reader`) and folds them
(`pgdiag.analysis.whatif_fold.WhatifFold`), so memory follows a piece, not the run.
"""

from __future__ import annotations

from typing import Any

from pgdiag.analysis.replay import apply_rule, kish_ess, not_applicable, rule_effect
from pgdiag.analysis.settings import WhatifSettings
from pgdiag.analysis.whatif_fold import WhatifFold
from pgdiag.data.batch import TokenBatch
from pgdiag.data.load import read_token_batch
from pgdiag.data.reader import PieceReader
from pgdiag.data.runs import Run
from pgdiag.data.schema import BASE_STREAMS
from pgdiag.data.validate import CheckSettings
from pgdiag.data.versions import TokenLag, token_lag
from pgdiag.errors import Code, UsageError
from pgdiag.report.report import Report, ReportRow, summary_frame

__all__ = [
    "apply_rule",
    "kish_ess",
    "resolve_whatif_streams",
    "rule_effect",
    "whatif",
    "whatif_batch",
    "worst_buckets",
]
MIN_PIECE_ROWS = 4096  # a piece holds at least this many rows, or the largest step (as `metrics` reads)


def whatif_batch(
    batch: TokenBatch,
    settings: WhatifSettings,
    *,
    behavior: str,
    target: str,
    new: str | None = None,
    lag: TokenLag | None = None,
) -> list[ReportRow]:
    """Report rows of every rule of `settings` on an already read `batch` holding both streams (and `new`, the
    policy after an update, for the proximal→θ rules): the fold of one piece."""
    pair = f"{batch.label}:{behavior} vs {batch.label}:{target}"
    later = f"{batch.label}:{target} vs {batch.label}:{new}"
    fold = WhatifFold(settings, behavior=behavior, target=target, new=new, pair=pair, later=later)
    fold.add(batch, lag)
    return fold.finish()


def resolve_whatif_streams(run: Run, settings: WhatifSettings) -> tuple[str, str]:
    """(behavior, target): behaviour as given (default ``rollout``); target as given, else ``old``, else the
    single recompute tag; exit 2 (E111) naming the streams present otherwise."""
    present = list(run.streams)
    listed = ", ".join(present) or "none"
    if settings.behavior not in present:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"{run.label}: no behaviour stream {settings.behavior!r} for whatif",
            f"streams present: {listed}",
        )
    target = settings.target
    if target is not None and target not in present:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"{run.label}: no stream {target!r} for --target",
            f"streams present: {listed}",
        )
    if target is None:
        tags = [s for s in present if s not in BASE_STREAMS]
        if "old" in present:
            target = "old"
        elif len(tags) == 1:
            target = tags[0]
        else:
            raise UsageError(
                Code.STREAM_NOT_FOUND,
                f"{run.label}: cannot tell which stream is the target (streams: {listed})",
                "name one with --target",
            )
    if target == settings.behavior:
        raise UsageError(Code.BAD_OPTION_VALUE, f"--behavior and --target are the same stream {target!r}")
    return settings.behavior, target


def worst_buckets(report: Report, top: int = 3) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per rule and breakdown (step, env, position), the `top` buckets with the largest affected fraction."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    local = report.summary.filter(report.summary["breakdown"].str.starts_with("threshold/"))
    for breakdown, bucket, value, n in local.select("breakdown", "bucket", "value", "n").iter_rows():
        rule, where = bucket.split("|", 1)
        out.setdefault(rule, {}).setdefault(breakdown.split("/", 1)[1], []).append(
            {"bucket": where, "tokens_affected": value, "n": n}
        )
    for per_rule in out.values():
        for key, items in per_rule.items():
            items.sort(key=lambda item: -(item["tokens_affected"] or 0.0))
            per_rule[key] = items[:top]
    return out


def whatif(
    run: Run,
    settings: WhatifSettings | None = None,
    *,
    checks: CheckSettings | None = None,
    max_rows: int | None = None,
) -> Report:
    """Replay every correction rule of `settings` (default grid when none) on `run`; a Report of kind "whatif".

    The run is read in pieces of whole steps of at most `max_rows` rows (None: the largest step, at least
    `MIN_PIECE_ROWS`), each replayed and folded (`WhatifFold`); the pieces' checks are merged and the run's first
    error raised after the last piece (`PieceReader`)."""
    settings = settings or WhatifSettings()
    checks = checks or CheckSettings()
    behavior, target = resolve_whatif_streams(run, settings)
    new = "new" if "new" in run.streams and "new" not in (behavior, target) else None
    streams = [behavior, target] + ([new] if new else [])
    if any(r.kind == "ref_kl" for r in settings.grid()) and "ref" in run.streams and "ref" not in streams:
        streams.append("ref")  # prime-rl's ref_kl reads it as its advantage

    def read(piece: Run, many: bool) -> Any:
        return read_token_batch(
            piece,
            streams=streams,
            env=True,
            ignore=checks.ignore,
            max_examples=checks.max_examples,
            piece=many,
            raise_errors=not many,
        )

    def budget(rows_per_step: dict[int, int]) -> int:
        return max_rows if max_rows is not None else max([MIN_PIECE_ROWS, *rows_per_step.values()])

    pair = f"{run.label}:{behavior} vs {run.label}:{target}"
    fold = WhatifFold(
        settings,
        behavior=behavior,
        target=target,
        new=new,
        pair=pair,
        later=f"{run.label}:{target} vs {run.label}:{new}",
    )
    reader = PieceReader.planned(run, budget, read)
    lags: list[TokenLag] = []
    for piece in reader:
        lag = token_lag(piece.run, piece.batch)
        fold.add(piece.batch, lag)
        lags += [lag] if lag is not None else []
        del piece, lag  # the piece's token arrays go before the reader reads the next one (peak memory)
    found = reader.finish()
    return Report(
        kind="whatif",
        summary=summary_frame(fold.finish()),
        meta=_meta(run, settings, checks, streams, (behavior, target, new), lags, fold)
        | {"pieces": reader.n_pieces},
        checks=found.issues,
    )


def _meta(
    run: Run,
    settings: WhatifSettings,
    checks: CheckSettings,
    streams: list[str],
    pair: tuple[str, str, str | None],
    lags: list[TokenLag],
    fold: WhatifFold,
) -> dict[str, Any]:
    behavior, target, new = pair
    rules = settings.grid()
    lag = lags[0] if lags else None
    return {
        "command": "whatif",
        "settings": {
            "behavior": behavior,
            "target": target,
            "rules": [r.label for r in rules],
            "pairs": {r.label: r.pair for r in rules},
            "not_applicable": {
                r.label: reason for r in rules if (reason := not_applicable(r, streams, new)) is not None
            },
            "divisor": settings.divisor,
            "lag": None
            if lag is None
            else {
                "preset": lag.preset,
                "offset": lag.offset,
                "offset_verified": lag.verified,
                "per_token_versions": any(part.per_token for part in lags),
                "unknown_reason": lag.unknown_reason,
            },
        },
        "inputs": {
            "runs": [run.label],
            "paths": [str(p) for p in run.paths],
            "streams": streams,
            "n_samples": fold.n_samples,
            "n_tokens": fold.n_tok,
            "ignored_codes": list(checks.ignore),
        },
        "pairs": [f"{run.label}:{behavior} vs {run.label}:{target}"],
    }
