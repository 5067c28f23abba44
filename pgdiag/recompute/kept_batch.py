"""One batch's kept sets for the LM head: the recorded sets of its target positions, or a reconstruction
from the batch's own hidden states (`pgdiag.recompute.kept_rules` decides which; docs/recompute.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pgdiag.data.kept import position_sets
from pgdiag.kernels.kept_reconstruct import reconstruct_kept
from pgdiag.kernels.kept_set import KeptSet
from pgdiag.recompute.kept_rules import KeptPlan

if TYPE_CHECKING:
    from pgdiag.recompute.inputs import RecomputeInputs


def batch_kept(
    plan: KeptPlan,
    inputs: RecomputeInputs,
    flat: np.ndarray,
    sample_of_target: np.ndarray,
    *,
    hidden: torch.Tensor,
    head: torch.Tensor,
    temperature: float,
    head_dtype: str,
    tp_group: Any,
    vocab_start: int,
) -> KeptSet | None:
    """The kept sets of one batch's targets at run-token indices `flat` (K,), or None without a source."""
    device = hidden.device
    if plan.kept_source == "none":
        return None
    if plan.needs_recorded:
        assert inputs.kept is not None
        sets = position_sets(inputs.kept, inputs.offsets, flat, expand_bitmasks=False)
        logprobs = None if sets.logprobs is None else torch.from_numpy(sets.logprobs).to(device)
        packed = sets.bitmask_queries is not None and sets.bitmasks is not None
        # bitmask positions travel packed (1 bit a token) and the head reads them as bits (`kernels.kept_set`)
        return KeptSet(
            torch.from_numpy(sets.ids).to(device),
            torch.from_numpy(sets.offsets).to(device),
            logprobs,
            torch.from_numpy(sets.bitmask_queries).to(device) if packed else None,
            torch.from_numpy(sets.bitmasks).to(device) if packed else None,
        )
    engine = plan.reconstructs
    assert engine is not None and inputs.sampling is not None
    rows = sample_of_target
    return reconstruct_kept(
        hidden,
        head,
        temperature=temperature,
        top_k=torch.from_numpy(inputs.sampling["top_k"][rows]).to(device),
        top_p=torch.from_numpy(inputs.sampling["top_p"][rows]).float().to(device),
        min_p=torch.from_numpy(inputs.sampling["min_p"][rows]).float().to(device),
        engine=engine,
        head_dtype=head_dtype,
        tp_group=tp_group,
        vocab_start=vocab_start,
    )


def sum_floats_over_ranks(
    values: list[float], world_size: int, is_writer: bool, device: torch.device
) -> list[float]:
    """Float totals over DP replicas (TP rank 0 of each replica, the writer, contributes)."""
    if world_size == 1:
        return values
    mine = values if is_writer else [0.0] * len(values)
    total = torch.tensor(mine, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total)
    return [float(v) for v in total.tolist()]


@dataclass
class KeptOutput:
    """A part's kept-set columns while it is computed: (T_part,) float32 kept mass and full log-probs."""

    kept_mass: np.ndarray
    logprobs_full: np.ndarray
    kept_kl: np.ndarray | None = None  # (T_part,) with the engine's kept log-probs; NaN (null) without a set

    @classmethod
    def zeros(cls, n_tokens: int, *, with_kl: bool = False) -> KeptOutput:
        kl = np.full(n_tokens, np.nan, dtype=np.float32) if with_kl else None
        return cls(np.ones(n_tokens, dtype=np.float32), np.zeros(n_tokens, dtype=np.float32), kl)

    def put(
        self,
        where: np.ndarray,
        kept_mass: torch.Tensor,
        full: torch.Tensor | None,
        bias_sum: list[float],
        kept_kl: torch.Tensor | None = None,
    ) -> None:
        mass = kept_mass.float().cpu().numpy()
        self.kept_mass[where] = mass
        if full is not None:
            self.logprobs_full[where] = full.float().cpu().numpy()
        if kept_kl is not None and self.kept_kl is not None:
            self.kept_kl[where] = kept_kl.float().cpu().numpy()
        bias_sum[0] += float(-np.log(np.clip(mass.astype(np.float64), 1e-300, 1.0)).sum())
        bias_sum[1] += float(mass.shape[0])

    def columns(self) -> dict[str, np.ndarray]:
        out = {"kept_mass": self.kept_mass, "logprobs_full": self.logprobs_full}
        if self.kept_kl is not None:
            out["kept_kl"] = self.kept_kl
        return out
