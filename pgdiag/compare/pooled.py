"""The parity tables of a comparison read step by step: per-piece partials merged into the tables of the whole run.

What: `PooledParity.add(pair)` takes the `AlignedPair` of one piece (a group of consecutive steps of both runs,
docs/compare.md) and keeps what the tables need: each piece's own token and breakdown tables, the sums and
co-moments behind the fits, each matched sample's mean log-probs (the sequence scope), the Δ histogram counts,
the worst tokens and sequences, the signatures' sums, and an evenly strided sample of tokens (bucket quantiles
and token plots); a run read in one piece keeps that piece's tables only. `token_table`, `sequence_table`,
`bucket_rows` and `worst` then give the tables of the whole run, which `compare.pair_report.parity_rows` reports.
Why: peak memory then follows the largest piece, not the run, and the numbers are those of the run read whole:
  * a table or bucket seen in one piece only (every `step` bucket; everything when the run is one piece) is that
    piece's own values, bit for bit;
  * counts, maxima, the Δ histogram, worst-K and the sequence scope (means of each sample, concatenated in
    step order, then the same `sequence_table`) are exact;
  * pooled means are Σ n·mean / Σ n and spreads use Chan's parallel update (n_a n_b / n · δ²) of the pieces'
    (n, mean, M2), fits the pooled co-moments (`Comoments`): these move by rounding only (relative ~1e-15);
    ``fit_resid_rms`` comes from the co-moments of (lp_a, Δ): Σ r² = S_ΔΔ − S_aΔ² / S_aa (exactly 0 when the
    streams are equal), within ~1e-12 relative of the direct residual;
  * the `all` |Δ| and |Δp| quantiles pooled over pieces come from `metrics.pooled.QuantileSummary` (the one
    pooled quantile of pgdiag): exact order statistics up to 16M tokens (its interpolation may round the last
    bit differently from `parity._quantiles`), past that a sketch within relative 1e-4 (docs/compare.md);
  * breakdown |Δ| quantiles of buckets spread over several pieces come from every k-th token of the run,
    k = 1 up to 2 × `QUANTILE_SAMPLE_TOKENS` tokens (exact), then doubled as the run grows: a strided subsample,
    as the whole-run table already took above that size (there with k = M // QUANTILE_SAMPLE_TOKENS).
How: `add` runs the whole-run functions of `parity`, `worst` and `signatures` on the piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from pgdiag.checks.signatures import Comoments, SignatureStats, signature_stats
from pgdiag.compare import breakdowns as bd
from pgdiag.compare.align import AlignedPair
from pgdiag.compare.parity import (
    ABS_QUANTILES,
    QUANTILE_SAMPLE_TOKENS,
    TokenTerms,
    _quantiles,
    bucket_table,
    sample_bucket_table,
    sample_terms,
    sequence_means,
    sequence_table_of_means,
    token_table,
    token_terms,
)
from pgdiag.compare.worst import sequence_deltas, worst_seqs, worst_tokens, worst_trace
from pgdiag.metrics import terms as terms_fn
from pgdiag.metrics.pooled import QuantileSummary

_MEAN_KEYS = (
    "bias",
    "abs_mean",
    "chi2_token",
    "kl_k3",
    "kl_rev_k1",
    "kl_rev_k3",
    "tmpe",
    "abs_dprob_mean",
)
_MAX_KEYS = ("abs_max", "abs_dprob_max")
SAMPLE_CAP = 2 * QUANTILE_SAMPLE_TOKENS  # strided token sample: every token up to this many


class StridedSample:
    """Every k-th token of the run (global token index ≡ 0 mod k), k doubling whenever more than `cap` are held.

    The kept indices are 0, k, 2k, ...: doubling k keeps every other one, so the result depends on the run
    alone, not on how it was split.
    """

    def __init__(self, cap: int = SAMPLE_CAP) -> None:
        self.cap = cap
        self.stride = 1
        self.seen = 0
        self.columns: dict[str, list[np.ndarray]] = {}

    def add(self, columns: dict[str, np.ndarray], m: int) -> None:
        """`columns`: name -> (m,) values of the next m tokens. The stride grows before the piece is taken, so
        no more than `cap` tokens are ever held."""
        while self.held + len(range((-self.seen) % self.stride, m, self.stride)) > self.cap:
            self.stride *= 2  # the held indices are 0, k, 2k, ...: keep every other one
            for name, parts in self.columns.items():
                self.columns[name] = [np.concatenate(parts)[::2]] if parts else []
        take = np.arange((-self.seen) % self.stride, m, self.stride)  # this piece's indices on the stride
        for name, values in columns.items():
            self.columns.setdefault(name, []).append(values[take])
        self.seen += m

    @property
    def held(self) -> int:
        parts = next(iter(self.columns.values()), [])
        return int(sum(p.shape[0] for p in parts))

    def column(self, name: str) -> np.ndarray:
        return np.concatenate(self.columns[name]) if name in self.columns else np.zeros(0)


@dataclass
class _BucketParts:
    """The tables of one breakdown over the pieces: label -> list of (piece's row values, n)."""

    rows: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    edges: dict[str, tuple[float, float]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


def _merge_rows(parts: list[dict[str, float]]) -> dict[str, float]:
    """One row from the rows of several pieces (module docstring); the row itself for one piece."""
    if len(parts) == 1:
        return dict(parts[0])
    parts = [p for p in parts if p["tokens"] > 0]
    n = float(sum(p["tokens"] for p in parts))
    out: dict[str, float] = {"tokens": n}
    for key in parts[0]:
        if key in _MEAN_KEYS:
            out[key] = math.fsum(p["tokens"] * p[key] for p in parts) / n
        elif key.startswith("frac_out_"):
            out[key] = sum(round(p["tokens"] * p[key]) for p in parts) / n
        elif key in _MAX_KEYS:
            out[key] = max(p[key] for p in parts)
        elif key == "abs_delta_gt_20":
            out[key] = float(sum(p[key] for p in parts))
    bias = out["bias"]
    m2 = math.fsum(p["tokens"] * (p["sd"] ** 2 + (p["bias"] - bias) ** 2) for p in parts)
    out["sd"] = math.sqrt(m2 / n)
    if "kl_k1" in parts[0]:
        out["kl_k1"] = 0.0 - bias
    return out


def bin_counts(d: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, int]:
    """(K,) int64 counts of the (M,) finite `d` in each [edge_k, edge_k+1) bin of the K + 1 sorted `edges`, and
    the count of exact zeros: the number below each edge by one comparison each, differenced (the counts of
    ``bincount(searchsorted(edges, d, "right") − 1)``, 2x faster than that binary search of every value)."""
    flags = np.empty(d.shape, dtype=np.bool_)  # (M,) scratch
    below = np.array([np.count_nonzero(np.less(d, edge, out=flags)) for edge in edges], dtype=np.int64)
    return np.diff(below), int(np.count_nonzero(np.equal(d, 0.0, out=flags)))


class PooledParity:
    """Accumulates the pieces of one comparison (module docstring)."""

    def __init__(
        self,
        *,
        by: tuple[str, ...],
        eps_low: float,
        eps_high: float,
        worst_k: int,
        decode: Callable[[Sequence[int]], str] | None,
        pieces: int,
    ) -> None:
        self.by, self.eps_low, self.eps_high = by, eps_low, eps_high
        self.worst_k, self.decode = worst_k, decode
        self.merging = pieces > 1  # one piece: its own tables are the result, no partials are kept
        self.token_rows: list[dict[str, float]] = []
        self.fit = Comoments.of(np.zeros(0), np.zeros(0))
        self.fit_delta = self.fit  # (lp_a, Δ): the residual of the fit
        self.fit_prob = self.fit
        self.sum_rho = 0.0
        self.sum_rho2 = 0.0
        self.abs_quantiles = QuantileSummary()
        self.dprob_quantiles = QuantileSummary()
        self.seq_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        # one piece: the sequence table computed right after the token table, so that their dot products are one
        # burst of OpenBLAS work (its worker thread spins ~0.1 s of CPU after each burst before it sleeps)
        self.seq_table: dict[str, np.ndarray] | None = None
        self.buckets: dict[str, _BucketParts] = {name: _BucketParts() for name in by}
        self.bucket_index: dict[str, dict[str, int]] = {name: {} for name in by}
        self.sample = StridedSample()
        self.hist = np.zeros(0, dtype=np.int64)
        self.n_zero = 0
        self.worst_tokens: list[pl.DataFrame] = []
        self.worst_seqs: list[pl.DataFrame] = []
        self.trace: pl.DataFrame | None = None
        self.trace_score = -1.0
        self.signature: SignatureStats | None = None
        self.n_tokens = 0
        self.n_samples = 0
        self.n_invalid = 0
        self.steps: set[int] = set()
        self.pieces = 0

    def add(self, pair: AlignedPair, dlogp_edges: np.ndarray, lag: np.ndarray | None = None) -> None:
        """Take the partials of one piece (then the caller may drop `pair`); `lag` (M,) each token's lag, for the
        `lag` breakdown."""
        self.pieces += 1
        self.n_tokens += pair.n_tokens
        self.n_samples += pair.n_samples
        self.n_invalid += pair.n_invalid
        self.steps.update(int(s) for s in np.unique(pair.step))
        terms = token_terms(
            pair.lp_a, pair.lp_b, eps_low=self.eps_low, eps_high=self.eps_high, delta=pair.delta
        )
        table = token_table(pair.lp_a, pair.lp_b, eps_low=self.eps_low, eps_high=self.eps_high, terms=terms)
        self.token_rows.append({k: float(v[0]) for k, v in table.items()})
        d = pair.delta
        if self.merging:
            self._add_moments(pair, terms)
        mean_a, mean_b, sum_d, _ = sequence_means(pair.lp_a, pair.lp_b, pair.offsets, delta=d)
        self.seq_parts.append((mean_a, mean_b, sum_d))
        if not self.merging:  # one piece: its sequence table is the run's; computed now, see `seq_table`
            self.seq_table = self._sequence_table_of_parts()
        self._add_buckets(pair, terms, lag)
        self._add_hist(d, dlogp_edges)
        self.worst_tokens.append(worst_tokens(pair, self.worst_k, decode=self.decode))
        self.worst_seqs.append(worst_seqs(pair, self.worst_k))
        rows, sums, _ = sequence_deltas(pair)
        if rows.size and float(np.max(np.abs(sums))) > self.trace_score:
            self.trace_score = float(np.max(np.abs(sums)))
            self.trace = worst_trace(pair)
        elif self.trace is None:
            self.trace = worst_trace(pair)
        stats = signature_stats(
            pair.lp_a, pair.lp_b, pair, max_examples=1, fit=False, delta=d, abs_delta=terms.abs_d
        )
        self.signature = stats if self.signature is None else self.signature.merge(stats, 1)

    def _add_moments(self, pair: AlignedPair, terms: TokenTerms) -> None:
        """The partials only a merge reads: co-moments, ρ sums, the `all` quantile summaries."""
        d = pair.delta
        self.fit = self.fit.merge(Comoments.of(pair.lp_a, pair.lp_b))
        self.fit_delta = self.fit_delta.merge(Comoments.of(pair.lp_a, d))
        b1, b2 = terms.scratch
        with np.errstate(over="ignore", invalid="ignore"):
            rho = terms_fn.ratio(d, b1)
            self.sum_rho += float(np.sum(rho))
            self.sum_rho2 += float(np.dot(rho, rho))
        self.abs_quantiles.add(terms.abs_d)
        self.dprob_quantiles.add(terms.abs_dprob())
        p_a, p_b = np.exp(pair.lp_a, out=b1), np.exp(pair.lp_b, out=b2)
        self.fit_prob = self.fit_prob.merge(Comoments.of(p_a, p_b))

    def _add_buckets(self, pair: AlignedPair, terms: TokenTerms, lag: np.ndarray | None) -> None:
        per_sample = None
        codes_of: dict[str, np.ndarray] = {}
        for name in self.by:
            buckets = bd.assign(pair, name, lag)
            if buckets.sample_codes is None:
                table = bucket_table(terms, buckets.codes, buckets.n_buckets)
            else:
                if per_sample is None:
                    per_sample = sample_terms(terms, pair.offsets, pair.token_row)
                table = sample_bucket_table(
                    per_sample, terms, buckets.sample_codes, pair.token_row, buckets.n_buckets
                )
            parts, index = self.buckets[name], self.bucket_index[name]
            remap = np.zeros(buckets.n_buckets, dtype=np.int32)
            for k, label in enumerate(buckets.labels):
                if label not in index:
                    index[label] = len(index)
                    parts.order.append(label)
                    parts.edges[label] = (float(buckets.lo[k]), float(buckets.hi[k]))
                remap[k] = index[label]
                if table["tokens"][k] == 0:
                    continue
                parts.rows.setdefault(label, []).append({key: float(v[k]) for key, v in table.items()})
            if self.merging:
                codes_of[name] = remap[buckets.codes]  # (M,) this breakdown's run-wide bucket of each token
            del buckets
        if self.merging:  # bucket quantiles over pieces and the token plots read the strided sample
            columns = {"abs_d": terms.abs_d, "lp_a": pair.lp_a, "lp_b": pair.lp_b, **codes_of}
            self.sample.add(columns, pair.n_tokens)

    def _add_hist(self, d: np.ndarray, edges: np.ndarray) -> None:
        counts, zeros = bin_counts(d, edges)
        self.n_zero += zeros
        counts[np.searchsorted(edges, 0.0, side="right") - 1] -= zeros
        self.hist = counts if self.hist.size == 0 else self.hist + counts

    # ---- the tables of the whole run --------------------------------------------------------------------
    def token_table(self) -> dict[str, np.ndarray]:
        """The `all` token table ({stat: (1,)}, `parity.token_table`'s keys and order)."""
        first = self.token_rows[0]
        live = [r for r in self.token_rows if r["tokens"] > 0]
        if len(self.token_rows) == 1 or not live:
            return {k: np.array([v]) for k, v in first.items()}
        merged = _merge_rows(live)
        n = merged["tokens"]
        merged["rms"] = math.sqrt(math.fsum(r["tokens"] * r["rms"] ** 2 for r in live) / n)
        quant = self.abs_quantiles.quantiles(tuple(ABS_QUANTILES.values()))
        for j, name in enumerate(ABS_QUANTILES):
            merged[name] = math.nan if quant[j] is None else quant[j]
        dprob_p99 = self.dprob_quantiles.quantiles((0.99,))[0]
        merged["abs_dprob_p99"] = math.nan if dprob_p99 is None else dprob_p99
        merged.update(_fit(self.fit, self.fit_delta))
        prob_r = _fit(self.fit_prob, self.fit_prob)["pearson_r"]
        merged["prob_pearson_r"] = prob_r
        merged["ess_token"] = (
            self.sum_rho * self.sum_rho / (n * self.sum_rho2) if n > 0 and self.sum_rho2 > 0 else math.nan
        )
        return {k: np.array([merged[k]]) for k in first}

    def sequence_table(self) -> dict[str, np.ndarray]:
        """`parity.sequence_table` over every matched sample's means (exact: the same function)."""
        return self._sequence_table_of_parts() if self.seq_table is None else self.seq_table

    def _sequence_table_of_parts(self) -> dict[str, np.ndarray]:
        mean_a, mean_b, sum_d = (np.concatenate([p[j] for p in self.seq_parts]) for j in range(3))
        return sequence_table_of_means(mean_a, mean_b, sum_d, eps_low=self.eps_low, eps_high=self.eps_high)

    def bucket_rows(self, name: str) -> list[tuple[str, float, float, dict[str, np.ndarray]]]:
        """(label, lo, hi, {stat: (1,)}) of every non-empty bucket of breakdown `name`, in bucket order."""
        parts, index = self.buckets[name], self.bucket_index[name]
        labels = list(parts.order)
        if name == "step":
            labels.sort(key=lambda label: parts.edges[label][0])
        elif name == "env":
            labels.sort()
        sample_abs = sample_codes = None
        out = []
        for label in labels:
            rows = parts.rows.get(label)
            if not rows:
                continue
            row = _merge_rows(rows)
            if len(rows) > 1:
                if sample_abs is None:
                    sample_abs, sample_codes = self.sample.column("abs_d"), self.sample.column(name)
                values = sample_abs[sample_codes == index[label]]
                quant = _quantiles(values, list(ABS_QUANTILES.values()))
                for j, key in enumerate(ABS_QUANTILES):
                    row[key] = float(quant[j])
                row["rms"] = math.sqrt(row["sd"] ** 2 + row["bias"] ** 2)
            lo, hi = parts.edges[label]
            out.append((label, lo, hi, {k: np.array([row[k]]) for k in rows[0]}))
        return out

    def plot_tokens(self, pair_name: str) -> pl.DataFrame:
        """Every k-th matched token's (pair, lp_a, lp_b), k = 1 up to `SAMPLE_CAP` tokens: for token plots."""
        lp_a = self.sample.column("lp_a")
        return pl.DataFrame(
            {
                "pair": pl.repeat(pair_name, lp_a.shape[0], eager=True, dtype=pl.String),
                "lp_a": lp_a,
                "lp_b": self.sample.column("lp_b"),
            }
        )

    def worst(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        """(worst tokens, worst sequences) of the run: the top K of each piece's top K (stable: ties in run order)."""
        tokens = pl.concat(self.worst_tokens, how="vertical")
        seqs = pl.concat(self.worst_seqs, how="vertical")
        if len(self.worst_tokens) > 1:
            tokens = tokens.sort(pl.col("dlogp").abs(), descending=True, maintain_order=True).head(
                self.worst_k
            )
            seqs = seqs.sort(pl.col("dlogp_sum").abs(), descending=True, maintain_order=True).head(
                self.worst_k
            )
        return tokens, seqs


def _fit(moments: Comoments, residual: Comoments) -> dict[str, float]:
    """`parity.linear_fit`'s keys from pooled co-moments; the residual from those of (x, y − x) (docstring)."""
    nan = {"pearson_r": math.nan, "fit_slope": math.nan, "fit_intercept": math.nan, "fit_resid_rms": math.nan}
    if moments.n == 0:
        return nan
    sxx, syy, sxy = moments.sxx, moments.syy, moments.sxy
    r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
    if not sxx > 0:
        return {**nan, "pearson_r": r}
    slope = sxy / sxx
    resid_ss = max(residual.syy - residual.sxy * residual.sxy / residual.sxx, 0.0)
    return {
        "pearson_r": r,
        "fit_slope": slope,
        "fit_intercept": moments.mean_y - slope * moments.mean_x,
        "fit_resid_rms": math.sqrt(resid_ss / moments.n),
    }
