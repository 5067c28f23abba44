"""Diagnoses of a mismatch from the log-probs alone (docs/compare.md).

What: signatures that name a cause rather than a size: a temperature applied on one side only (W401: OLS slope of
lp_b on lp_a away from 1 with a high correlation; `tau_hint` = the slope, the logprob-only stand-in for the
exact `tau_fit` that needs logits), the first response token carrying an outsized share of the error (W406,
`first_token_ratio`), processed (renormalised top-p/top-k) sampling log-probs (W403: lp_a ≥ lp_b on most tokens
with a negative mean Δ, implied kept mass e^mean Δ), a step whose error jumps (W407, stale weights) and extreme
tokens (W410).
Why: a parity table says "they differ by 0.09 nats"; these checks say "side a looks sampled at T ≈ 0.7".
How: `diagnose(pair, token_stats)` takes the aligned pair and its `all` token table and returns
`Diagnosis(first_token_ratio, tau_hint, issues)`; every threshold below is the one docs/cli.md documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pgdiag.compare.align import AlignedPair
from pgdiag.data.validate import Issue

SLOPE_TOLERANCE = 0.05  # W401: |fit_slope − 1| above this ...
SLOPE_MIN_PEARSON = 0.9  # ... with pearson_r above this
FIRST_TOKEN_RATIO = 5.0  # W401 / W406
FIRST_TOKEN_MIN_SEQS = 100  # W406
FIRST_TOKEN_SIGN_SHARE = 0.8  # W401: one sign of the first-token Δ in this share of sequences
PROCESSED_SHARE = 0.9  # W403: lp_a ≥ lp_b on more than this share of tokens ...
PROCESSED_MEAN_DELTA = -0.01  # ... and mean Δ below this
STALE_FACTOR = 3.0  # W407: step mean |Δ| > 3 × median of the 5 previous steps ...
STALE_MIN = 0.005  # ... and above this (nats)
STALE_WINDOW = 5
EXTREME_DELTA = 20.0  # W410


@dataclass(frozen=True)
class Diagnosis:
    """Logprob-only diagnosis of one pair."""

    first_token_ratio: float | None  # mean |Δ| on each sample's first loss token / mean |Δ| overall
    tau_hint: float | None  # OLS slope of lp_b on lp_a: τ ≈ slope when side a is b's logits divided by τ
    issues: tuple[Issue, ...]


def first_token_stats(pair: AlignedPair) -> tuple[float | None, float]:
    """(first_token_ratio, share of sequences whose first-token Δ has the majority sign)."""
    counts = pair.n_loss
    firsts = pair.offsets[:-1][counts > 0]
    if firsts.size == 0:
        return None, 0.0
    d = pair.delta
    overall = float(np.mean(np.abs(d)))
    first_d = d[firsts]
    first_mean = float(np.mean(np.abs(first_d)))
    share = max(float(np.mean(first_d > 0)), float(np.mean(first_d < 0)))
    if overall == 0.0:
        return (None if first_mean == 0.0 else float("inf")), share
    return first_mean / overall, share


def diagnose(
    pair: AlignedPair, token_stats: dict[str, float | None], step_abs_mean: dict[int, float]
) -> Diagnosis:
    """W401, W403, W406, W407, W410 for `pair`; `token_stats` holds the `all` token-scope values by stat name,
    `step_abs_mean` the per-step mean |Δ| (step order)."""
    issues: list[Issue] = []
    name = pair.pair
    slope, r = token_stats.get("fit_slope"), token_stats.get("pearson_r")
    ratio, sign_share = first_token_stats(pair)
    n_seqs = int(np.count_nonzero(pair.n_loss))

    if slope is not None and r is not None and abs(slope - 1.0) > SLOPE_TOLERANCE and r > SLOPE_MIN_PEARSON:
        issues.append(
            Issue(
                "W401",
                "warning",
                pair.n_tokens,
                f"{name}: slope {slope:.3g}: one side looks tempered ({pair.label_a} ≈ {pair.label_b}'s logits / "
                f"{slope:.3g}, i.e. {pair.label_b} at T ≈ {1 / slope:.3g}); check temperature on both sides",
            )
        )
    elif ratio is not None and ratio > FIRST_TOKEN_RATIO and sign_share > FIRST_TOKEN_SIGN_SHARE:
        issues.append(
            Issue(
                "W401",
                "warning",
                n_seqs,
                f"{name}: first-token Δ has one sign in {100 * sign_share:.3g} % of sequences and {ratio:.3g}× the "
                "mean |Δ|; a temperature or prompt-boundary difference on one side?",
            )
        )
    if ratio is not None and ratio > FIRST_TOKEN_RATIO and n_seqs >= FIRST_TOKEN_MIN_SEQS:
        issues.append(
            Issue(
                "W406",
                "warning",
                n_seqs,
                f"{name}: first response token carries {ratio:.3g}× the mean |Δ|",
            )
        )

    d = pair.delta
    bias = token_stats.get("bias")
    if d.size and bias is not None:
        share = float(np.mean(pair.lp_a >= pair.lp_b))
        if share > PROCESSED_SHARE and bias < PROCESSED_MEAN_DELTA:
            issues.append(
                Issue(
                    "W403",
                    "warning",
                    int(np.count_nonzero(pair.lp_a >= pair.lp_b)),
                    f"{name}: {pair.label_a} ≥ {pair.label_b} on {100 * share:.3g} % of tokens (mean Δ {bias:.3g}, "
                    f"implied kept mass {np.exp(bias):.3g}): processed log-probs with top-p/top-k?",
                )
            )

    steps = sorted(step_abs_mean)
    for i, step in enumerate(steps[1:], start=1):
        window = [step_abs_mean[s] for s in steps[max(0, i - STALE_WINDOW) : i]]
        before = float(np.median(window))
        now = step_abs_mean[step]
        if now > STALE_FACTOR * before and now > STALE_MIN:
            issues.append(
                Issue(
                    "W407",
                    "warning",
                    1,
                    f"{name}: step {step}: mean |Δ| {now:.3g} vs {before:.3g} before (resume or weight sync?)",
                    step,
                )
            )

    extreme = int(np.count_nonzero(np.abs(d) > EXTREME_DELTA))
    if extreme:
        issues.append(
            Issue(
                "W410", "warning", extreme, f"{name}: {extreme} tokens with |Δ| > 20 (counted, not clamped)"
            )
        )
    return Diagnosis(ratio, slope, tuple(issues))
