"""The per-token terms of the mismatch family, one implementation for `metrics` and `compare`'s parity table.

Δ = lp_b − lp_a and ρ = e^Δ on each valid token. `metrics` sums these terms per sample (token, sample and
document reductions), `compare` over all tokens and per breakdown bucket; both call the functions below, so the
same data gives the same `mismatch/*` values in both commands. Every function writes into a caller's (M,) float64
buffer (`out`, and `spare` where a second one is needed) and returns it: no (M,) temporaries of its own.
Exact zeros stay exact: ρ − 1 is `expm1(Δ)`, so identical streams give k3 = 0, not rounding noise.
"""

from __future__ import annotations

import math

import numpy as np

from pgdiag.metrics.settings import ClipBand

# (lo, hi) ratio bands of mismatch/frac_out_*, in report order; `clip` takes its edges from the clip band.
BANDS: dict[str, tuple[float, float] | None] = {
    "strict": (0.999, 1.002),
    "1pct": (0.99, 1.01),
    "10pct": (0.9, 1.1),
    "clip": None,
    "2x": (0.5, 2.0),
}


def band_edges(clip: ClipBand) -> dict[str, tuple[float, float]]:
    """{band: (ln lo, ln hi)}: a token is outside a band when Δ < ln lo or Δ > ln hi."""
    edges = {}
    for band, pair in BANDS.items():
        lo, hi = pair if pair is not None else (clip.low_edge, clip.high_edge)
        edges[band] = (math.log(lo) if lo > 0 else -math.inf, math.log(hi))
    return edges


def ratio(delta: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(M,) ρ = 1 + expm1(Δ)."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.expm1(delta, out=out)
    out += 1.0
    return out


def k3(delta: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(M,) ρ − 1 − Δ = expm1(Δ) − Δ (the k3 estimator of KL(a ‖ b) per token; exact 0 at Δ = 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.expm1(delta, out=out)
        return np.subtract(out, delta, out=out)


def rev_k1(delta: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(M,) ρΔ (k1 of the reverse KL, under b)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.multiply(ratio(delta, out), delta, out=out)


def rev_k3(delta: np.ndarray, out: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """(M,) 1 − ρ + ρΔ = ρΔ − expm1(Δ) (k3 of the reverse KL)."""
    with np.errstate(over="ignore", invalid="ignore"):
        rev_k1(delta, out)
        np.expm1(delta, out=spare)
        return np.subtract(out, spare, out=out)


def chi2(delta: np.ndarray, out: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """(M,) ρ² − 1 = expm1(Δ)·(expm1(Δ) + 2) (chi-square per token; exact 0 at Δ = 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        em1 = np.expm1(delta, out=spare)
        np.add(em1, 2.0, out=out)
        return np.multiply(out, em1, out=out)


def tmpe(delta: np.ndarray, out: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """(M,) e^|Δ| = max(ρ, 1/ρ), with one exponential (`spare` holds ρ)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        rho = ratio(delta, spare)
        inverse = np.reciprocal(rho, out=out)
        return np.maximum(rho, inverse, out=inverse)


def abs_dprob(lp_a: np.ndarray, lp_b: np.ndarray, out: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """(M,) |e^lp_b − e^lp_a| (verl's |Δp|; `spare` holds e^lp_a)."""
    prob_a = np.exp(lp_a, out=spare)
    np.exp(lp_b, out=out)
    out -= prob_a
    return np.abs(out, out=out)


def kl_sums(d: np.ndarray, em1: np.ndarray, term: np.ndarray) -> tuple[np.floating, ...]:
    """Σ over tokens of chi-square, k3, reverse k1, reverse k3, ρ, ρ² and tmpe, in that order.

    Each term is computed as the functions above compute it (`chi2`, `k3`, `rev_k1`, `rev_k3`, `ratio`,
    `tmpe`), the same operations in the same order, so the sums are bit for bit those of `np.sum(chi2(d, ...))`
    and so on; expm1(Δ) is computed once into `em1` and each term written into `term` (both (M,) scratch,
    overwritten). `compare`'s `all` row reads these.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        np.expm1(d, out=em1)  # (M,) ρ − 1
        chi2 = np.add(em1, 2.0, out=term)
        sum_chi2 = np.sum(np.multiply(chi2, em1, out=chi2))  # ρ² − 1
        sum_k3 = np.sum(np.subtract(em1, d, out=term))  # ρ − 1 − Δ
        rev_k1 = np.multiply(np.add(em1, 1.0, out=term), d, out=term)  # ρΔ
        sum_rev_k1 = np.sum(rev_k1)
        sum_rev_k3 = np.sum(np.subtract(rev_k1, em1, out=rev_k1))  # ρΔ − (ρ − 1)
        rho = np.add(em1, 1.0, out=term)  # (M,) ρ
        sum_rho, sum_rho2 = np.sum(rho), np.dot(rho, rho)
        inverse = np.reciprocal(rho, out=em1)  # em1 is not read again
        sum_tmpe = np.sum(np.maximum(rho, inverse, out=inverse))  # e^|Δ| = max(ρ, 1/ρ)
    return sum_chi2, sum_k3, sum_rev_k1, sum_rev_k3, sum_rho, sum_rho2, sum_tmpe
