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
