"""Staleness in `whatif`: the mismatch per lag bucket, the three-policy split and AReaL's log-linear proximal
approximation error (docs/whatif.md, "Staleness").

Lag buckets come from `pgdiag.data.versions` (lag = proximal version − sampling version). Per bucket (breakdown
`lag`): tokens, mean |Δ| and mean k3 = e^Δ − 1 − Δ of behaviour→proximal (Δ = log π_old − log μ); with a `new`
stream, the same of proximal→θ (Δ = log π_new − log π_old), the three-policy split; where the run has versions
and a `new` stream, AReaL's log-linear approximation log π_prox ≈ log μ + α (log π_θ − log μ) with
α = clamp((v_prox − v_μ)/(v_θ − v_μ), 0, 1), v_θ = v_prox + 1 (AReaL cbff54d `areal/trainer/ppo/actor.py`, the
`loglinear` method; α = 0 where v_θ <= v_μ), and its mean absolute error against the recomputed log π_old.
"""

from __future__ import annotations

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.data.versions import LAG_LABELS, TokenLag, lag_buckets
from pgdiag.report.report import ReportRow


def _k3(d: np.ndarray) -> np.ndarray:
    d = np.clip(d, -20.0, 20.0)
    return np.exp(d) - 1.0 - d


def loglinear_error(batch: TokenBatch, lag: TokenLag, behavior: str, target: str, new: str) -> np.ndarray:
    """(M,) |log π_prox(loglinear) − log π_old| per token (NaN where the version is unknown)."""
    v_mu = lag.sampling_version
    v_prox = v_mu + lag.lag
    gap, diff = v_prox - v_mu, v_prox + 1.0 - v_mu
    alpha = np.where(np.isfinite(v_mu) & (diff > 0) & (v_mu >= 0), gap / np.where(diff > 0, diff, 1.0), 0.0)
    alpha = np.clip(alpha, 0.0, 1.0)
    mu, theta = batch.streams[behavior], batch.streams[new]
    approx = mu + alpha * (theta - mu)
    return np.where(np.isfinite(v_mu), np.abs(approx - batch.streams[target]), np.nan)


LAG_SUMS = 6  # tokens, Σ|Δ| and Σ k3 of behaviour→proximal, the same of proximal→θ, Σ loglinear error


def staleness_sums(
    batch: TokenBatch, lag: TokenLag, *, behavior: str, target: str, new: str | None
) -> dict[str, np.ndarray]:
    """Per lag bucket of one piece, the (6,) sums `staleness_rows` divides (`LAG_SUMS`); sums of pieces add."""
    d_bp = batch.streams[target] - batch.streams[behavior]
    d_pt = batch.streams[new] - batch.streams[target] if new is not None else None
    error = loglinear_error(batch, lag, behavior, target, new) if new is not None else None
    out: dict[str, np.ndarray] = {}
    for label, tok in lag_buckets(lag.lag):
        sums = np.zeros(LAG_SUMS)
        sums[0] = float(tok.sum())
        sums[1], sums[2] = float(np.sum(np.abs(d_bp[tok]))), float(np.sum(_k3(d_bp[tok])))
        if d_pt is not None:
            sums[3], sums[4] = float(np.sum(np.abs(d_pt[tok]))), float(np.sum(_k3(d_pt[tok])))
        if error is not None and label != "unknown":
            sums[5] = float(np.sum(error[tok]))
        out[label] = sums
    return out


def staleness_rows(
    sums: dict[str, np.ndarray], n_tokens: int, *, new: str | None, pair: str, later: str
) -> list[ReportRow]:
    """Rows of breakdown `lag` (bucket = the lag) for the uncorrected batch, from the `staleness_sums` of every
    piece added up, in the order of `lag_buckets`."""
    rows: list[ReportRow] = []
    for label in [b for b in LAG_LABELS if b in sums]:
        total = sums[label]
        n = int(total[0])
        lo = hi = float(label) if label.isdigit() else None

        def add(on: str, metric: str, value: float | None, unit: str = "nats") -> None:
            rows.append(ReportRow(on, "token", "lag", label, metric, value, unit, "token-mean", n, lo, hi))  # noqa: B023

        def mean(i: int) -> float | None:
            return float(total[i]) / n if n else None  # noqa: B023

        add(pair, "whatif/lag_tokens", float(n) / n_tokens if n_tokens else None, "fraction")
        add(pair, "whatif/lag_abs_log_ratio", mean(1))
        add(pair, "whatif/lag_kl_k3", mean(2))
        if new is not None:
            add(later, "whatif/lag_abs_log_ratio", mean(3))
            add(later, "whatif/lag_kl_k3", mean(4))
            if label != "unknown":
                add(pair, "whatif/lag_loglinear_abs_error", mean(5))
    return rows
