"""The replay of one correction rule on a batch of whole steps: the rule's weights and flags (`rule_effect`),
the classic kinds of `whatif` (`apply_rule`), Kish's ESS and the unit of each whatif metric (docs/whatif.md).

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

Every rule acts within one step at most (batch-normalised IS divides by its step's mean, M2PO sorts within a
step or its micro-batches), so a batch of whole steps gives each token the weight a read of the whole run gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pgdiag.analysis.rules import (
    PROXIMAL_THETA,
    Replay,
    RuleEffect,
    apply_named_rule,
    segment_sums,
    verl_chain,
)
from pgdiag.analysis.settings import RULE_KINDS, CorrectionRule
from pgdiag.data.batch import TokenBatch
from pgdiag.metrics.loss import GSPO_MODES, NATIVE_MODES

SAFETY_BOUND = 20.0  # verl rollout_corr_helper.SAFETY_BOUND: |log ratio| clamp before exp
LOSS_MODES = tuple(m for m in NATIVE_MODES if m not in GSPO_MODES)


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


def seq_log_weights(effect: RuleEffect, offsets: np.ndarray, *, sequence_level: bool) -> np.ndarray:
    """(S,) the log of the sequence weight a rule implies (−inf where no token is kept or a weight is 0).

    A sequence-level rule puts one weight on all its tokens: that weight. A token-level rule implies the product of
    its kept tokens' weights (the sequence ratio after the rule). `kish_ess` of exp(these − their max) is the
    rule's sequence ESS (`whatif_fold.Kish` keeps it over pieces).
    """
    kept_w = np.where(effect.keep, effect.weight, 1.0)
    with np.errstate(divide="ignore"):
        log_w = _sums(np.log(kept_w), offsets)
    if sequence_level:  # every token carries the same weight: the mean of the logs is its log
        counts = np.diff(offsets)
        log_w = np.divide(log_w, counts, out=np.zeros_like(log_w), where=counts > 0)
    any_kept = _sums(effect.keep.astype(np.float64), offsets) > 0
    return np.where(any_kept, log_w, -np.inf)


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


def replay_of(batch: TokenBatch, base: str, cur: str) -> Replay:
    """The replay of the pair (base, cur) of streams of `batch`."""
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
