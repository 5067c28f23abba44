"""Mergeable token summaries for the pooled ``all`` row when a run is read in chunks of steps.

What: `QuantileSummary` holds the values of one token array (the log-ratio d, |Δ|, |Δp|, the entropy)
over every chunk read so far and answers type-7 quantiles, min and max; `TokenExtrema` holds only the
count, min and max (the ratio r). Both `add` an array, `merge` another summary, and never keep a chunk's
arrays alive beyond what the rule below needs.

The rule (docs/metrics.md): while the pooled count is at most `QuantileSettings.exact_limit` values
(default 16,000,000) the summary keeps the values themselves and `quantiles` is `reduce.quantiles` on their
concatenation: identical to a whole-run read, bit for bit. Past the limit it becomes a sketch of
log-spaced buckets: |x| in (γ^(k−1), γ^k] with γ = (1 + α)/(1 − α) is counted in bucket k of its sign,
zeros, −inf, +inf and NaN are counted apart, and a bucket answers γ^(k−1)(1 + α), clamped to the exact min
and max. Every order statistic is then within relative error α (`relative_error`, default 1e-4, plus
float64 rounding), and a type-7 quantile, the interpolation t between order statistics a and b, within
α·((1 − t)|a| + t|b|) (α·|q| when a and b share a sign). Order statistics that are ±inf, 0, the min or the
max stay exact. Bucket counts add, so merging is exact and associative: the sketch of a union is the
same whichever order the parts were merged in.

Why: a 100M-token run holds 800 MB per float64 token array; the sketch holds at most a few million
(key, count) pairs per sign and usually far fewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Generic, TypeVar

import numpy as np

from pgdiag.errors import Code, UsageError
from pgdiag.metrics.reduce import TokenReducer, extremum, quantiles, type7_quantiles

__all__ = [
    "QuantileSettings",
    "QuantileSummary",
    "TablePool",
    "TokenExtrema",
    "extremum_of",
    "quantiles_of",
]


@dataclass(frozen=True)
class QuantileSettings:
    """When a pooled quantile stops being exact, and the sketch's bound after that."""

    exact_limit: int = 16_000_000  # values per array kept exactly (128 MB of float64)
    relative_error: float = 1e-4  # α: relative error of each sketched order statistic

    def __post_init__(self) -> None:
        if self.exact_limit < 0:
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"quantile exact limit must be >= 0, got {self.exact_limit}"
            )
        if not 0.0 < self.relative_error < 0.5:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"quantile relative error must be in (0, 0.5), got {self.relative_error}",
            )


class QuantileSummary:
    """Type-7 quantiles, min and max of a pooled token array, exact up to `settings.exact_limit` values.

    Exact mode keeps the added arrays (float64 copies); sketch mode keeps sorted bucket keys and counts
    per sign: ``keys_pos`` (K+,) int64 with ``counts_pos`` (K+,) int64, the same for |x| of negatives,
    and the counts of 0, −inf, +inf and NaN.
    """

    def __init__(self, settings: QuantileSettings | None = None) -> None:
        self.settings = settings or QuantileSettings()
        alpha = self.settings.relative_error
        self._log_gamma = math.log1p(2.0 * alpha / (1.0 - alpha))  # ln γ, γ = (1 + α)/(1 − α)
        self.n = 0
        self.min = math.inf
        self.max = -math.inf
        self._has_nan = False
        self._values: list[np.ndarray] | None = []  # exact mode; None once sketched
        empty = np.zeros(0, dtype=np.int64)
        self.keys_pos, self.counts_pos = empty, empty
        self.keys_neg, self.counts_neg = empty, empty
        self.n_zero = self.n_neg_inf = self.n_pos_inf = self.n_nan = 0

    @classmethod
    def of(cls, x: np.ndarray, settings: QuantileSettings | None = None) -> QuantileSummary:
        """The summary of one array."""
        summary = cls(settings)
        summary.add(x)
        return summary

    @property
    def is_exact(self) -> bool:
        """True while the quantiles equal `reduce.quantiles` on the concatenated values."""
        return self._values is not None

    def add(self, x: np.ndarray) -> None:
        """Pool the values of `x` (N,) (copied; the caller may free or reuse x)."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if x.shape[0] == 0:
            return
        self._extend_extrema(x)
        self.n += x.shape[0]
        if self._values is not None and self.n <= self.settings.exact_limit:
            self._values.append(x.copy())
            return
        self._to_sketch()
        self._count(x)

    def merge(self, other: QuantileSummary) -> QuantileSummary:
        """A new summary of both populations (neither input changes)."""
        if other.settings != self.settings:
            raise ValueError("cannot merge quantile summaries with different settings")
        out = QuantileSummary(self.settings)
        for part in (self, other):
            if part.n == 0:
                continue
            if part._values is not None:
                for x in part._values:
                    out.add(x)
                continue
            out._to_sketch()
            out._extend_extrema(np.array([part.min, part.max]))
            out._has_nan |= part._has_nan
            out.n += part.n
            out.keys_pos, out.counts_pos = _merge_counts(
                out.keys_pos, out.counts_pos, part.keys_pos, part.counts_pos
            )
            out.keys_neg, out.counts_neg = _merge_counts(
                out.keys_neg, out.counts_neg, part.keys_neg, part.counts_neg
            )
            out.n_zero += part.n_zero
            out.n_neg_inf += part.n_neg_inf
            out.n_pos_inf += part.n_pos_inf
            out.n_nan += part.n_nan
        return out

    def quantiles(self, qs: tuple[float, ...]) -> list[float | None]:
        """Type-7 quantiles (None for an empty population): exact, or within the bound of the module doc."""
        if self._values is not None:
            pooled = np.concatenate(self._values) if len(self._values) > 1 else np.zeros(0)
            return quantiles(self._values[0] if len(self._values) == 1 else pooled, qs)
        return type7_quantiles(
            self.n,
            qs,
            lambda ranks: dict(
                zip(ranks, self._order_statistics(np.asarray(ranks, dtype=np.int64)), strict=True)
            ),
        )

    def extremum(self, kind: str) -> float | None:
        """The exact min or max; None when empty or when a value is NaN (as `reduce.extremum`)."""
        if self.n == 0 or self._has_nan:
            return None
        return self.min if kind == "min" else self.max

    def _extend_extrema(self, x: np.ndarray) -> None:
        lo, hi = float(np.min(x)), float(np.max(x))
        if math.isnan(lo) or math.isnan(hi):
            self._has_nan = True
            return
        self.min, self.max = min(self.min, lo), max(self.max, hi)

    def _to_sketch(self) -> None:
        """Move the exact values into buckets (once)."""
        if self._values is None:
            return
        held, self._values = self._values, None
        for x in held:
            self._count(x)

    def _count(self, x: np.ndarray) -> None:
        """Add the values of x to the bucket counts (a few vectorised passes, no sort)."""
        n_nan = int(np.count_nonzero(np.isnan(x)))
        n_pos_inf = int(np.count_nonzero(x == math.inf))
        n_neg_inf = int(np.count_nonzero(x == -math.inf))
        n_zero = int(np.count_nonzero(x == 0.0))
        self.n_nan += n_nan
        self.n_pos_inf += n_pos_inf
        self.n_neg_inf += n_neg_inf
        self.n_zero += n_zero
        special = n_nan + n_pos_inf + n_neg_inf + n_zero
        values = x if special == 0 else x[np.isfinite(x) & (x != 0.0)]  # (F,) finite, non-zero
        if values.shape[0] == 0:
            return
        scaled = np.abs(values)  # (F,) |x| -> ceil(ln|x| / ln γ) in place
        np.log(scaled, out=scaled)
        scaled *= 1.0 / self._log_gamma
        np.ceil(scaled, out=scaled)
        keys = scaled.astype(np.int64)
        del scaled
        keys *= 2
        keys += values < 0  # the sign in the lowest bit: one bincount for both signs
        keys, counts = _key_counts(keys)
        negative = (keys & 1).astype(bool)
        keys >>= 1
        self.keys_pos, self.counts_pos = _merge_counts(
            self.keys_pos, self.counts_pos, keys[~negative], counts[~negative]
        )
        self.keys_neg, self.counts_neg = _merge_counts(
            self.keys_neg, self.counts_neg, keys[negative], counts[negative]
        )

    def _bucket_value(self, key: int, sign: int) -> float:
        """The value a bucket answers: γ^(k−1)(1 + α), signed, clamped to [min, max]."""
        alpha = self.settings.relative_error
        with np.errstate(over="ignore"):
            magnitude = math.exp(min((key - 1) * self._log_gamma + math.log1p(alpha), 710.0))
        return min(max(sign * magnitude, self.min), self.max)

    def _order_statistics(self, ranks: np.ndarray) -> list[float]:
        """The k-th smallest values (0-based) in the order −inf, negatives, 0, positives, +inf, NaN."""
        n_neg = self.keys_neg.shape[0]
        counts = np.concatenate(
            [
                [self.n_neg_inf],
                self.counts_neg[::-1],
                [self.n_zero],
                self.counts_pos,
                [self.n_pos_inf, self.n_nan],
            ]
        ).astype(np.int64)  # (B,) segments in value order
        segment = np.searchsorted(np.cumsum(counts), ranks, side="right")  # (R,)
        out = []
        last_number = self.n - self.n_nan - 1  # rank of the max (NaN sorts last)
        for rank, index in zip(ranks.tolist(), segment.tolist(), strict=True):
            if rank == 0 and last_number >= 0:
                out.append(self.min)  # the ends are exact
            elif rank == last_number:
                out.append(self.max)
            elif index == 0:
                out.append(-math.inf)
            elif index <= n_neg:
                out.append(self._bucket_value(int(self.keys_neg[n_neg - index]), -1))
            elif index == n_neg + 1:
                out.append(0.0)
            elif index <= n_neg + 1 + self.keys_pos.shape[0]:
                out.append(self._bucket_value(int(self.keys_pos[index - n_neg - 2]), 1))
            else:
                out.append(math.inf if index == counts.shape[0] - 2 else math.nan)
        return out


@dataclass(frozen=True)
class TokenExtrema:
    """The count, min and max of a pooled token array whose quantiles no metric needs (the ratio r)."""

    n: int = 0
    min: float = math.inf
    max: float = -math.inf

    @classmethod
    def of(cls, x: np.ndarray) -> TokenExtrema:
        if x.shape[0] == 0:
            return cls()
        return cls(int(x.shape[0]), float(np.min(x)), float(np.max(x)))

    def merge(self, other: TokenExtrema) -> TokenExtrema:
        return TokenExtrema(self.n + other.n, min(self.min, other.min), max(self.max, other.max))

    def extremum(self, kind: str) -> float | None:
        if self.n == 0:
            return None
        value = self.min if kind == "min" else self.max
        return None if math.isnan(value) else value


def quantiles_of(x: np.ndarray | QuantileSummary, qs: tuple[float, ...]) -> list[float | None]:
    """Type-7 quantiles of a token array (`reduce.quantiles`) or of a pooled summary."""
    return x.quantiles(qs) if isinstance(x, QuantileSummary) else quantiles(x, qs)


def extremum_of(x: np.ndarray | QuantileSummary | TokenExtrema, kind: str) -> float | None:
    """min or max of a token array (`reduce.extremum`) or of a pooled summary."""
    return x.extremum(kind) if isinstance(x, QuantileSummary | TokenExtrema) else extremum(x, kind)


def _key_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys and their counts, by one `bincount` over the keys' range (at most ~7.3M buckets
    per sign for α = 1e-4: float64 magnitudes span 1454 nats), O(N) where a sort would be O(N log N)."""
    lowest = int(keys.min())
    counts = np.bincount(keys - lowest)  # (K_range,)
    present = np.flatnonzero(counts)
    return present.astype(np.int64) + lowest, counts[present].astype(np.int64)


def _merge_counts(
    keys_a: np.ndarray, counts_a: np.ndarray, keys_b: np.ndarray, counts_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted union of two (key, count) tables with the counts of equal keys added."""
    if keys_a.shape[0] == 0:
        return keys_b, counts_b
    if keys_b.shape[0] == 0:
        return keys_a, counts_a
    keys, inverse = np.unique(np.concatenate([keys_a, keys_b]), return_inverse=True)
    counts = np.bincount(
        inverse.reshape(-1), weights=np.concatenate([counts_a, counts_b]), minlength=keys.shape[0]
    )
    return keys, counts.astype(np.int64)


TableT = TypeVar("TableT")


class TablePool(Generic[TableT]):
    """One family table (`metrics.reduce.take_rows`'s shape) pooled over consecutive chunks of steps.

    `add` keeps a chunk's per-sample fields (S,) and folds its token fields (N,) into summaries: a
    `QuantileSummary` per token field, a `TokenExtrema` for fields marked ``pooled = extrema``. `pooled`
    gives one table over every chunk's samples whose per-sample fields are the concatenation (the same
    arrays a whole-run read builds) and whose token fields are those summaries; reduce it whole.
    """

    def __init__(self, settings: QuantileSettings) -> None:
        self.settings = settings
        self._reducers: list[TokenReducer] = []
        self._samples: dict[str, list[np.ndarray]] = {}
        self._tokens: dict[str, QuantileSummary | TokenExtrema] = {}
        self._template: Any = None

    def add(self, table: TableT) -> None:
        """Pool the rows of one chunk's `table` (its arrays are not kept, except per-sample ones)."""
        self._reducers.append(table.reducer)  # type: ignore[attr-defined]
        template: dict[str, Any] = {}
        for spec in fields(table):  # type: ignore[arg-type]
            axis = spec.metadata.get("axis")
            value = getattr(table, spec.name)
            if axis is None or value is None:
                continue
            template[spec.name] = None
            if axis == "sample":
                self._samples.setdefault(spec.name, []).append(value)
            elif spec.metadata.get("pooled") == "extrema":
                held = self._tokens.get(spec.name, TokenExtrema())
                self._tokens[spec.name] = held.merge(TokenExtrema.of(value))  # type: ignore[union-attr]
            else:
                summary = self._tokens.setdefault(spec.name, QuantileSummary(self.settings))
                summary.add(value)  # type: ignore[union-attr]
        if self._template is None:
            self._template = replace(table, **template)  # type: ignore[type-var]
        elif set(template) != {*self._samples, *self._tokens}:
            raise ValueError("chunks of one run gave family tables with different fields")

    def pooled(self) -> TableT:
        """The table of every pooled sample (per-sample fields concatenated, token fields summarised)."""
        if self._template is None:
            raise ValueError("TablePool.pooled needs at least one chunk")
        updates: dict[str, Any] = {"reducer": TokenReducer.concat(self._reducers)}
        for name, parts in self._samples.items():
            updates[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        updates.update(self._tokens)
        return replace(self._template, **updates)  # type: ignore[no-any-return]

    @property
    def exact(self) -> bool:
        """True when every token quantile of the pooled table is exact."""
        return all(not isinstance(t, QuantileSummary) or t.is_exact for t in self._tokens.values())
