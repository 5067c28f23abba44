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
from collections.abc import Sequence
from typing import Any

import numpy as np

from pgdiag.analysis.losses import loss_parity_rows
from pgdiag.analysis.rules import (
    PROXIMAL_THETA,
    Replay,
    RuleEffect,
    apply_named_rule,
    segment_sums,
    verl_chain,
)
from pgdiag.analysis.settings import RULE_KINDS, CorrectionRule, WhatifSettings, parse_losses
from pgdiag.analysis.signal import batch_weights, psis_rows, rule_signal, zero_advantage_groups
from pgdiag.analysis.staleness import staleness_rows
from pgdiag.analysis.where import Localiser
from pgdiag.data.batch import TokenBatch
from pgdiag.data.load import read_token_batch
from pgdiag.data.runs import Run
from pgdiag.data.schema import BASE_STREAMS
from pgdiag.data.validate import CheckSettings
from pgdiag.data.versions import TokenLag, token_lag
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.loss import GSPO_MODES, NATIVE_MODES, sample_weights
from pgdiag.report.report import Report, ReportRow, summary_frame

SAFETY_BOUND = 20.0  # verl rollout_corr_helper.SAFETY_BOUND: |log ratio| clamp before exp
LOSS_MODES = tuple(m for m in NATIVE_MODES if m not in GSPO_MODES)


def _sample_of_token(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))


def _sums(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(S,) per-sample sums of the token array x (M,); 0 for an empty sample."""
    return segment_sums(x, offsets)


def apply_rule(rule: CorrectionRule, log_ratio: np.ndarray, offsets: np.ndarray) -> RuleEffect:
    """The weights and flags of `rule` on the per-token log ratio d = log π_target − log π_behavior (M,),
    samples delimited by `offsets` (S + 1,). Definitions in the module docstring."""
    assert rule.hi is not None
    safe = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)  # (M,)
    m = log_ratio.shape[0]
    ones = np.ones(m)
    all_kept = np.ones(m, dtype=bool)
    if rule.kind == "token_tis":
        ratio = np.exp(safe)
        return RuleEffect(np.minimum(ratio, rule.hi), all_kept, ratio > rule.hi, ratio)
    if rule.kind == "icepop":
        assert rule.lo is not None
        ratio = np.exp(safe)
        inside = (ratio >= rule.lo) & (ratio <= rule.hi)
        return RuleEffect(np.where(inside, ratio, 0.0), all_kept, ~inside, ratio)
    if rule.kind == "token_mis":  # verl's token_k1, decided in float32 as verl does (rules._verl_rs)
        assert rule.lo is not None
        k1 = -safe.astype(np.float32)
        inside = (k1 >= np.float32(math.log(rule.lo))) & (k1 <= np.float32(math.log(rule.hi)))
        return RuleEffect(ones, inside, ~inside)
    counts = np.diff(offsets)
    if rule.kind == "seq_tis":
        seq_ratio = np.exp(np.clip(_sums(log_ratio, offsets), -SAFETY_BOUND, SAFETY_BOUND))  # (S,)
        truncated = np.repeat(seq_ratio > rule.hi, counts)
        raw = np.repeat(seq_ratio, counts)
        return RuleEffect(np.repeat(np.minimum(seq_ratio, rule.hi), counts), all_kept, truncated, raw)
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


def _losses(
    batch: TokenBatch, weight: np.ndarray, keep: np.ndarray, divisor: float | None
) -> dict[str, float | None]:
    """Aggregated pg loss −Σ_i c_i Σ_t A_t w_t under every mode at the first mini-batch (new = old), kept tokens
    only; None for a mode whose weights are not computable."""
    assert batch.advantages is not None
    n_per_sample = _sums(keep.astype(np.float64), batch.offsets)
    n_groups = int(batch.group_names.shape[0])
    per_sample = _sums(np.where(keep, -batch.advantages * weight, 0.0), batch.offsets)
    out: dict[str, float | None] = {}
    for mode in LOSS_MODES:
        c = sample_weights(mode, n_per_sample, batch.group, n_groups, batch.n_samples, divisor)
        out[mode] = None if c is None else float(np.sum(c * per_sample))
    return out


def _fraction(flags: np.ndarray) -> float | None:
    return float(np.mean(flags)) if flags.shape[0] else None


_COUNTS = ("whatif/nonfinite_log_ratio", "whatif/log_ratio_beyond_", "whatif/zero_advantage_groups")
_SEQ_RATIOS = ("whatif/chi2_seq", "whatif/seq_weight_")
_TOKEN_RATIOS = ("whatif/weight_", "whatif/token_ratio_mean", "whatif/grad_coef_ratio")


def metric_unit(metric: str) -> tuple[str, str]:
    """(unit, reduction) of a whatif metric of docs/whatif.md."""
    if "/loss" in metric:
        return "loss", "sum"
    if metric.startswith(_COUNTS):
        return "count", "sum"
    if metric.startswith(_SEQ_RATIOS):
        return "ratio", "seq-mean"
    if metric.startswith(_TOKEN_RATIOS):
        return "ratio", "token-mean"
    if metric == "whatif/length_collapse":
        return "flag", "seq-median"
    if metric.startswith("whatif/signal_kept"):
        return "fraction", "token-sum"
    return "fraction", "seq-mean" if "seq" in metric else "token-mean"


def _replay(batch: TokenBatch, base: str, cur: str) -> Replay:
    return Replay(
        base=batch.streams[base],
        cur=batch.streams[cur],
        offsets=batch.offsets,
        step=batch.step,
        pos=batch.pos,
        advantages=batch.advantages,
        reward=batch.reward,
        sample_of_token=batch.token_sample(),
        ref=batch.streams.get("ref"),
    )


def rule_effect(rule: CorrectionRule, replay: Replay) -> RuleEffect:
    """The effect of any rule (classic kind, named rule or verl chain) on its pair's replay."""
    if rule.kind in RULE_KINDS:
        return apply_rule(rule, replay.log_ratio, replay.offsets)
    if rule.kind == "verl_chain":
        options = []
        for part in rule.args:
            name, _, text = part.partition(":")
            options.append((name, tuple(float(x) for x in text.split(","))))
        return verl_chain(options, replay)
    return apply_named_rule(rule.kind, rule.args, replay)


def not_applicable(rule: CorrectionRule, streams: Sequence[str], new: str | None) -> str | None:
    """Why `rule` cannot be replayed on this batch (None: it can)."""
    if rule.kind == "ref_kl" and "ref" not in streams:
        return "needs a `ref` stream: prime-rl's ref_kl takes log π_ref − log π_θ as its advantage"
    if rule.pair == PROXIMAL_THETA and new is None:
        return (
            "acts on proximal→θ, which is exactly 1 at new = old: record a `new` stream after an update "
            "(or compare loss forms with compare --losses)"
        )
    return None


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
    policy after an update, for the proximal→θ rules)."""
    pair = f"{batch.label}:{behavior} vs {batch.label}:{target}"
    later = f"{batch.label}:{target} vs {batch.label}:{new}"
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
    base_loss = (
        _losses(batch, uncorrected, plain.keep, settings.divisor) if has_loss else dict.fromkeys(LOSS_MODES)
    )
    localiser = Localiser.of(batch, lag)
    replays = {False: _replay(batch, behavior, target)}
    if new is not None:
        replays[True] = _replay(batch, target, new)
    rows: list[ReportRow] = []

    def add(
        bucket: str, metric: str, value: float | None, n: int, rule: CorrectionRule | None = None
    ) -> None:
        unit, reduction = metric_unit(metric)
        on = later if rule is not None and rule.pair == PROXIMAL_THETA else pair
        lo = rule.lo if rule is not None else None
        hi = rule.hi if rule is not None else None
        rows.append(ReportRow(on, "token", "threshold", bucket, metric, value, unit, reduction, n, lo, hi))

    add("none", "whatif/ess_token", ess_token_before, n_tok)
    add("none", "whatif/ess_seq", ess_seq_before, n_seq)
    for mode in LOSS_MODES:
        add("none", f"whatif/loss/{mode}", base_loss[mode], n_tok)
    for metric, value in batch_weights(log_ratio, offsets).items():
        add("none", metric, value, n_tok)
    if has_loss:
        assert batch.advantages is not None
        groups = zero_advantage_groups(
            batch.advantages, batch.group[batch.token_sample()], len(batch.group_names)
        )
        add("none", "whatif/zero_advantage_groups", float(groups), n_seq)
    rows.extend(psis_rows(batch, log_ratio, pair))
    if settings.losses is not None and has_loss:
        forms = parse_losses(settings.losses)
        rows += loss_parity_rows(batch, forms, replays, rule_effect, settings.divisor, pair)
    if lag is not None:
        rows += staleness_rows(batch, lag, behavior=behavior, target=target, new=new, pair=pair, later=later)
    for rule in settings.grid():
        bucket = rule.label
        effect = (
            None
            if not_applicable(rule, list(batch.streams), new)
            else rule_effect(rule, replays[rule.pair == PROXIMAL_THETA])
        )
        metrics = _rule_metrics(batch, rule, effect, settings, base_loss, ess_token_before, ess_seq_before)
        for metric, value in metrics.items():
            add(bucket, metric, value, n_seq if metric_unit(metric)[1].startswith("seq") else n_tok, rule)
        if effect is None:
            continue
        for breakdown, where, b_lo, b_hi, value, n in localiser.affected(effect.affected):
            rows.append(
                ReportRow(
                    pair if rule.pair != PROXIMAL_THETA else later,
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


def _rule_metrics(
    batch: TokenBatch,
    rule: CorrectionRule,
    effect: RuleEffect | None,
    settings: WhatifSettings,
    base_loss: dict[str, float | None],
    ess_token_before: float | None,
    ess_seq_before: float | None,
) -> dict[str, float | None]:
    """Every per-rule metric of docs/whatif.md; all None when the rule is n/a on this batch."""
    offsets = batch.offsets
    nonempty = np.diff(offsets) > 0
    metrics: dict[str, float | None] = {
        "whatif/ess_token_before": ess_token_before,
        "whatif/ess_seq_before": ess_seq_before,
    }
    if effect is None:
        names = ("tokens_affected", "tokens_kept", "seqs_affected", "ess_token_after", "ess_seq_after")
        return {**metrics, **{f"whatif/{n}": None for n in names}}
    dropped = ~effect.keep | (effect.weight == 0)
    seq_affected = (_sums(effect.affected.astype(np.float64), offsets) > 0)[nonempty]
    seq_w = _seq_weights(effect, offsets, sequence_level=rule.sequence_level)[nonempty]
    metrics |= {
        "whatif/tokens_affected": _fraction(effect.affected),
        "whatif/tokens_kept": _fraction(~dropped),
        "whatif/seqs_affected": _fraction(seq_affected),
        "whatif/ess_token_after": kish_ess(np.where(effect.keep, effect.weight, 0.0)),
        "whatif/ess_seq_after": kish_ess(seq_w),
    }
    metrics |= rule_signal(effect, batch.advantages)
    after_loss = (
        _losses(batch, effect.weight, effect.keep, settings.divisor)
        if batch.advantages is not None
        else dict.fromkeys(LOSS_MODES)
    )
    for mode in LOSS_MODES:
        after = after_loss[mode]
        before = base_loss[mode]
        metrics[f"whatif/loss_delta/{mode}"] = None if after is None or before is None else after - before
    return metrics


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
    run: Run, settings: WhatifSettings | None = None, *, checks: CheckSettings | None = None
) -> Report:
    """Replay every correction rule of `settings` (default grid when none) on `run`; a Report of kind "whatif"."""
    settings = settings or WhatifSettings()
    checks = checks or CheckSettings()
    behavior, target = resolve_whatif_streams(run, settings)
    new = "new" if "new" in run.streams and "new" not in (behavior, target) else None
    streams = [behavior, target] + ([new] if new else [])
    if any(r.kind == "ref_kl" for r in settings.grid()) and "ref" in run.streams and "ref" not in streams:
        streams.append("ref")  # prime-rl's ref_kl reads it as its advantage
    loaded = read_token_batch(
        run, streams=streams, env=True, ignore=checks.ignore, max_examples=checks.max_examples
    )
    batch = loaded.batch
    lag = token_lag(run, batch)
    rows = whatif_batch(batch, settings, behavior=behavior, target=target, new=new, lag=lag)
    rules = settings.grid()
    meta = {
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
                "per_token_versions": lag.per_token,
            },
        },
        "inputs": {
            "runs": [run.label],
            "paths": [str(p) for p in run.paths],
            "streams": streams,
            "n_samples": batch.n_samples,
            "n_tokens": batch.n_tokens,
            "ignored_codes": list(checks.ignore),
        },
        "pairs": [f"{run.label}:{behavior} vs {run.label}:{target}"],
    }
    return Report(kind="whatif", summary=summary_frame(rows), meta=meta, checks=loaded.checks.issues)
