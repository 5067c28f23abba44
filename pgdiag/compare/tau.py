"""Exact best-fit temperature of a comparison from side b's logits (docs/metrics.md, `compare --model CKPT`).

What: `TauSamples` collects, piece by piece as `compare` reads the runs, the first `max_tokens` matched loss
tokens in matched order (positions, lp_a) with side b's `input_ids` of their samples; `exact_tau(samples,
model_path)` then has `pgdiag.recompute.loss_logits` recompute side b's logits at those positions with pgdiag's
own model (fp32 body and head so the fit is not blurred by bf16 rounding) and fits
τ* = argmin Σ (z[y]/τ − logsumexp(z/τ) − lp_a)² with `pgdiag.metrics.mismatch.fit_temperature`.
Why: the logprob-only hint (the OLS slope) is biased by the per-position normaliser; with logits the fit is exact:
a sampling side at T = 0.7 gives τ* = 0.7 up to the numerics of the recompute.
How: samples are taken in matched order until `max_tokens` loss tokens are collected (the fit holds (M, V)
float64 logits, so the budget bounds memory at M·V·8 bytes; the last sample taken may be cut); only those
samples' `input_ids` are read, so a run read step by step gives the fit of the run read whole. The recompute runs
one teacher-forced forward pass per sample (position p's logits come from the hidden state at p − 1) and gathers
logits only at loss positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pgdiag.compare.align import AlignedPair
from pgdiag.metrics.mismatch import TemperatureFit, fit_temperature
from pgdiag.recompute.loss_logits import loss_logits

TAU_FIT_TOKENS = 8192


class TauSamples:
    """The first `max_tokens` matched loss tokens of a comparison, in matched order, and their samples' ids."""

    def __init__(self, max_tokens: int | None = None) -> None:
        self.max_tokens = TAU_FIT_TOKENS if max_tokens is None else max_tokens
        self.input_ids: list[np.ndarray] = []  # per taken sample: (T,) side b's full input_ids
        self.pos: list[np.ndarray] = []  # per taken sample: (m,) int64 loss positions, all >= 1
        self.lp_a: list[np.ndarray] = []  # per taken sample: (m,) float64 side a's log-probs
        self.taken = 0  # loss tokens collected

    @property
    def full(self) -> bool:
        return self.taken >= self.max_tokens

    def add(self, pair: AlignedPair, read_ids: Callable[[np.ndarray], Sequence[np.ndarray]]) -> None:
        """Take `pair`'s matched samples in order until the budget is reached; `read_ids(samples)` gives side
        b's input_ids of those matched samples (indices into `pair`), in that order."""
        taken: list[tuple[int, int, int]] = []  # (matched sample, first token, end token)
        for i in range(pair.n_samples):
            if self.full:
                break
            lo, hi = int(pair.offsets[i]), int(pair.offsets[i + 1])
            if hi == lo:
                continue
            hi = min(hi, lo + self.max_tokens - self.taken)
            taken.append((i, lo, hi))
            self.taken += hi - lo
        if not taken:
            return
        ids = read_ids(np.asarray([i for i, _, _ in taken], dtype=np.int64))
        for (_, lo, hi), sample_ids in zip(taken, ids, strict=True):
            self.input_ids.append(np.asarray(sample_ids, dtype=np.int64))
            self.pos.append(pair.pos[lo:hi].astype(np.int64))
            self.lp_a.append(np.array(pair.lp_a[lo:hi], dtype=np.float64))


def exact_tau(samples: TauSamples, model_path: str | Path) -> TemperatureFit:
    """τ* of the collected `samples` with side b's logits from `model_path` (`pgdiag.recompute.loss_logits`)."""
    b = loss_logits(model_path, samples.input_ids, samples.pos)
    lp_a = np.concatenate(samples.lp_a) if samples.lp_a else np.zeros(0)  # (M,)
    return fit_temperature(b.target, b.logits, lp_a)
