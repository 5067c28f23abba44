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

import numpy as np

from pgdiag.checks.pairs import MIN_STAT_TOKENS, TokenLocations, locate
from pgdiag.data.validate import Issue

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


def line_fit(lp_a: np.ndarray, lp_b: np.ndarray) -> tuple[float | None, float | None]:
    """(OLS slope of lp_b on lp_a, Pearson r) over all tokens; None where a spread is zero."""
    if lp_a.shape[0] < 3:
        return None, None
    xa, xb = lp_a - lp_a.mean(), lp_b - lp_b.mean()
    saa, sbb, sab = float(xa @ xa), float(xb @ xb), float(xa @ xb)
    if not (saa > 0 and sbb > 0):
        return None, None
    return sab / saa, sab / float(np.sqrt(saa * sbb))


def first_token_stats(delta: np.ndarray, offsets: np.ndarray) -> tuple[float | None, float, int]:
    """(first-token ratio, share of sequences whose first-token Δ has the majority sign, sequences)."""
    firsts = offsets[:-1][np.diff(offsets) > 0]
    if firsts.size == 0:
        return None, 0.0, 0
    overall = float(np.mean(np.abs(delta)))
    first_d = delta[firsts]
    first_mean = float(np.mean(np.abs(first_d)))
    share = max(float(np.mean(first_d > 0)), float(np.mean(first_d < 0)))
    if overall == 0.0:
        return (None if first_mean == 0.0 else float("inf")), share, int(firsts.size)
    return first_mean / overall, share, int(firsts.size)


def step_abs_means(delta: np.ndarray, where: TokenLocations) -> tuple[np.ndarray, np.ndarray]:
    """Steps (sorted) and the mean |Δ| of each over its tokens."""
    steps, step_code = np.unique(where.step, return_inverse=True)
    token_step = step_code[where.token_sample()]  # (M,)
    sums = np.bincount(token_step, weights=np.abs(delta), minlength=steps.size)
    counts = np.bincount(token_step, minlength=steps.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        return steps, sums / counts


def signatures(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    where: TokenLocations,
    *,
    name: str,
    name_a: str,
    name_b: str,
    sampling_side_is_engine: bool,
    fit: tuple[float | None, float | None] | None = None,
    max_examples: int = 1,
) -> Signatures:
    """W401, W403, W406, W407 and W410 of the pair; every token of `lp_a`, `lp_b` (M,) must be finite.

    `name` prefixes the messages (the pair), `name_a`/`name_b` name the sides; `fit` is (slope, r) when the
    caller has computed it (`compare`'s parity table), else it is computed here. W403 applies only when side a
    is the sampling engine's.
    """
    delta = lp_b - lp_a  # (M,)
    n = delta.shape[0]
    issues: list[Issue] = []
    if n == 0:
        return Signatures(None, None, ())
    slope, r = line_fit(lp_a, lp_b) if fit is None else fit
    ratio, sign_share, n_seqs = first_token_stats(delta, where.offsets)
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
                "W401",
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
                "W401",
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
                "W406", "warning", n_seqs, f"{name}: first response token carries {ratio:.3g}× the mean |Δ|"
            )
        )
    if sampling_side_is_engine and enough:
        n_ge = int(np.count_nonzero(delta <= 0.0))
        mean_delta = float(delta.mean())
        if n_ge / n > PROCESSED_SHARE and mean_delta < PROCESSED_MEAN_DELTA:
            issues.append(
                Issue(
                    "W403",
                    "warning",
                    n_ge,
                    f"{name}: {name_a} ≥ {name_b} on {100 * n_ge / n:.3g} % of tokens (mean Δ {mean_delta:.3g}, "
                    f"implied kept mass {np.exp(mean_delta):.3g}): processed log-probs with top-p/top-k?",
                    hint="log raw log-probs (vLLM: logprobs_mode=raw_logprobs)",
                )
            )
    steps, step_mean = step_abs_means(delta, where)
    for k in range(1, steps.size):
        before = step_mean[max(0, k - STALE_WINDOW) : k]
        before = before[np.isfinite(before)]
        if before.size and step_mean[k] > STALE_FACTOR * np.median(before) and step_mean[k] > STALE_MIN:
            issues.append(
                Issue(
                    "W407",
                    "warning",
                    1,
                    f"{name}: step {steps[k]}: mean |Δ| {step_mean[k]:.3g} vs {np.median(before):.3g} before "
                    "(resume or weight sync?)",
                    step=int(steps[k]),
                )
            )
    extreme = np.flatnonzero(np.abs(delta) > EXTREME_DELTA)
    if extreme.size:
        text, first = locate(where, extreme, max_examples)
        issues.append(
            Issue(
                "W410",
                "warning",
                int(extreme.size),
                f"{name}: {extreme.size} tokens with |Δ| > 20 (counted, not clamped; {text})",
                **first,
            )
        )
    return Signatures(ratio, slope, tuple(issues))
