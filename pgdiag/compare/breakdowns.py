"""Bucket assignments for the compare breakdowns (`breakdown` values, docs/compare.md).

What: for an `AlignedPair`, each breakdown maps every matched token to an integer bucket code with a label and
numeric edges: `position` (response position: the first token alone, then doubling buckets), `prob_bucket`
(probability of the sampled token on side a, the reference side), `entropy_bucket` (when an entropy stream is
present), `length` (matched loss tokens of the sample, doubling buckets), `step`, `env`, and `lag` (only on request:
the staleness of side a's tokens, `pgdiag.data.versions`, given as `lag`).
Why: the same parity engine (`parity.token_table`) then computes every bucket in one vectorised pass, so
"where do the two sides disagree" costs O(tokens) per breakdown, never a Python loop over tokens.
How: `assign(pair, name, lag)` returns `Buckets` (codes, labels, lo, hi); `available(pair)` lists the breakdowns
the data supports (every one but `lag`, which reads the run's versions). Edges are half-open [lo, hi); the top probability bucket is closed at 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from pgdiag.compare.align import AlignedPair
from pgdiag.compare.settings import BREAKDOWNS
from pgdiag.data.versions import LAG_HI, LAG_LABELS, LAG_LO, lag_codes
from pgdiag.errors import Code, InvalidInputError, UsageError

PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0)
ENTROPY_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, np.inf)  # nats
LOOKUP_LIMIT = 1 << 16  # integer buckets up to this edge use a lookup table
DOUBLING_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, np.inf)


@dataclass(frozen=True)
class Buckets:
    """Token bucket codes of one breakdown. K buckets; `codes` (M,) int64 in [0, K).

    A breakdown constant within each sample keeps only its (S,) `sample_codes` and the (M,) `token_sample`
    it already has (the pair's `token_row`): `codes` gathers them on access, since the parity tables bucket
    such breakdowns per sample and never need the (M,) array (80 MB at 10M tokens).
    """

    name: str
    token_codes: np.ndarray | None  # (M,) intp; None when given by sample_codes[token_sample]
    labels: tuple[str, ...]  # (K,)
    lo: np.ndarray  # (K,) float64, None-like NaN for categorical buckets
    hi: np.ndarray  # (K,) float64
    sample_codes: np.ndarray | None = None  # (S,) int64 when the bucket is constant within each sample
    token_sample: np.ndarray | None = None  # (M,) sample owning each token, with sample_codes

    @property
    def n_buckets(self) -> int:
        return len(self.labels)

    @property
    def codes(self) -> np.ndarray:
        """(M,) bucket of every token (a new array on each access for per-sample breakdowns)."""
        if self.token_codes is not None:
            return self.token_codes
        return self.sample_codes[self.token_sample]


def available(pair: AlignedPair) -> tuple[str, ...]:
    """The breakdowns `pair` has data for (entropy needs an entropy stream, env an env column)."""
    names = ["position", "prob_bucket"]
    if pair.entropy is not None:
        names.append("entropy_bucket")
    names += ["length", "step"]
    if pair.env is not None:
        names.append("env")
    return tuple(names)


def _interval_label(lo: float, hi: float, *, closed: bool = False, integer: bool = False) -> str:
    def fmt(x: float) -> str:
        if np.isinf(x):
            return "inf"
        return str(int(x)) if integer else f"{x:g}"

    if integer and hi == lo + 1:
        return fmt(lo)
    return f"[{fmt(lo)},{fmt(hi)}{']' if closed else ')'}"


def _numeric(
    name: str, values: np.ndarray, edges: tuple[float, ...], *, integer: bool, top_closed: bool
) -> Buckets:
    """Half-open [lo, hi) buckets of `values` (the top one closed when `top_closed`); codes (M,) intp."""
    edge_array = np.asarray(edges, dtype=np.float64)
    k = edge_array.shape[0] - 1
    finite_top = float(edge_array[np.isfinite(edge_array)].max())
    if np.issubdtype(values.dtype, np.integer) and edge_array[0] == 0 and finite_top <= LOOKUP_LIMIT:
        # small non-negative integers (positions, lengths): one table lookup instead of a binary search
        if values.size and values.min() < 0:
            raise InvalidInputError(
                Code.LOSS_WITHOUT_CONTEXT,
                f"{name}: a loss position lies before prompt_len (value {values.min()})",
                None,
            )
        lookup = np.searchsorted(edge_array, np.arange(finite_top + 1), side="right") - 1  # (top + 1,)
        highest = int(values.max()) if values.size else 0
        if highest <= 2 * LOOKUP_LIMIT:  # the table extended by its last code, so no (M,) clipped copy
            lookup = np.concatenate([lookup, np.full(max(highest - int(finite_top), 0), lookup[-1])])
            codes = lookup[values]
        else:
            codes = lookup[np.minimum(values, int(finite_top))]
    else:
        codes = _bucket_codes(values, edge_array)
    labels = tuple(
        _interval_label(edge_array[i], edge_array[i + 1], closed=top_closed and i == k - 1, integer=integer)
        for i in range(k)
    )
    return Buckets(
        name, codes.astype(np.intp, copy=False), labels, edge_array[:-1].copy(), edge_array[1:].copy()
    )


def _bucket_codes(values: np.ndarray, edge_array: np.ndarray) -> np.ndarray:
    """(M,) intp bucket of each value: the number of inner edges <= value, so [lo, hi) buckets with values below
    the first edge in the first bucket and values on or above the last edge (top_closed) in the last; NaN in the
    last. The same codes as ``clip(searchsorted(edges, values, "right") − 1, 0, K − 1)``, by one comparison per
    inner edge into an int8 count (a few edges: 3x faster than the binary search over M values)."""
    k = edge_array.shape[0] - 1
    inner = edge_array[
        1:-1
    ]  # np.float64 scalars: the comparison is made in float64 whatever the values' dtype
    if inner.shape[0] > 127:
        codes = np.searchsorted(edge_array, values, side="right")
        codes -= 1
        np.minimum(codes, k - 1, out=codes)
        return np.maximum(codes, 0, out=codes)
    count = np.zeros(values.shape, dtype=np.int8)  # (M,)
    above = np.empty(values.shape, dtype=np.bool_)  # (M,)
    for edge in inner:
        count += np.greater_equal(values, edge, out=above)
    if np.issubdtype(values.dtype, np.floating):
        count[np.isnan(values)] = k - 1  # sorted after every edge by the binary search
    return count.astype(np.intp)


def _categorical(name: str, per_sample: np.ndarray, sample: np.ndarray, *, numeric: bool) -> Buckets:
    """Buckets of a sample-level label (unique over samples, then broadcast to tokens)."""
    uniques, codes = np.unique(per_sample, return_inverse=True)
    labels = tuple(str(u) for u in uniques)
    edges = uniques.astype(np.float64) if numeric else np.full(uniques.shape[0], np.nan)
    sample_codes = codes.astype(np.int64).reshape(-1)
    return Buckets(name, None, labels, edges, edges.copy(), sample_codes, sample)


def assign(pair: AlignedPair, name: str, lag: np.ndarray | None = None) -> Buckets:
    """Bucket codes of breakdown `name` for the tokens of `pair` (`lag` (M,): each token's lag, for `lag`)."""
    if name == "position":
        return _numeric(name, pair.resp_pos, DOUBLING_EDGES, integer=True, top_closed=False)
    if name == "prob_bucket":  # bucket on lp_a against ln(edges): no exp over M tokens
        log_edges = (-np.inf, *(float(np.log(e)) for e in PROB_EDGES[1:]))
        buckets = _numeric(name, pair.lp_a, log_edges, integer=False, top_closed=True)
        labels = tuple(_interval_label(lo, hi, closed=hi == 1.0) for lo, hi in pairwise(PROB_EDGES))
        return Buckets(name, buckets.codes, labels, np.array(PROB_EDGES[:-1]), np.array(PROB_EDGES[1:]))
    if name == "entropy_bucket":
        if pair.entropy is None:
            raise UsageError(
                Code.STREAM_NOT_FOUND,
                f"{pair.pair}: --by entropy_bucket needs an entropy stream (run logprobs)",
            )
        return _numeric(name, pair.entropy, ENTROPY_EDGES, integer=False, top_closed=False)
    if name == "lag":
        if lag is None:
            raise UsageError(Code.MISSING_SETTING, f"{pair.pair}: --by lag needs the lag of side a's tokens")
        return Buckets(name, lag_codes(lag), LAG_LABELS, np.array(LAG_LO), np.array(LAG_HI))
    sample = pair.token_sample()
    if name == "length":
        per_sample = _numeric(
            name, pair.n_loss.astype(np.float64), DOUBLING_EDGES, integer=True, top_closed=False
        )
        return Buckets(name, None, per_sample.labels, per_sample.lo, per_sample.hi, per_sample.codes, sample)
    if name == "step":
        return _categorical(name, pair.step, sample, numeric=True)
    if name == "env":
        if pair.env is None:
            raise UsageError(Code.MISSING_SETTING, f"{pair.pair}: --by env needs an env column")
        return _categorical(name, np.asarray([str(e) for e in pair.env], dtype=object), sample, numeric=False)
    raise UsageError(
        Code.BAD_OPTION_VALUE, f"unknown breakdown {name!r}", f"choose from {', '.join(BREAKDOWNS)}"
    )
