"""`whatif`: replay off-policy correction rules on a saved batch and show what each one costs (docs/whatif.md).

The behaviour stream b (the engine that sampled, ``rollout``) and the target stream t (the trainer's ``old``)
give the per-token log ratio d = t − b, clamped to ±20 before any exponential exactly as verl does
(`SAFETY_BOUND`). Each rule turns d into a per-token weight w (what multiplies the token's pg loss) and a keep
flag (whether the token stays in the loss mask):

    token_tis C       w = min(e^d, C), keep all                          verl rollout_is="token", threshold C
    icepop A,B        w = e^d if A <= e^d <= B else 0, keep all          verl rollout_is="token", "A_B"; miles
    token_mis LO,HI   w = 1, keep iff log LO <= −d <= log HI             verl rollout_rs="token_k1", "LO_HI"
    seq_tis C         w = min(e^{clamp(Σd)}, C) on every token            verl rollout_is="sequence", threshold C
    seq_mis LO,HI     w = 1, keep iff log LO <= Σ(−d) <= log HI           verl rollout_rs="seq_sum_k1", "LO_HI"
    geo_mask LO,HI    w = 1, keep iff log LO <= mean(−d) <= log HI        verl rollout_rs="seq_mean_k1", "LO_HI"

A token is *affected* when its weight differs from the plain ratio's truncation-free value (TIS: e^d > C,
e^{Σd} > C) or it is dropped (IcePop weight 0, MIS/geo keep false). A sequence is affected when any of its
tokens is. Fractions of sequences count non-empty sequences only (verl's `seq_valid_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pgdiag.analysis.settings import POSITION_EDGES, CorrectionRule, WhatifSettings
from pgdiag.data.batch import TokenBatch
from pgdiag.data.load import read_token_batch
from pgdiag.data.runs import Run
from pgdiag.data.validate import CheckSettings
from pgdiag.errors import UsageError
from pgdiag.metrics.loss import GSPO_MODES, NATIVE_MODES, sample_weights
from pgdiag.report.report import Report, ReportRow, summary_frame

SAFETY_BOUND = 20.0  # verl rollout_corr_helper.SAFETY_BOUND: |log ratio| clamp before exp
LOSS_MODES = tuple(m for m in NATIVE_MODES if m not in GSPO_MODES)
_CANONICAL = ("rollout", "old", "ref", "new")


@dataclass(frozen=True)
class RuleEffect:
    """What one rule does to a batch: per-token weight and keep flag, per-token `affected` flag."""

    weight: np.ndarray  # (M,) float64, the factor on each token's pg loss (0 where dropped)
    keep: np.ndarray  # (M,) bool, token stays in the loss mask
    affected: np.ndarray  # (M,) bool, truncated or dropped


def _sample_of_token(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))


def _sums(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(S,) per-sample sums of the token array x (M,); 0 for an empty sample."""
    return np.bincount(_sample_of_token(offsets), weights=x, minlength=offsets.shape[0] - 1)


def apply_rule(rule: CorrectionRule, log_ratio: np.ndarray, offsets: np.ndarray) -> RuleEffect:
    """The weights and flags of `rule` on the per-token log ratio d = log π_target − log π_behavior (M,),
    samples delimited by `offsets` (S + 1,). Definitions in the module docstring."""
    safe = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)  # (M,)
    m = log_ratio.shape[0]
    ones = np.ones(m)
    all_kept = np.ones(m, dtype=bool)
    if rule.kind == "token_tis":
        ratio = np.exp(safe)
        return RuleEffect(np.minimum(ratio, rule.hi), all_kept, ratio > rule.hi)
    if rule.kind == "icepop":
        assert rule.lo is not None
        ratio = np.exp(safe)
        inside = (ratio >= rule.lo) & (ratio <= rule.hi)
        return RuleEffect(np.where(inside, ratio, 0.0), all_kept, ~inside)
    if rule.kind == "token_mis":
        assert rule.lo is not None
        k1 = -safe
        inside = (k1 >= math.log(rule.lo)) & (k1 <= math.log(rule.hi))
        return RuleEffect(ones, inside, ~inside)
    counts = np.diff(offsets)
    if rule.kind == "seq_tis":
        seq_ratio = np.exp(np.clip(_sums(log_ratio, offsets), -SAFETY_BOUND, SAFETY_BOUND))  # (S,)
        truncated = np.repeat(seq_ratio > rule.hi, counts)
        return RuleEffect(np.repeat(np.minimum(seq_ratio, rule.hi), counts), all_kept, truncated)
    assert rule.lo is not None
    k1_sum = _sums(-safe, offsets)  # (S,)
    # seq_mis: the sum; geo_mask: verl's masked_mean, sum / (count + 1e-8)
    stat = k1_sum if rule.kind == "seq_mis" else k1_sum / (counts + 1e-8)
    inside = np.repeat((stat >= math.log(rule.lo)) & (stat <= math.log(rule.hi)), counts)
    return RuleEffect(ones, inside, ~inside)


def kish_ess(weights: np.ndarray) -> float | None:
    """Normalised Kish ESS (Σw)² / (n Σw²) of non-negative weights; None when empty or all zero."""
    n = weights.shape[0]
    if n == 0:
        return None
    top = float(np.max(weights))
    if not top > 0 or not math.isfinite(top):
        return None
    w = weights / top
    return float(np.sum(w) ** 2 / (n * np.sum(w * w)))


def _seq_weights(effect: RuleEffect, offsets: np.ndarray, *, sequence_level: bool) -> np.ndarray:
    """(S,) the sequence weight a rule implies, scaled by the largest (for `kish_ess` only).

    A sequence-level rule puts one weight on all its tokens: that weight. A token-level rule implies the product of
    its kept tokens' weights (the sequence ratio after the rule). 0 when no token is kept or a weight is 0.
    """
    kept_w = np.where(effect.keep, effect.weight, 1.0)
    with np.errstate(divide="ignore"):
        log_w = _sums(np.log(kept_w), offsets)
    if sequence_level:  # every token carries the same weight: the mean of the logs is its log
        counts = np.diff(offsets)
        log_w = np.divide(log_w, counts, out=np.zeros_like(log_w), where=counts > 0)
    any_kept = _sums(effect.keep.astype(np.float64), offsets) > 0
    log_w = np.where(any_kept, log_w, -np.inf)
    top = np.max(log_w) if log_w.shape[0] else -np.inf
    if not np.isfinite(top):
        return np.zeros_like(log_w)
    return np.exp(log_w - top)


def _loss(
    batch: TokenBatch, weight: np.ndarray, keep: np.ndarray, mode: str, divisor: float | None
) -> float | None:
    """Aggregated pg loss −Σ_i c_i Σ_t A_t w_t at the first mini-batch (new = old), kept tokens only."""
    assert batch.advantages is not None
    n_per_sample = _sums(keep.astype(np.float64), batch.offsets)
    n_groups = int(batch.group_names.shape[0])
    c = sample_weights(mode, n_per_sample, batch.group, n_groups, batch.n_samples, divisor)
    if c is None:
        return None
    per_sample = _sums(np.where(keep, -batch.advantages * weight, 0.0), batch.offsets)
    return float(np.sum(c * per_sample))


def _position_bucket(resp_pos: np.ndarray) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    edges = np.asarray([*POSITION_EDGES, np.inf])
    index = np.clip(np.searchsorted(edges, resp_pos, side="right") - 1, 0, len(POSITION_EDGES) - 1)
    labels = [
        (
            f"[{POSITION_EDGES[i]},{'inf' if i + 1 == len(POSITION_EDGES) else POSITION_EDGES[i + 1]})",
            float(edges[i]),
            float(edges[i + 1]),
        )
        for i in range(len(POSITION_EDGES))
    ]
    return index, labels


def _fraction(flags: np.ndarray) -> float | None:
    return float(np.mean(flags)) if flags.shape[0] else None


def _localised(
    batch: TokenBatch, affected: np.ndarray
) -> Iterator[tuple[str, str, float | None, float | None, float | None, int]]:
    """(breakdown, bucket, lo, hi, token fraction affected, tokens) per step, env and response-position bucket."""
    tok_sample = _sample_of_token(batch.offsets)
    for step in np.unique(batch.step):
        rows = batch.step == step
        tok = rows[tok_sample]
        yield "step", str(int(step)), float(step), float(step), _fraction(affected[tok]), int(tok.sum())
    if batch.env is not None:
        for env in sorted(set(batch.env.tolist()), key=str):
            rows = batch.env == env
            tok = rows[tok_sample]
            yield "env", str(env), None, None, _fraction(affected[tok]), int(tok.sum())
    resp_pos = batch.pos.astype(np.int64) - batch.prompt_len[tok_sample].astype(np.int64)
    index, labels = _position_bucket(resp_pos)
    for i, (label, lo, hi) in enumerate(labels):
        tok = index == i
        if tok.any():
            yield "position", label, lo, hi, _fraction(affected[tok]), int(tok.sum())


def whatif_batch(
    batch: TokenBatch, settings: WhatifSettings, *, behavior: str, target: str
) -> list[ReportRow]:
    """Report rows of every rule of `settings` on an already read `batch` holding both streams."""
    pair = f"{batch.label}:{behavior} vs {batch.label}:{target}"
    log_ratio = batch.streams[target] - batch.streams[behavior]  # (M,)
    offsets = batch.offsets
    counts = np.diff(offsets)
    nonempty = counts > 0
    n_tok, n_seq = batch.n_tokens, int(nonempty.sum())
    plain = RuleEffect(
        np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)), np.ones(n_tok, bool), np.zeros(n_tok, bool)
    )
    ess_token_before = kish_ess(plain.weight)
    ess_seq_before = kish_ess(_seq_weights(plain, offsets, sequence_level=False)[nonempty])
    has_loss = batch.advantages is not None
    uncorrected = np.ones(n_tok)
    base_loss = {
        mode: _loss(batch, uncorrected, plain.keep, mode, settings.divisor) if has_loss else None
        for mode in LOSS_MODES
    }
    rows: list[ReportRow] = []

    def add(
        bucket: str, metric: str, value: float | None, unit: str, reduction: str, n: int, **kw: Any
    ) -> None:
        rows.append(ReportRow(pair, "token", "threshold", bucket, metric, value, unit, reduction, n, **kw))

    add("none", "whatif/ess_token", ess_token_before, "fraction", "token-mean", n_tok)
    add("none", "whatif/ess_seq", ess_seq_before, "fraction", "seq-mean", n_seq)
    for mode in LOSS_MODES:
        add("none", f"whatif/loss/{mode}", base_loss[mode], "loss", "sum", n_tok)
    for rule in settings.grid():
        effect = apply_rule(rule, log_ratio, offsets)
        dropped = ~effect.keep | (effect.weight == 0)
        seq_affected = (_sums(effect.affected.astype(np.float64), offsets) > 0)[nonempty]
        seq_w = _seq_weights(effect, offsets, sequence_level=rule.sequence_level)[nonempty]
        bucket = rule.label
        lo = rule.lo
        add(
            bucket,
            "whatif/tokens_affected",
            _fraction(effect.affected),
            "fraction",
            "token-mean",
            n_tok,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        add(
            bucket,
            "whatif/tokens_kept",
            _fraction(~dropped),
            "fraction",
            "token-mean",
            n_tok,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        add(
            bucket,
            "whatif/seqs_affected",
            _fraction(seq_affected),
            "fraction",
            "seq-mean",
            n_seq,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        add(
            bucket,
            "whatif/ess_token_before",
            ess_token_before,
            "fraction",
            "token-mean",
            n_tok,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        add(
            bucket,
            "whatif/ess_token_after",
            kish_ess(np.where(effect.keep, effect.weight, 0.0)),
            "fraction",
            "token-mean",
            n_tok,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        add(
            bucket,
            "whatif/ess_seq_before",
            ess_seq_before,
            "fraction",
            "seq-mean",
            n_seq,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        add(
            bucket,
            "whatif/ess_seq_after",
            kish_ess(seq_w),
            "fraction",
            "seq-mean",
            n_seq,
            bucket_lo=lo,
            bucket_hi=rule.hi,
        )
        for mode in LOSS_MODES:
            after = _loss(batch, effect.weight, effect.keep, mode, settings.divisor) if has_loss else None
            before = base_loss[mode]
            delta = None if after is None or before is None else after - before
            add(
                bucket,
                f"whatif/loss_delta/{mode}",
                delta,
                "loss",
                "sum",
                n_tok,
                bucket_lo=lo,
                bucket_hi=rule.hi,
            )
        for breakdown, where, b_lo, b_hi, value, n in _localised(batch, effect.affected):
            rows.append(
                ReportRow(
                    pair,
                    "token",
                    f"threshold/{breakdown}",
                    f"{bucket}|{where}",
                    "whatif/tokens_affected",
                    value,
                    "fraction",
                    "token-mean",
                    n,
                    b_lo,
                    b_hi,
                )
            )
    return rows


def resolve_whatif_streams(run: Run, settings: WhatifSettings) -> tuple[str, str]:
    """(behavior, target): behaviour as given (default ``rollout``); target as given, else ``old``, else the
    single recompute tag; exit 2 (E111) naming the streams present otherwise."""
    present = list(run.streams)
    listed = ", ".join(present) or "none"
    if settings.behavior not in present:
        raise UsageError(
            "E111",
            f"{run.label}: no behaviour stream {settings.behavior!r} for whatif",
            f"streams present: {listed}",
        )
    target = settings.target
    if target is not None and target not in present:
        raise UsageError(
            "E111", f"{run.label}: no stream {target!r} for --target", f"streams present: {listed}"
        )
    if target is None:
        tags = [s for s in present if s not in _CANONICAL]
        if "old" in present:
            target = "old"
        elif len(tags) == 1:
            target = tags[0]
        else:
            raise UsageError(
                "E111",
                f"{run.label}: cannot tell which stream is the target (streams: {listed})",
                "name one with --target",
            )
    if target == settings.behavior:
        raise UsageError("E503", f"--behavior and --target are the same stream {target!r}")
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
    run: Run, settings: WhatifSettings | None = None, *, checks: CheckSettings | None = None
) -> Report:
    """Replay every correction rule of `settings` (default grid when none) on `run`; a Report of kind "whatif"."""
    settings = settings or WhatifSettings()
    checks = checks or CheckSettings()
    behavior, target = resolve_whatif_streams(run, settings)
    loaded = read_token_batch(
        run, streams=[behavior, target], env=True, ignore=checks.ignore, max_examples=checks.max_examples
    )
    batch = loaded.batch
    rows = whatif_batch(batch, settings, behavior=behavior, target=target)
    meta = {
        "command": "whatif",
        "settings": {
            "behavior": behavior,
            "target": target,
            "rules": [r.label for r in settings.grid()],
            "divisor": settings.divisor,
        },
        "inputs": {
            "runs": [run.label],
            "paths": [str(p) for p in run.paths],
            "streams": [behavior, target],
            "n_samples": batch.n_samples,
            "n_tokens": batch.n_tokens,
            "ignored_codes": list(checks.ignore),
        },
        "pairs": [f"{run.label}:{behavior} vs {run.label}:{target}"],
    }
    return Report(kind="whatif", summary=summary_frame(rows), meta=meta, checks=loaded.checks.issues)
