"""The `lag` breakdown of `metrics --by lag`: the policy and mismatch families per staleness bucket.

What: per lag bucket (`pgdiag.data.versions`: lag = proximal version − sampling version, `<0`, 0, 1, 2, 3, `4+`,
`unknown`), over the run's loss tokens: `count/tokens` (the bucket's loss tokens), and the token means of
`policy/logratio_abs_mean` and `policy/kl_k3` (d = lp_new − lp_old) and of `mismatch/abs_mean` and
`mismatch/kl_k3` (Δ = lp_b − lp_a), each over the tokens where its pair is finite. The keys mean what they mean in
the `all` row (docs/metrics.md), always token means here whatever `--metric-reduction` says.
Why: a mismatch that grows with the lag is staleness; one that does not is the engine (docs/metrics.md, "Lag").
How: an accumulator of the metrics fold: `add(batch, lag)` per chunk adds per-bucket sums (7 buckets x 5 sums),
`rows(policy_pair, mismatch_pair)` gives the report rows once.
"""

from __future__ import annotations

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.data.versions import LAG_HI, LAG_LABELS, LAG_LO, TokenLag, lag_codes
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.terms import k3
from pgdiag.report.report import ReportRow

_K = len(LAG_LABELS)


def _bucket_sums(codes: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(K,) count, Σ|x| and Σ k3(x) over the finite `values` (M,) of each bucket `codes` (M,)."""
    ok = np.isfinite(values)
    c, x = codes[ok], values[ok]
    scratch = np.empty_like(x)
    return (
        np.bincount(c, minlength=_K).astype(np.float64),
        np.bincount(c, weights=np.abs(x), minlength=_K),
        np.bincount(c, weights=k3(x, scratch), minlength=_K),
    )


class LagBreakdown:
    """Per-bucket sums of one run's loss tokens (module docstring); state is (K,) arrays, never a chunk's tokens."""

    def __init__(self, policy: tuple[str, str] | None, mismatch: tuple[str, str] | None) -> None:
        self.policy, self.mismatch = policy, mismatch  # (old, new) and (a, b) stream names, None when absent
        self.tokens = np.zeros(_K)
        self.sums: dict[str, np.ndarray] = {}  # family -> (3, K) count, Σ|x|, Σ k3
        self.notices: list[str] = []

    def add(self, batch: TokenBatch, lag: TokenLag | None) -> None:
        """Fold in one chunk's loss tokens with their lag (None: the run has no version column)."""
        lag_values = np.full(batch.n_tokens, np.nan) if lag is None else lag.lag
        if lag is None and not self.notices:
            self.notices.append("lag: the run has no policy_version column: every token is `unknown`")
        elif lag is not None and lag.unknown_reason and not self.notices:
            self.notices.append(f"lag: {lag.unknown_reason}: every token is `unknown` (docs/metrics.md)")
        codes = lag_codes(lag_values)  # (M,)
        self.tokens += np.bincount(codes, minlength=_K)
        for family, names in (("policy", self.policy), ("mismatch", self.mismatch)):
            if names is None:
                continue
            first, second = (batch.streams[n] for n in names)
            with np.errstate(invalid="ignore", over="ignore"):
                parts = np.stack(_bucket_sums(codes, second - first))  # (3, K)
            self.sums[family] = self.sums.get(family, 0.0) + parts

    def rows(self, policy_pair: str, mismatch_pair: str | None) -> list[ReportRow]:
        """Rows of breakdown `lag`, one bucket per lag that holds tokens, in bucket order."""
        rows: list[ReportRow] = []
        keys = {
            "policy": ("policy/logratio_abs_mean", "policy/kl_k3"),
            "mismatch": ("mismatch/abs_mean", "mismatch/kl_k3"),
        }
        for k, label in enumerate(LAG_LABELS):
            if self.tokens[k] == 0:
                continue
            lo = None if np.isnan(LAG_LO[k]) else LAG_LO[k]
            hi = None if np.isnan(LAG_HI[k]) else LAG_HI[k]

            def row(pair: str, metric: str, value: float | None, unit: str, n: int) -> ReportRow:
                return ReportRow(pair, "token", "lag", label, metric, value, unit, "token", n, lo, hi)  # noqa: B023

            n_tokens = int(self.tokens[k])
            rows.append(row(policy_pair, "count/tokens", float(n_tokens), "count", n_tokens))
            for family, (abs_key, k3_key) in keys.items():
                if family not in self.sums:
                    continue
                pair = policy_pair if family == "policy" else mismatch_pair
                assert pair is not None
                count, abs_sum, k3_sum = self.sums[family][:, k]
                n = int(count)
                rows.append(row(pair, abs_key, abs_sum / n if n else None, "nats", n))
                rows.append(row(pair, k3_key, k3_sum / n if n else None, "nats", n))
        return rows


def lag_breakdown(settings: MetricSettings) -> LagBreakdown | None:
    """The `lag` accumulator of resolved `settings` (`--by lag`), None when not asked for."""
    if "lag" not in settings.by:
        return None
    assert settings.old is not None and settings.new is not None
    mismatch = None if settings.stream_a is None else (settings.stream_a, settings.stream_b)
    return LagBreakdown((settings.old, settings.new), mismatch)  # type: ignore[arg-type]
