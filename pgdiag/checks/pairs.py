"""Checks of one pair of log-prob streams on the same tokens, as functions of plain arrays.

`check` runs them on two streams of one run, `compare` on two aligned runs; both pass the same arrays (side a's
and side b's (M,) log-probs plus where each token sits), so both report the same codes with the same thresholds:

    E302 a stream shifted by ±1 position · E207 NaN/inf log-probs · E205 positive log-probs

E206 (zero-filled log-probs) of a pair is `pgdiag.data.token_issues.zero_fill_issues`, which `metrics` runs too.

`where` is any object with `offsets` (S+1,), `pos` (M,), `step` (S,), `sample_id` (S,) and `token_sample()`
(M,) (a `TokenBatch`, or `compare.align.AlignedPair`). Medians run over at most `STAT_SAMPLE_TOKENS` evenly
strided tokens; counts use every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pgdiag.data.token_issues import TokenLocations, locate_parts
from pgdiag.data.validate import LOGPROB_POSITIVE_TOL, Issue
from pgdiag.errors import Code

STAT_SAMPLE_TOKENS = 262_144  # medians and fits of the shift test on up to about this many tokens
MIN_STAT_TOKENS = 200  # medians, fits and sign shares need this many tokens (E302, W401, W403)
SHIFT_MIN_MEDIAN = 0.05  # E302: median |Δ| at offset 0 must exceed this (nats) ...
SHIFT_GAIN = 2.0  # ... and the best of offsets ±1 must be this many times smaller


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
    parts, first = locate_parts(where, tokens, max_examples)
    return "; ".join(parts), first


@dataclass(frozen=True)
class ShiftSample:
    """The token pairs E302's medians are taken on, pooled over the pieces of a run read in pieces.

    In each piece of M tokens, token i (numbered within its piece) is drawn when i is a multiple of `stride`,
    its position i + 1 is the next loss token of the same sample, and both streams are finite at i and i + 1.
    `stride` is one power of two for the whole run: the smallest for which the pieces so far hold at most
    `STAT_SAMPLE_TOKENS` multiples of it in all (sum of ceil(M / stride)); `merge` doubles it as pieces are
    added and thins the samples to the multiples of the new stride, so the pooled sample stays bounded and
    does not depend on the order in which pieces are merged. A run read in one piece is judged by
    `shift_issue` (stride ceil(M / `STAT_SAMPLE_TOKENS`)); for a run of at most `STAT_SAMPLE_TOKENS` tokens both
    strides are 1 and the two samples are the same (every pairable token)."""

    d0: np.ndarray  # (K,) |a_i − b_i|
    d_plus: np.ndarray  # (K,) |a_i − b_{i+1}|
    d_minus: np.ndarray  # (K,) |a_{i+1} − b_i|
    local: np.ndarray  # (K,) int64 index of token i within its piece
    step: np.ndarray  # (K,) step of token i
    sample_id: np.ndarray  # (K,) object
    pos: np.ndarray  # (K,) position of token i
    piece_tokens: tuple[int, ...] = ()  # M of each piece merged so far
    stride: int = 1

    @classmethod
    def empty(cls) -> ShiftSample:
        none = np.zeros(0, dtype=np.float64)
        index = np.zeros(0, dtype=np.int64)
        return cls(none, none, none, index, index, np.zeros(0, dtype=object), index)

    @classmethod
    def of_piece(
        cls, lp_a: np.ndarray, lp_b: np.ndarray, where: TokenLocations, stride: int | None = None
    ) -> ShiftSample:
        """The sample of one piece's (M,) streams, at `stride` (default: the smallest power of two that keeps
        at most `STAT_SAMPLE_TOKENS` multiples)."""
        m = lp_a.shape[0]
        if stride is None:
            stride = 1
            while -(-m // stride) > STAT_SAMPLE_TOKENS:
                stride *= 2
        i = _pairable(lp_a, lp_b, where, np.arange(0, max(m - 1, 0), stride))
        rows = np.searchsorted(where.offsets, i, side="right") - 1
        return cls(
            np.abs(lp_a[i] - lp_b[i]),
            np.abs(lp_a[i] - lp_b[i + 1]),  # b's value for token i sits at i + 1
            np.abs(lp_a[i + 1] - lp_b[i]),  # b's value for token i + 1 sits at i
            i.astype(np.int64),
            np.asarray(where.step)[rows],
            np.asarray(where.sample_id, dtype=object)[rows],
            np.asarray(where.pos)[i],
            (m,),
            stride,
        )

    def merge(self, other: ShiftSample) -> ShiftSample:
        """`self` then `other` (later pieces), thinned to their common stride."""
        sizes = self.piece_tokens + other.piece_tokens
        stride = max(self.stride, other.stride)
        largest = max(sizes, default=0)
        while sum(-(-m // stride) for m in sizes) > STAT_SAMPLE_TOKENS and stride < largest:
            stride *= 2
        keep_a, keep_b = self.local % stride == 0, other.local % stride == 0

        def joined(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            return np.concatenate([x[keep_a], y[keep_b]])

        return ShiftSample(
            joined(self.d0, other.d0),
            joined(self.d_plus, other.d_plus),
            joined(self.d_minus, other.d_minus),
            joined(self.local, other.local),
            joined(self.step, other.step),
            joined(self.sample_id, other.sample_id),
            joined(self.pos, other.pos),
            sizes,
            stride,
        )


def _pairable(lp_a: np.ndarray, lp_b: np.ndarray, where: TokenLocations, i: np.ndarray) -> np.ndarray:
    """Those token indices i (of a stride) whose next position is the next loss token of the same sample and
    where both streams are finite at i and i + 1."""
    # the sample owning token t is searchsorted(offsets, t, "right") − 1 (as `token_sample()[t]`, without its
    # (M,) array): taken for the K drawn tokens only
    owner, owner_next = (np.searchsorted(where.offsets, t, side="right") for t in (i, i + 1))  # (K,)
    i = i[(where.pos[i + 1] == where.pos[i] + 1) & (owner_next == owner)]
    with np.errstate(invalid="ignore"):
        finite = (
            np.isfinite(lp_a[i]) & np.isfinite(lp_b[i]) & np.isfinite(lp_a[i + 1]) & np.isfinite(lp_b[i + 1])
        )
    return i[finite]


def shift_rule(*, name_a: str, name_b: str) -> str:
    """The merge key (`Issue.rule`) of the E302 shift issue of the pair (a, b)."""
    return f"{name_b} shifted vs {name_a}"


def shift_verdict(sample: ShiftSample, *, name_a: str, name_b: str) -> Issue | None:
    """E302 on a (pooled) `ShiftSample`, by the rule of `shift_issue`."""
    if sample.d0.size < MIN_STAT_TOKENS:
        return None
    m0 = float(np.median(sample.d0))
    m_plus, m_minus = float(np.median(sample.d_plus)), float(np.median(sample.d_minus))
    shift, m_k = ("+1", m_plus) if m_plus <= m_minus else ("-1", m_minus)
    if not (m0 > SHIFT_MIN_MEDIAN and m_k < m0 / SHIFT_GAIN):
        return None
    first = {"step": int(sample.step[0]), "sample_id": str(sample.sample_id[0]), "pos": int(sample.pos[0])}
    text = f"step {sample.step[0]}, sample {sample.sample_id[0]}, pos {sample.pos[0]}"
    return Issue(
        Code.SHIFTED,
        "error",
        int(sample.d0.size),
        f"{name_b} looks shifted by {shift} vs {name_a} (median |Δ| {m_k:.3g} at {shift}, {m0:.3g} at 0; "
        f"first: {text})",
        hint="re-import with pgdiag import --shift to put element i at the position of token i",
        rule=shift_rule(name_a=name_a, name_b=name_b),
        **first,
    )


def shift_issue(
    lp_a: np.ndarray, lp_b: np.ndarray, where: TokenLocations, *, name_a: str, name_b: str
) -> Issue | None:
    """E302: b looks shifted by ±1 position against a.

    m_k = median |a_i − b_{i+k}| over tokens i whose position i + 1 is the next loss token of the same sample,
    k ∈ {−1, 0, +1}; a shift is claimed when m_0 > `SHIFT_MIN_MEDIAN` and min(m_−1, m_+1) < m_0 / 2. The
    tokens i are every ceil(M / `STAT_SAMPLE_TOKENS`)-th of the M; a run read in pieces pools a `ShiftSample`.
    """
    m = lp_a.shape[0]
    if m < 2:
        return None
    sample = ShiftSample.of_piece(lp_a, lp_b, where, stride=max(1, -(-m // STAT_SAMPLE_TOKENS)))
    return shift_verdict(sample, name_a=name_a, name_b=name_b)


def value_issues(sides: list[tuple[np.ndarray, str]], where: TokenLocations) -> list[Issue]:
    """E207 (NaN or null, -inf, +inf) then E205 (above `LOGPROB_POSITIVE_TOL`), per side, on the paired tokens."""
    issues = []
    for code in (Code.NON_FINITE, Code.POSITIVE_LOGPROB):
        for values, name in sides:
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(values) if code == Code.NON_FINITE else values > LOGPROB_POSITIVE_TOL
            if not bad.any():
                continue
            text, first = locate(where, np.flatnonzero(bad))
            if code == Code.NON_FINITE:
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
                    rule=name,
                    **first,
                )
            )
    return issues


_HINTS = {
    Code.NON_FINITE: "drop the non-finite tokens with --ignore E207 (they are counted)",
    Code.POSITIVE_LOGPROB: "log-probs must be <= 0; a sign flip or a loss (negative log-prob) was stored?",
}
