"""Exact best-fit temperature of a comparison from side b's logits (docs/metrics.md, `compare --model CKPT`).

What: `exact_tau(pair, input_ids, model_path)` recomputes side b's logits at the matched loss positions with
pgdiag's own model (`pgdiag.model.load_model`, fp32 body and head so the fit is not blurred by bf16 rounding)
and fits τ* = argmin Σ (z[y]/τ − logsumexp(z/τ) − lp_a)² with `pgdiag.metrics.mismatch.fit_temperature`.
Why: the logprob-only hint (the OLS slope) is biased by the per-position normaliser; with logits the fit is exact:
a sampling side at T = 0.7 gives τ* = 0.7 up to the numerics of the recompute.
How: samples are taken in matched order until `max_tokens` loss tokens are collected (the fit holds (M, V)
float64 logits, so the budget bounds memory at M·V·8 bytes); each sample runs one teacher-forced forward pass
(position p's logits come from the hidden state at p − 1), logits are gathered only at loss positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pgdiag.compare.align import AlignedPair
from pgdiag.metrics.mismatch import TemperatureFit, fit_temperature

TAU_FIT_TOKENS = 8192


def exact_tau(
    pair: AlignedPair,
    input_ids: Sequence[np.ndarray],
    model_path: str | Path,
    *,
    max_tokens: int = TAU_FIT_TOKENS,
) -> TemperatureFit:
    """τ* of `pair` with side b's logits from `model_path`; `input_ids[i]` holds matched sample i's full ids."""
    import torch

    from pgdiag.model import load_model

    model = load_model(model_path, dtype="fp32", head_dtype="fp32", device="cpu")
    weight = model.lm_head_weight.float()  # (V_local, H); TP = 1 here, so V_local = V
    targets, rows, lp_a = [], [], []
    taken = 0
    for i in range(pair.n_samples):
        lo, hi = int(pair.offsets[i]), int(pair.offsets[i + 1])
        if hi == lo:
            continue
        hi = min(hi, lo + max_tokens - taken)
        ids = torch.as_tensor(np.asarray(input_ids[i], dtype=np.int64))  # (T,)
        positions = torch.arange(ids.shape[0], dtype=torch.int64)
        cu = torch.tensor([0, ids.shape[0]], dtype=torch.int32)
        hidden = model.hidden_states(ids, positions, cu).float()  # (T, H)
        pos = torch.as_tensor(pair.pos[lo:hi].astype(np.int64))  # (m,) loss positions, all >= 1
        with torch.no_grad():
            logits = hidden[pos - 1] @ weight.T  # (m, V) fp32: position p is predicted from p - 1
        token = ids[pos]  # (m,)
        rows.append(logits.double().numpy())
        targets.append(logits.double().gather(1, token[:, None]).squeeze(1).numpy())
        lp_a.append(pair.lp_a[lo:hi])
        taken += hi - lo
        if taken >= max_tokens:
            break
    if not rows:
        return fit_temperature(np.zeros(0), np.zeros((0, 1)), np.zeros(0))
    return fit_temperature(np.concatenate(targets), np.concatenate(rows), np.concatenate(lp_a))
