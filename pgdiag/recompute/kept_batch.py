"""One batch's kept sets for the LM head: the recorded sets of its target positions, or a reconstruction
from the batch's own hidden states (`pgdiag.recompute.kept_rules` decides which; docs/recompute.md)."""

from __future__ import annotations

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
        sets = position_sets(inputs.kept, inputs.offsets, flat)
        logprobs = None if sets.logprobs is None else torch.from_numpy(sets.logprobs).to(device)
        return KeptSet(
            torch.from_numpy(sets.ids).to(device), torch.from_numpy(sets.offsets).to(device), logprobs
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
