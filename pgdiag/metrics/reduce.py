"""Reductions of docs/metrics.md: turn per-token and per-sample arrays into one number per step.

Every native metric is a per-token quantity x on the *valid* tokens of a step followed by one of the
reductions here: `R` (the user's `--metric-reduction`: token, sample or document weighting), `tok`
(a statistic of the token population: quantile, extremum, correlation), `seq` (a statistic over the S+
non-empty samples), `grp` (over prompt groups) or `step` (a closed form).

Why this shape: a step can hold 10M tokens, so every reduction is one vectorised numpy pass in float64.
Per-sample sums use `np.add.reduceat` over the contiguous token runs of each sample, which goes through
numpy's pairwise summation (docs/metrics.md), as does `np.sum` for whole-step sums. Nothing is
clamped and no epsilon is added: a zero denominator gives None (rule 2), and an infinite input stays
infinite (rule 4). Quantiles are Hyndman-Fan type 7 (numpy's default "linear"), computed from one
`np.partition` per array so that several quantiles cost one selection.

How: build a `TokenReducer` once per (batch, valid-token mask); turn token arrays (valid tokens only, in
sample order) into per-sample sums with `sample_sums`/`centred_m2`; then `rows(lo, hi)` gives the reducer of
one step and `mean_of_sums`/`spread_of_moments` its `R` values (`take_rows` slices a whole family table).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from pgdiag.metrics.settings import METRIC_REDUCTIONS


def _as_float(value: float | np.floating) -> float | None:
    """A Python float, None for NaN (a MetricValue never holds NaN)."""
    out = float(value)
    return None if math.isnan(out) else out


@dataclass(frozen=True)
class TokenReducer:
    """The valid-token layout of a run of samples and the `R` reduction chosen by `--metric-reduction`.

    Token arrays hold the N valid tokens in sample order (sample i owns ``starts[i]:starts[i] + N_i``).
    Every `R` value is computed from per-sample sums (S,), so a step is reduced from the slice of the
    per-sample tables of the whole batch (`rows`) without touching its tokens again.
    """

    mode: str  # token | sample | document
    n_per_sample: np.ndarray  # (S,) int64 N_i, valid tokens per sample
    starts: np.ndarray  # (S,) int64 start of sample i in the valid-token arrays
    doc_of_sample: np.ndarray  # (S,) int64 document index, 0-based and non-decreasing
    n_docs: int  # D, documents including fully masked ones

    @classmethod
    def build(
        cls, valid: np.ndarray, offsets: np.ndarray, doc_of_sample: np.ndarray, mode: str
    ) -> TokenReducer:
        """Reducer for the tokens where `valid` (M,) is true; `offsets` (S+1,) delimit the samples."""
        if mode not in METRIC_REDUCTIONS:
            raise ValueError(f"metric reduction must be one of {METRIC_REDUCTIONS}, got {mode!r}")
        lengths = np.diff(offsets).astype(np.int64)
        n_per_sample = lengths if valid.all() else segment_sums(valid, offsets[:-1], lengths).astype(np.int64)
        return cls.from_counts(n_per_sample, doc_of_sample, mode)

    @classmethod
    def from_counts(cls, n_per_sample: np.ndarray, doc_of_sample: np.ndarray, mode: str) -> TokenReducer:
        """Reducer for samples with `n_per_sample` (S,) valid tokens laid out back to back."""
        starts = _starts(n_per_sample)
        n_docs = int(doc_of_sample[-1] - doc_of_sample[0]) + 1 if doc_of_sample.shape[0] else 0
        return cls(mode, n_per_sample, starts, doc_of_sample - (doc_of_sample[0] if n_docs else 0), n_docs)

    @classmethod
    def concat(cls, parts: list[TokenReducer]) -> TokenReducer:
        """The reducer of the samples of `parts` (consecutive chunks of steps) back to back; each part's
        documents follow the previous part's (a document never spans two steps, so never two chunks)."""
        if not parts:
            raise ValueError("TokenReducer.concat needs at least one part")
        doc_base = np.cumsum([0] + [p.n_docs for p in parts[:-1]])  # (P,)
        return cls.from_counts(
            np.concatenate([p.n_per_sample for p in parts]),
            np.concatenate([p.doc_of_sample + base for p, base in zip(parts, doc_base, strict=True)]),
            parts[0].mode,
        )

    def rows(self, lo: int, hi: int) -> TokenReducer:
        """The reducer of samples lo..hi (a step), with starts and document indices rebased."""
        return TokenReducer.from_counts(self.n_per_sample[lo:hi], self.doc_of_sample[lo:hi], self.mode)

    def token_range(self, lo: int, hi: int) -> tuple[int, int]:
        """(first, end) position in the valid-token arrays of the tokens of samples lo..hi."""
        ends = self.starts + self.n_per_sample
        t_lo = int(self.starts[lo]) if lo < self.starts.shape[0] else self.n_tokens
        return t_lo, int(ends[hi - 1]) if hi > lo else t_lo

    @property
    def n_tokens(self) -> int:
        """N, the valid tokens of the step."""
        return int(self.n_per_sample.sum())

    @property
    def nonempty(self) -> np.ndarray:
        """(S,) bool: samples with N_i > 0."""
        return self.n_per_sample > 0

    @property
    def n_nonempty(self) -> int:
        """S+, samples with at least one valid token."""
        return int(np.count_nonzero(self.n_per_sample))

    @property
    def population(self) -> int:
        """The `n` of an `R` value: N tokens, S+ samples or D documents."""
        if self.mode == "token":
            return self.n_tokens
        return self.n_nonempty if self.mode == "sample" else self.n_docs

    def subset(self, keep: np.ndarray) -> TokenReducer:
        """Reducer for the valid tokens where `keep` (N,) is also true (a family with an extra test)."""
        offsets = np.concatenate([self.starts, [self.n_tokens]]).astype(np.int64)
        n_per_sample = segment_sums(keep, offsets[:-1], self.n_per_sample).astype(np.int64)
        return TokenReducer(self.mode, n_per_sample, _starts(n_per_sample), self.doc_of_sample, self.n_docs)

    def sample_sums(self, x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """(S,) float64 Σ_t m' x per sample (0 for empty samples; booleans are counted, through the float64
        `scratch` buffer when one is given)."""
        return segment_sums(x, self.starts, self.n_per_sample, scratch).astype(np.float64, copy=False)

    def sample_means(self, sums: np.ndarray) -> np.ndarray:
        """(S,) per-sample means from per-sample sums (0 for empty samples)."""
        return np.divide(sums, self.n_per_sample, out=np.zeros(sums.shape[0]), where=self.nonempty)

    def centred_m2(self, x: np.ndarray, sums: np.ndarray) -> np.ndarray:
        """(S,) Σ_t (x − x̄_i)², the within-sample centred second moment."""
        dev = x - self.broadcast(self.sample_means(sums))
        np.multiply(dev, dev, out=dev)
        return self.sample_sums(dev)

    def sample_max(self, x: np.ndarray) -> np.ndarray:
        """(S,) max of x within each sample; NaN for empty samples."""
        return self._sample_extreme(np.maximum, x)

    def sample_min(self, x: np.ndarray) -> np.ndarray:
        """(S,) min of x within each sample; NaN for empty samples."""
        return self._sample_extreme(np.minimum, x)

    def _sample_extreme(self, op: np.ufunc, x: np.ndarray) -> np.ndarray:
        out = np.full(self.n_per_sample.shape[0], np.nan)
        ne = self.nonempty
        if ne.any():
            out[ne] = op.reduceat(x, self.starts[ne])
        return out

    def broadcast(self, per_sample: np.ndarray) -> np.ndarray:
        """(N,) the per-sample values (S,) repeated over each sample's valid tokens."""
        return np.repeat(per_sample, self.n_per_sample)

    def mean_of_sums(self, sums: np.ndarray) -> float | None:
        """R(x) of docs/metrics.md from the per-sample sums (S,) of x; None without valid tokens."""
        n_tokens = self.n_tokens
        if n_tokens == 0:
            return None
        if self.mode == "token":
            return _as_float(np.sum(sums) / n_tokens)
        ne = self.nonempty
        if self.mode == "sample":
            return _as_float(np.sum(sums[ne] / self.n_per_sample[ne]) / np.count_nonzero(ne))
        doc_sums = np.bincount(self.doc_of_sample, weights=sums, minlength=self.n_docs)
        doc_tokens = np.bincount(self.doc_of_sample, weights=self.n_per_sample, minlength=self.n_docs)
        filled = doc_tokens > 0
        return _as_float(np.sum(doc_sums[filled] / doc_tokens[filled]) / self.n_docs)

    def spread_of_moments(self, sums: np.ndarray, centred_m2: np.ndarray) -> float | None:
        """sqrt(R((x − R(x))²)) from per-sample sums and within-sample centred moments (S,).

        Σ_t (x − c)² = M2_i + N_i (x̄_i − c)² per sample: a sum of non-negative terms, so no subtraction
        of squares and no second pass over the tokens.
        """
        centre = self.mean_of_sums(sums)
        if centre is None:
            return None
        gap = self.sample_means(sums) - centre
        value = self.mean_of_sums(centred_m2 + self.n_per_sample * gap * gap)
        return None if value is None else math.sqrt(value)


def _starts(n_per_sample: np.ndarray) -> np.ndarray:
    """(S,) start of each sample's run when runs of `n_per_sample` lie back to back."""
    starts = np.zeros(n_per_sample.shape[0], dtype=np.int64)
    if n_per_sample.shape[0] > 1:
        np.cumsum(n_per_sample[:-1], out=starts[1:])
    return starts


SAMPLE_AXIS = MappingProxyType({"axis": "sample"})  # field metadata: a per-sample (S,) array of a table
TOKEN_AXIS = MappingProxyType({"axis": "token"})  # field metadata: a per-token (N,) array of a table
# a per-token array of which only the min and max are reported: pooled over chunks as extrema, not quantiles
TOKEN_EXTREMA_AXIS = MappingProxyType({"axis": "token", "pooled": "extrema"})


TableT = TypeVar("TableT")


def take_rows(table: TableT, lo: int, hi: int) -> TableT:
    """The family table of samples lo..hi: its reducer, per-sample fields and per-token fields sliced.

    `table` is a frozen dataclass with a `reducer` field and fields whose metadata is SAMPLE_AXIS or TOKEN_AXIS.
    Slices are views: reducing a step costs nothing per token except its token statistics. A token field that
    is a pooled summary (`metrics.pooled`, the ``all`` row of a run read in chunks) covers every row and is
    kept as it is: such a table is only reduced whole.
    """
    reducer: TokenReducer = table.reducer  # type: ignore[attr-defined]
    t_lo, t_hi = reducer.token_range(lo, hi)
    updates: dict[str, Any] = {"reducer": reducer.rows(lo, hi)}
    for spec in fields(table):  # type: ignore[arg-type]
        axis = spec.metadata.get("axis")
        value = getattr(table, spec.name)
        if axis is None or value is None:
            continue
        if axis == "sample":
            updates[spec.name] = value[lo:hi]
        elif isinstance(value, np.ndarray):
            updates[spec.name] = value[t_lo:t_hi]
    return replace(table, **updates)  # type: ignore[type-var]


def segment_sums(
    x: np.ndarray, starts: np.ndarray, lengths: np.ndarray, scratch: np.ndarray | None = None
) -> np.ndarray:
    """(S,) sums of the runs ``x[starts[i]:starts[i] + lengths[i]]``; empty runs give 0.

    `np.add.reduceat` returns ``x[start]`` for an empty run, so only non-empty runs are reduced. Booleans
    and integers are summed as int64 counts, or, given a float64 `scratch` buffer at least as long as x,
    copied into it and summed as float64 (exact below 2^53, and 2x faster: numpy's integer reduceat does
    not vectorise).
    """
    if x.dtype == np.bool_ and scratch is not None:
        flags = scratch[: x.shape[0]]
        np.copyto(flags, x)
        x = flags
    counting = x.dtype == np.bool_ or np.issubdtype(x.dtype, np.integer)
    out = np.zeros(lengths.shape[0], dtype=np.int64 if counting else np.float64)
    nonempty = lengths > 0
    if x.shape[0] and nonempty.any():
        out[nonempty] = np.add.reduceat(x, starts[nonempty], dtype=out.dtype)
    return out


def quantiles(x: np.ndarray, qs: tuple[float, ...]) -> list[float | None]:
    """Type-7 quantiles of x (linear interpolation between order statistics, numpy's default).

    Exact for every input. Small arrays use one `np.partition` for every q. Large arrays first locate each
    needed order statistic in a sorted systematic subsample, then select it among the few elements
    between two bracketing values (one comparison pass instead of a 10M-element partition); a bracket
    that misses the order statistic falls back to the full partition. Two equal order statistics give
    that value even when it is infinite (numpy's interpolation would give NaN from inf − inf there).
    """
    return type7_quantiles(x.shape[0], qs, lambda ranks: _order_statistics(x, ranks))


def type7_quantiles(
    n: int, qs: tuple[float, ...], order_statistics: Callable[[list[int]], dict[int, float]]
) -> list[float | None]:
    """Type-7 quantiles of a population of `n` values from its order statistics (`order_statistics(ranks)`
    -> {rank: value}, 0-based): the same two-sided lerp as numpy.quantile, so both agree bit for bit on
    finite data; None for an empty population and for a NaN result."""
    if n == 0:
        return [None] * len(qs)
    positions = [(n - 1) * q for q in qs]
    stats = order_statistics(sorted({math.floor(h) for h in positions} | {math.ceil(h) for h in positions}))
    out: list[float | None] = []
    for h in positions:
        lo, hi = math.floor(h), math.ceil(h)
        a, b = stats[lo], stats[hi]
        t = h - lo
        if a == b or t == 0.0:
            out.append(_as_float(a))
            continue
        with np.errstate(invalid="ignore"):
            diff = b - a
            value = b - diff * (1.0 - t) if t >= 0.5 else a + diff * t
        out.append(_as_float(value))
    return out


_BRACKET_MIN_SIZE = 1 << 18  # below this a full partition is as fast as bracketing
_SUBSAMPLE_SIZE = 1 << 16
_MIN_STRIDE = 64  # a subsample of at least 1/64 of the array costs more to sort than it saves
_MERGE_SPAN = 0.08  # brackets closer than this share of the subsample are selected in one pass


def _order_statistics(x: np.ndarray, ranks: list[int]) -> dict[int, float]:
    """{k: k-th smallest element of x (0-based)} for the sorted `ranks`.

    Large arrays: each rank's position in a sorted systematic subsample gives a value bracket wide
    enough (6 binomial standard deviations) to hold it; nearby brackets are merged; one comparison pass
    per bracket counts the elements below it and extracts those inside, which are then partitioned. The
    count proves the bracket holds the rank, otherwise the full partition is used, so the result is exact.
    """
    n = x.shape[0]
    if n < _BRACKET_MIN_SIZE:
        part = np.partition(x, ranks)
        return {k: float(part[k]) for k in ranks}
    sub = np.sort(x[:: max(n // _SUBSAMPLE_SIZE, _MIN_STRIDE)])  # (≤ 65536,) systematic subsample
    k_sub = sub.shape[0]
    brackets: list[list] = []  # [first subsample index, last subsample index, ranks]
    for rank in ranks:
        q = rank / (n - 1)
        centre = q * (k_sub - 1)
        margin = int(6.0 * math.sqrt(k_sub * q * (1.0 - q))) + 16
        first, last = max(math.floor(centre) - margin, 0), min(math.ceil(centre) + margin, k_sub - 1)
        if brackets and last - brackets[-1][0] <= _MERGE_SPAN * k_sub:
            brackets[-1][1] = max(brackets[-1][1], last)
            brackets[-1][2].append(rank)
        else:
            brackets.append([first, last, [rank]])
    found: dict[int, float] = {}
    for first, last, group in brackets:
        lo_val = -math.inf if first == 0 else float(sub[first])
        hi_val = math.inf if last == k_sub - 1 else float(sub[last])
        at_least_lo = x >= lo_val  # (n,)
        below = n - int(np.count_nonzero(at_least_lo))
        inside = x[at_least_lo & (x <= hi_val)]
        if not all(below <= k < below + inside.shape[0] for k in group):
            part = np.partition(x, ranks)
            return {k: float(part[k]) for k in ranks}
        part = np.partition(inside, [k - below for k in group])
        found.update({k: float(part[k - below]) for k in group})
    return found


def extremum(x: np.ndarray, kind: str) -> float | None:
    """min or max of x; None when x is empty."""
    if x.shape[0] == 0:
        return None
    return _as_float(np.min(x) if kind == "min" else np.max(x))


def plain_mean(x: np.ndarray) -> float | None:
    """Unweighted mean (pairwise sum); None when empty. Used for `seq` and `grp` statistics."""
    return None if x.shape[0] == 0 else _as_float(np.sum(x) / x.shape[0])


def plain_sd(x: np.ndarray) -> float | None:
    """Population standard deviation sqrt(mean((x − mean)²)); None when empty."""
    centre = plain_mean(x)
    if centre is None:
        return None
    return _as_float(math.sqrt(np.sum(np.square(x - centre)) / x.shape[0]))


def fraction(flags: np.ndarray) -> float | None:
    """Unweighted fraction of true flags; None when empty."""
    return None if flags.shape[0] == 0 else np.count_nonzero(flags) / flags.shape[0]


@dataclass(frozen=True)
class LinearFit:
    """Pearson correlation and OLS line y ≈ intercept + slope·x with its RMS residual (None when undefined)."""

    pearson_r: float | None
    slope: float | None
    intercept: float | None
    resid_rms: float | None


def linear_fit(x: np.ndarray, y: np.ndarray) -> LinearFit:
    """Pearson r and OLS fit of y on x, from centred sums (no subtraction of squares).

    r is None when either side is constant; slope, intercept and residual are None when x is constant.
    Products go through one reused scratch buffer and pairwise `np.sum` (a 10M-token step would otherwise
    allocate four more arrays).
    """
    n = x.shape[0]
    if n == 0:
        return LinearFit(None, None, None, None)
    mx, my = np.sum(x) / n, np.sum(y) / n
    if not (math.isfinite(mx) and math.isfinite(my)):
        return LinearFit(None, None, None, None)
    dx, dy = x - mx, y - my  # (n,)
    scratch = np.empty_like(dx)

    def sum_of_products(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sum(np.multiply(a, b, out=scratch)))

    sxx, syy, sxy = sum_of_products(dx, dx), sum_of_products(dy, dy), sum_of_products(dx, dy)
    pearson_r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None
    if sxx == 0:
        return LinearFit(pearson_r, None, None, None)
    slope = sxy / sxx
    np.multiply(dx, slope, out=scratch)
    dy -= scratch  # residuals
    resid_rms = math.sqrt(sum_of_products(dy, dy) / n)
    return LinearFit(pearson_r, slope, float(my - slope * mx), resid_rms)


def log_sum_exp(x: np.ndarray) -> float:
    """ln Σ exp(x), shifted by the maximum; −inf for an empty array."""
    if x.shape[0] == 0:
        return -math.inf
    top = float(np.max(x))
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(x - top))))


def ess_from_log_weights(log_w: np.ndarray) -> float | None:
    """Normalised Kish ESS (Σw)² / (n Σw²) of weights w = exp(log_w), in log space.

    exp(2 LSE(log_w) − ln n − LSE(2 log_w)): no overflow for product ratios W_i = exp(Σd_i) of long
    samples. None for an empty population or non-finite log weights.
    """
    n = log_w.shape[0]
    if n == 0 or not np.all(np.isfinite(log_w)):
        return None
    return _as_float(math.exp(2.0 * log_sum_exp(log_w) - math.log(n) - log_sum_exp(2.0 * log_w)))
