"""Checks of one pair of log-prob streams on the same tokens, as functions of plain arrays.

`check` runs them on two streams of one run, `compare` on two aligned runs; both pass the same arrays (side a's
and side b's (M,) log-probs plus where each token sits), so both report the same codes with the same thresholds:

    E302 a stream shifted by ±1 position · E207 NaN/inf log-probs · E205 positive log-probs ·
    E206 zero-filled log-probs

`where` is any object with `offsets` (S+1,), `pos` (M,), `step` (S,), `sample_id` (S,) and `token_sample()`
(M,) (a `TokenBatch`, or `compare.align.AlignedPair`). Medians run over at most `STAT_SAMPLE_TOKENS` evenly
strided tokens; counts use every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pgdiag.data.validate import LOGPROB_POSITIVE_TOL, Issue, zero_against_other, zero_fill_rows

STAT_SAMPLE_TOKENS = 262_144  # medians and fits of the shift test on up to about this many tokens
MIN_STAT_TOKENS = 200  # medians, fits and sign shares need this many tokens (E302, W401, W403)
SHIFT_MIN_MEDIAN = 0.05  # E302: median |Δ| at offset 0 must exceed this (nats) ...
SHIFT_GAIN = 2.0  # ... and the best of offsets ±1 must be this many times smaller


class TokenLocations(Protocol):
    """Where the M tokens of a pair sit: sample offsets, positions, and each sample's step and id."""

    offsets: np.ndarray  # (S + 1,)
    pos: np.ndarray  # (M,)
    step: np.ndarray  # (S,)
    sample_id: np.ndarray  # (S,)

    def token_sample(self) -> np.ndarray: ...  # (M,) sample owning each token


@dataclass(frozen=True)
class Locations:
    """A plain `TokenLocations`: tokens grouped by sample."""

    offsets: np.ndarray  # (S + 1,) int64
    pos: np.ndarray  # (M,)
    step: np.ndarray  # (S,)
    sample_id: np.ndarray  # (S,)

    def token_sample(self) -> np.ndarray:
        return np.repeat(np.arange(self.offsets.shape[0] - 1, dtype=np.int64), np.diff(self.offsets))


def keep_tokens(where: TokenLocations, keep: np.ndarray) -> Locations:
    """The locations of the tokens where `keep` (M,) is True, every sample kept (possibly empty)."""
    n_samples = where.offsets.shape[0] - 1
    counts = np.bincount(where.token_sample()[keep], minlength=n_samples)
    offsets = np.zeros(n_samples + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Locations(offsets, where.pos[keep], where.step, where.sample_id)


def locate(where: TokenLocations, tokens: np.ndarray, max_examples: int = 1) -> tuple[str, dict[str, Any]]:
    """Text naming the first `max_examples` of `tokens` and the first one's (step, sample_id, pos) fields."""
    tokens = np.asarray(tokens)[:max_examples]
    if tokens.size == 0:
        return "", {}
    rows = np.searchsorted(where.offsets, tokens, side="right") - 1
    parts = [
        f"step {where.step[r]}, sample {where.sample_id[r]}, pos {where.pos[t]}"
        for r, t in zip(rows.tolist(), tokens.tolist(), strict=True)
    ]
    first = {
        "step": int(where.step[rows[0]]),
        "sample_id": str(where.sample_id[rows[0]]),
        "pos": int(where.pos[tokens[0]]),
    }
    return "; ".join(parts), first


def shift_issue(
    lp_a: np.ndarray, lp_b: np.ndarray, where: TokenLocations, *, name_a: str, name_b: str
) -> Issue | None:
    """E302: b looks shifted by ±1 position against a.

    m_k = median |a_i − b_{i+k}| over tokens i whose position i + 1 is the next loss token of the same sample,
    k ∈ {−1, 0, +1}; a shift is claimed when m_0 > `SHIFT_MIN_MEDIAN` and min(m_−1, m_+1) < m_0 / 2.
    """
    m = lp_a.shape[0]
    if m < 2:
        return None
    stride = max(1, -(-m // STAT_SAMPLE_TOKENS))
    i = np.arange(0, m - 1, stride)
    owner = where.token_sample()
    i = i[(where.pos[i + 1] == where.pos[i] + 1) & (owner[i + 1] == owner[i])]
    with np.errstate(invalid="ignore"):
        finite = (
            np.isfinite(lp_a[i]) & np.isfinite(lp_b[i]) & np.isfinite(lp_a[i + 1]) & np.isfinite(lp_b[i + 1])
        )
    i = i[finite]
    if i.size < MIN_STAT_TOKENS:
        return None
    m0 = float(np.median(np.abs(lp_a[i] - lp_b[i])))
    m_plus = float(np.median(np.abs(lp_a[i] - lp_b[i + 1])))  # b's value for token i sits at i + 1
    m_minus = float(np.median(np.abs(lp_a[i + 1] - lp_b[i])))  # b's value for token i + 1 sits at i
    shift, m_k = ("+1", m_plus) if m_plus <= m_minus else ("-1", m_minus)
    if not (m0 > SHIFT_MIN_MEDIAN and m_k < m0 / SHIFT_GAIN):
        return None
    text, first = locate(where, i)
    return Issue(
        "E302",
        "error",
        int(i.size),
        f"{name_b} looks shifted by {shift} vs {name_a} (median |Δ| {m_k:.3g} at {shift}, {m0:.3g} at 0; "
        f"first: {text})",
        hint="re-import with pgdiag import --shift to put element i at the position of token i",
        **first,
    )


def value_issues(sides: list[tuple[np.ndarray, str]], where: TokenLocations) -> list[Issue]:
    """E207 (NaN or null, -inf, +inf) then E205 (above `LOGPROB_POSITIVE_TOL`), per side, on the paired tokens."""
    issues = []
    for code in ("E207", "E205"):
        for values, name in sides:
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(values) if code == "E207" else values > LOGPROB_POSITIVE_TOL
            if not bad.any():
                continue
            text, first = locate(where, np.flatnonzero(bad))
            if code == "E207":
                n_nan, n_neg = int(np.isnan(values).sum()), int((values == -np.inf).sum())
                what = f"{n_nan} NaN or null, {n_neg} -inf, {int((values == np.inf).sum())} +inf on matched loss positions"
            else:
                what = f"{int(bad.sum())} positive values (max {np.nanmax(values):.3g})"
            issues.append(
                Issue(
                    code,
                    "error",
                    int(bad.sum()),
                    f"{name}: {what} (first: {text})",
                    hint=_HINTS[code],
                    **first,
                )
            )
    return issues


_HINTS = {
    "E207": "drop the non-finite tokens with --ignore E207 (they are counted)",
    "E205": "log-probs must be <= 0; a sign flip or a loss (negative log-prob) was stored?",
}


def zero_fill_issues(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    where: TokenLocations,
    *,
    name_a: str,
    name_b: str,
    single_stream: bool = True,
    max_examples: int = 1,
) -> list[Issue]:
    """E206 per side: exact 0.0 where the other side is < −1 and, with `single_stream`, the one-stream rule of
    the reader (`data.validate.zero_fill_rows`: > 1 % exact 0.0, or a sample of ≥ 2 loss values all 0.0).

    `check` passes ``single_stream=False``: the reader has already applied that rule to each column.
    """
    issues = []
    for values, other, name, other_name in ((lp_a, lp_b, name_a, name_b), (lp_b, lp_a, name_b, name_a)):
        zero = np.flatnonzero(values == 0.0)
        if zero.size == 0:
            continue
        against = zero_against_other(values, other)
        rows = zero_fill_rows(values, where.offsets) if single_stream else None
        if rows is not None and rows.fraction_filled:
            reason, tokens = f"{100 * rows.fraction:.3g} % exact 0.0 on loss positions", zero
        elif rows is not None and rows.all_zero_rows.size:
            reason = f"{rows.all_zero_rows.size} samples whose loss values are all exactly 0.0"
            tokens = where.offsets[rows.all_zero_rows]
        elif against.size:
            reason, tokens = f"0.0 where {other_name} < -1 on {against.size} tokens", against
        else:
            continue
        text, first = locate(where, tokens, max_examples)
        issues.append(
            Issue(
                "E206",
                "error",
                int(tokens.size),
                f"{name} {reason}: zero-filled? ({text})",
                hint="missing values written as 0? import them as null",
                **first,
            )
        )
    return issues
