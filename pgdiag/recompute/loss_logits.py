"""Full-vocabulary logits at chosen loss positions of a few samples, from pgdiag's own model, on the CPU.

What: `loss_logits(model_path, input_ids, positions)` runs one teacher-forced forward pass per sample with
`pgdiag.model.load_model` (fp32 body and head, so a fit on the logits is not blurred by bf16 rounding) and returns,
for every listed position p (all >= 1), the logits predicting token p (from the hidden state at p - 1) and the
logit of the token actually at p. Used by `compare --model CKPT` for the exact temperature fit
(`pgdiag.compare.tau`).
How: logits are gathered only at the listed positions, so memory is M·V·8 bytes for M positions; the caller
bounds M.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LossLogits:
    """Logits at the listed positions of all samples, concatenated in sample order."""

    target: np.ndarray  # (M,) float64: logit of the token at each position
    logits: np.ndarray  # (M, V) float64: full-vocabulary logits predicting that token; (0, 1) when M = 0


def loss_logits(
    model_path: str | Path, input_ids: Sequence[np.ndarray], positions: Sequence[np.ndarray]
) -> LossLogits:
    """Logits of `model_path` at `positions[i]` (each (m_i,) int, all >= 1) of sample `input_ids[i]` ((T_i,) int)."""
    import torch

    from pgdiag.model import load_model

    model = load_model(model_path, dtype="fp32", head_dtype="fp32", device="cpu")
    weight = model.lm_head_weight.float()  # (V_local, H); TP = 1 here, so V_local = V
    targets, rows = [], []
    for sample_ids, sample_pos in zip(input_ids, positions, strict=True):
        ids = torch.as_tensor(sample_ids)  # (T,)
        seq_positions = torch.arange(ids.shape[0], dtype=torch.int64)
        cu = torch.tensor([0, ids.shape[0]], dtype=torch.int32)
        hidden = model.hidden_states(ids, seq_positions, cu).float()  # (T, H)
        pos = torch.as_tensor(sample_pos)  # (m,) loss positions, all >= 1
        with torch.no_grad():
            logits = hidden[pos - 1] @ weight.T  # (m, V) fp32: position p is predicted from p - 1
        token = ids[pos]  # (m,)
        rows.append(logits.double().numpy())
        targets.append(logits.double().gather(1, token[:, None]).squeeze(1).numpy())
    if not rows:
        return LossLogits(np.zeros(0), np.zeros((0, 1)))
    return LossLogits(np.concatenate(targets), np.concatenate(rows))
