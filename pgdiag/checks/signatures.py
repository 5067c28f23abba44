"""Signatures that name the cause of a mismatch from the log-probs alone, as functions of plain arrays.

W401 a temperature on one side (OLS slope of lp_b on lp_a away from 1 with a high correlation, or the first
token carrying the error with one sign) · W403 processed (renormalised top-p/top-k) sampling log-probs ·
W406 the first response token carrying an outsized share of |Δ| · W407 a step whose mean |Δ| jumps (stale
weights after a resume) · W410 tokens with |Δ| > 20 (counted, never clamped).

`check` calls `signatures` on two streams of one run and `compare` on two aligned runs (passing the exact fit
of its parity table), so both report the same findings on the same data. Δ = lp_b − lp_a on tokens where both
are finite; fits, sign shares and per-step means use every such token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pgdiag.checks.pairs import MIN_STAT_TOKENS
from pgdiag.data.token_issues import TokenLocations, locate_parts
from pgdiag.data.validate import Issue
from pgdiag.errors import Code

SLOPE_TOLERANCE = 0.05  # W401: |slope − 1| above this ...
SLOPE_MIN_PEARSON = 0.9  # ... with pearson r above this
FIRST_TOKEN_RATIO = 5.0  # W401 / W406: first-token mean |Δ| over the overall mean |Δ|
FIRST_TOKEN_MIN_SEQS = 100  # W406
FIRST_TOKEN_SIGN_SHARE = 0.8  # W401: one sign of the first-token Δ in this share of sequences
PROCESSED_SHARE = 0.9  # W403: lp_a ≥ lp_b on more than this share of tokens ...
PROCESSED_MEAN_DELTA = -0.01  # ... and mean Δ below this
STALE_FACTOR = 3.0  # W407: step mean |Δ| > 3 × median of the 5 previous steps ...
STALE_MIN = 0.005  # ... and above this (nats)
STALE_WINDOW = 5
EXTREME_DELTA = 20.0  # W410


@dataclass(frozen=True)
class Signatures:
    """What the signatures found for one pair, with the two numbers `compare` also reports."""

    first_token_ratio: float | None  # mean |Δ| on each sample's first loss token / mean |Δ| overall
    slope: float | None  # OLS slope of lp_b on lp_a: τ ≈ slope when a is b's logits divided by τ
    issues: tuple[Issue, ...]


@dataclass(frozen=True)
class Comoments:
    """Mergeable first and second moments of a pair (x, y): n, means and centred sums of squares and products.

    `of(x, y)` centres on np.mean, so a single piece gives the same slope and r bit
    for bit; `merge` pools pieces with the parallel update of Chan et al. (n_a n_b / n · δx δy), which moves a
    pooled value by rounding only (relative 1e-15 or so), never by cancellation: no raw sums of squares.
    """

    n: int
    mean_x: float
    mean_y: float
    sxx: float
    syy: float
    sxy: float

    @staticmethod
    def of(x: np.ndarray, y: np.ndarray) -> Comoments:
        n = int(x.shape[0])
        if n == 0:
            return Comoments(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        mx, my = float(x.mean()), float(y.mean())
        cx, cy = x - mx, y - my  # (M,) each
        return Comoments(n, mx, my, float(cx @ cx), float(cy @ cy), float(cx @ cy))

    def merge(self, other: Comoments) -> Comoments:
        if other.n == 0:
            return self
        if self.n == 0:
            return other
        n = self.n + other.n
        dx, dy = other.mean_x - self.mean_x, other.mean_y - self.mean_y
        w = self.n * other.n / n
        return Comoments(
            n,
            self.mean_x + dx * other.n / n,
            self.mean_y + dy * other.n / n,
            self.sxx + other.sxx + dx * dx * w,
            self.syy + other.syy + dy * dy * w,
            self.sxy + other.sxy + dx * dy * w,
        )

    def slope_and_r(self) -> tuple[float | None, float | None]:
        """(OLS slope of y on x, Pearson r) over all tokens; None below 3 points or where a spread is 0."""
        if self.n < 3 or not (self.sxx > 0 and self.syy > 0):
            return None, None
        return self.sxy / self.sxx, self.sxy / float(np.sqrt(self.sxx * self.syy))


@dataclass(frozen=True)
class SignatureStats:
    """Everything the signatures read, as sums over tokens, samples and steps: mergeable across pieces of a run
    (consecutive steps, in order), so a run read step by step gives the findings of the run read whole."""

    n: int  # finite tokens
    fit: Comoments  # of (lp_a, lp_b)
    sum_abs: float  # Σ |Δ|
    sum_delta: float  # Σ Δ
    n_nonpositive: int  # tokens with Δ <= 0 (W403)
    n_seqs: int  # samples with a token
    first_sum_abs: float  # Σ |Δ| over each sample's first token
    first_pos: int  # first tokens with Δ > 0
    first_neg: int  # first tokens with Δ < 0
    steps: np.ndarray  # (K,) sorted steps
    step_sum_abs: np.ndarray  # (K,) Σ |Δ| per step
    step_tokens: np.ndarray  # (K,) tokens per step
    n_extreme: int  # tokens with |Δ| > 20 (W410)
    extreme_examples: tuple[str, ...]  # the first max_examples of them, "step s, sample x, pos p"
    extreme_first: dict[str, Any]  # the first one's step, sample_id and pos (empty when none)

    def merge(self, other: SignatureStats, max_examples: int) -> SignatureStats:
        """`self` then `other` (later steps): sums added, per-step arrays joined, the first examples kept."""
        steps = np.concatenate([self.steps, other.steps])
        order = np.argsort(steps, kind="stable")
        examples = (self.extreme_examples + other.extreme_examples)[:max_examples]
        return SignatureStats(
            self.n + other.n,
            self.fit.merge(other.fit),
            self.sum_abs + other.sum_abs,
            self.sum_delta + other.sum_delta,
            self.n_nonpositive + other.n_nonpositive,
            self.n_seqs + other.n_seqs,
            self.first_sum_abs + other.first_sum_abs,
            self.first_pos + other.first_pos,
            self.first_neg + other.first_neg,
            steps[order],
            np.concatenate([self.step_sum_abs, other.step_sum_abs])[order],
            np.concatenate([self.step_tokens, other.step_tokens])[order],
            self.n_extreme + other.n_extreme,
            examples,
            self.extreme_first or other.extreme_first,
        )


def signature_stats(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    where: TokenLocations,
    *,
    max_examples: int = 1,
    fit: bool = True,
    delta: np.ndarray | None = None,
    abs_delta: np.ndarray | None = None,
) -> SignatureStats:
    """The sums `signature_issues` reads, over the (M,) finite tokens of one piece; `fit=False` skips the
    (lp_a, lp_b) moments when the caller has its own fit (`compare`'s parity table). `delta` (lp_b − lp_a) and
    `abs_delta` (its absolute value), (M,), when the caller holds them already (compare's parity terms)."""
    delta = lp_b - lp_a if delta is None else delta  # (M,)
    abs_delta = np.abs(delta) if abs_delta is None else abs_delta  # (M,)
    n = int(delta.shape[0])
    firsts = where.offsets[:-1][np.diff(where.offsets) > 0]
    first_d = delta[firsts]
    steps, step_code = np.unique(where.step, return_inverse=True)
    step_code = step_code.reshape(-1)  # (S,)
    extreme = np.flatnonzero(abs_delta > EXTREME_DELTA)
    examples, first = locate_parts(where, extreme, max_examples)
    return SignatureStats(
        n,
        Comoments.of(lp_a, lp_b) if fit else Comoments(0, 0.0, 0.0, 0.0, 0.0, 0.0),
        float(np.sum(abs_delta)),
        float(np.sum(delta)),
        int(np.count_nonzero(delta <= 0.0)),
        int(firsts.size),
        float(np.sum(np.abs(first_d))),
        int(np.count_nonzero(first_d > 0)),
        int(np.count_nonzero(first_d < 0)),
        steps.astype(np.int64),
        step_sums(abs_delta, step_code, where, steps.size),
        # tokens per step from each sample's token count (exact integers): no second pass over the M tokens
        np.bincount(step_code, weights=np.diff(where.offsets), minlength=steps.size).astype(np.int64),
        int(extreme.size),
        examples,
        first,
    )


SUM_CHUNK = 1 << 20  # tokens per `np.add.accumulate` in `step_sums`


def step_sums(values: np.ndarray, step_code: np.ndarray, where: TokenLocations, k: int) -> np.ndarray:
    """(K,) Σ `values` (M,) over each step's tokens, added one token after the other in token order, so bit for bit
    ``np.bincount(step_code[where.token_sample()], weights=values, minlength=k)``: when the samples come in step
    order (`step_code` (S,) non-decreasing, as a run read step by step gives them), each step's tokens are one
    slice, summed by `np.add.accumulate` (sequential, from 0.0, as bincount) in chunks behind a carry, with no
    (M,) step index; otherwise that bincount."""
    if step_code.size and not bool(np.all(step_code[1:] >= step_code[:-1])):
        return np.bincount(step_code[where.token_sample()], weights=values, minlength=k)
    offsets = np.asarray(where.offsets, dtype=np.int64)
    bounds = offsets[np.searchsorted(step_code, np.arange(k + 1), side="left")]  # (K + 1,) token bounds
    out = np.zeros(k, dtype=np.float64)
    buffer = np.empty(min(SUM_CHUNK, values.shape[0]) + 1, dtype=np.float64)
    for step in range(k):
        carry = 0.0
        for start in range(int(bounds[step]), int(bounds[step + 1]), SUM_CHUNK):
            part = values[start : min(start + SUM_CHUNK, int(bounds[step + 1]))]
            buffer[0] = carry
            buffer[1 : part.shape[0] + 1] = part
            carry = float(np.add.accumulate(buffer[: part.shape[0] + 1], out=buffer[: part.shape[0] + 1])[-1])
        out[step] = carry
    return out


def first_token_stats(stats: SignatureStats) -> tuple[float | None, float]:
    """(first-token ratio: mean |Δ| on each sample's first loss token / mean |Δ| overall, share of sequences
    whose first-token Δ has the majority sign)."""
    if stats.n_seqs == 0:
        return None, 0.0
    overall = stats.sum_abs / stats.n
    first_mean = stats.first_sum_abs / stats.n_seqs
    share = max(stats.first_pos / stats.n_seqs, stats.first_neg / stats.n_seqs)
    if overall == 0.0:
        return (None if first_mean == 0.0 else float("inf")), share
    return first_mean / overall, share


def signature_issues(
    stats: SignatureStats,
    *,
    name: str,
    name_a: str,
    name_b: str,
    sampling_side_is_engine: bool,
    fit: tuple[float | None, float | None] | None = None,
) -> Signatures:
    """W401, W403, W406, W407 and W410 of a pair from its (pooled) `stats`; `name` prefixes the messages (the
    pair), `name_a`/`name_b` name the sides; `fit` is (slope, r) when the caller has computed it (`compare`'s
    parity table). W403 applies only when side a is the sampling engine's."""
    n = stats.n
    issues: list[Issue] = []
    if n == 0:
        return Signatures(None, None, ())
    slope, r = stats.fit.slope_and_r() if fit is None else fit
    ratio, sign_share = first_token_stats(stats)
    n_seqs = stats.n_seqs
    enough = n >= MIN_STAT_TOKENS
    if (
        enough
        and slope is not None
        and r is not None
        and abs(slope - 1.0) > SLOPE_TOLERANCE
        and r > SLOPE_MIN_PEARSON
    ):
        issues.append(
            Issue(
                Code.ONE_SIDED_TEMPERATURE,
                "warning",
                n,
                f"{name}: slope {slope:.3g}: one side looks tempered (implied T ≈ {1 / slope:.3g}: {name_a} ≈ "
                f"{name_b}'s logits / {slope:.3g})",
                hint="check temperature on both sides",
            )
        )
    elif enough and ratio is not None and ratio > FIRST_TOKEN_RATIO and sign_share > FIRST_TOKEN_SIGN_SHARE:
        issues.append(
            Issue(
                Code.ONE_SIDED_TEMPERATURE,
                "warning",
                n_seqs,
                f"{name}: first-token Δ has one sign in {100 * sign_share:.3g} % of sequences and {ratio:.3g}× the "
                "mean |Δ|: a temperature or prompt-boundary difference on one side?",
                hint="check temperature on both sides",
            )
        )
    if ratio is not None and ratio > FIRST_TOKEN_RATIO and n_seqs >= FIRST_TOKEN_MIN_SEQS:
        issues.append(
            Issue(
                Code.FIRST_TOKEN_DOMINATES,
                "warning",
                n_seqs,
                f"{name}: first response token carries {ratio:.3g}× the mean |Δ|",
            )
        )
    if sampling_side_is_engine and enough:
        n_ge = stats.n_nonpositive
        mean_delta = stats.sum_delta / n
        if n_ge / n > PROCESSED_SHARE and mean_delta < PROCESSED_MEAN_DELTA:
            issues.append(
                Issue(
                    Code.PROCESSED_LOGPROBS,
                    "warning",
                    n_ge,
                    f"{name}: {name_a} ≥ {name_b} on {100 * n_ge / n:.3g} % of tokens (mean Δ {mean_delta:.3g}, "
                    f"implied kept mass {np.exp(mean_delta):.3g}): processed log-probs with top-p/top-k?",
                    hint="log raw log-probs (vLLM: logprobs_mode=raw_logprobs)",
                )
            )
    steps = stats.steps
    with np.errstate(invalid="ignore", divide="ignore"):
        step_mean = stats.step_sum_abs / stats.step_tokens
    for k in range(1, steps.size):
        before = step_mean[max(0, k - STALE_WINDOW) : k]
        before = before[np.isfinite(before)]
        if before.size and step_mean[k] > STALE_FACTOR * np.median(before) and step_mean[k] > STALE_MIN:
            issues.append(
                Issue(
                    Code.STALE_WEIGHTS,
                    "warning",
                    1,
                    f"{name}: step {steps[k]}: mean |Δ| {step_mean[k]:.3g} vs {np.median(before):.3g} before "
                    "(resume or weight sync?)",
                    step=int(steps[k]),
                )
            )
    if stats.n_extreme:
        text = "; ".join(stats.extreme_examples)
        issues.append(
            Issue(
                Code.EXTREME_TOKENS,
                "warning",
                stats.n_extreme,
                f"{name}: {stats.n_extreme} tokens with |Δ| > 20 (counted, not clamped; {text})",
                **stats.extreme_first,
            )
        )
    return Signatures(ratio, slope, tuple(issues))
