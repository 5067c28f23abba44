"""E612, NaN or inf in a recompute: in the loaded weights (before anything is written) or in the hidden states.

What: `nonfinite_count(values)` counts NaN and inf elements at the cost of one reduction when there are none;
`check_finite_weights` refuses a checkpoint whose weights hold any, on every rank alike, naming the tensor and its
file; `raise_overflow` names the first sample whose forward overflowed in the compute dtype.

Why apart: one error, raised from two places (the load in `pgdiag.recompute.logprobs` and every forward in
`pgdiag.recompute.forward`), with the same counting rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pgdiag.errors import Code, UsageError
from pgdiag.recompute.ranks import any_rank

if TYPE_CHECKING:
    from pgdiag.model import CausalLM
    from pgdiag.recompute.inputs import RecomputeInputs
    from pgdiag.recompute.launch import ParallelLayout
    from pgdiag.recompute.model_spec import ModelSpec


def nonfinite_count(values: torch.Tensor) -> int:
    """Elements of `values` that are NaN or inf; a sum first (NaN and inf propagate into it), so a finite
    tensor costs one reduction and no (N,)-sized temporary."""
    if torch.isfinite(values.sum(dtype=torch.float32)):
        return 0
    return sum(int((~torch.isfinite(chunk)).sum()) for chunk in values.detach().reshape(-1).split(1 << 24))


def check_finite_weights(model: CausalLM, spec: ModelSpec, layout: ParallelLayout) -> None:
    """E612 when a weight of the loaded model holds NaN or inf (before anything is written). Every rank checks
    its shard and learns whether any rank found one, so all ranks raise and none waits at a barrier."""
    bad = next(((n, c) for n, p in model.named_parameters() if (c := nonfinite_count(p))), None)
    if not any_rank(bad is not None, layout, spec.device):
        return
    where = str(spec.source) if isinstance(spec.source, Path) else "the model"
    hint = "the checkpoint is damaged (a diverged run or a faulty conversion?): recompute with another checkpoint"
    if bad is None:
        raise UsageError(
            Code.NON_FINITE_MODEL, f"{where}: a weight of another tensor-parallel rank holds NaN or inf", hint
        )
    name, count = bad
    if isinstance(spec.source, Path):
        from pgdiag.model.tensor_source import open_tensor_source

        with open_tensor_source(spec.source) as source:
            where = str(source.file_of(name) or spec.source)
    dtype = str(dict(model.named_parameters())[name].dtype).removeprefix("torch.")
    raise UsageError(
        Code.NON_FINITE_MODEL,
        f"{where}: tensor '{name}' holds {count} NaN or inf values (loaded as {dtype})",
        hint,
    )


def raise_overflow(
    hidden: torch.Tensor, inputs: RecomputeInputs, target_sample: np.ndarray, dtype: str
) -> None:
    """E612 naming the first sample whose final hidden states (K, H) hold NaN or inf (finite weights, so the
    forward overflowed)."""
    row = int(target_sample[int((~torch.isfinite(hidden).all(dim=1)).nonzero()[0, 0])])
    raise UsageError(
        Code.NON_FINITE_MODEL,
        f"{inputs.source}: step {int(inputs.step[row])}, sample {inputs.sample_id[row]}: the model's hidden states "
        f"hold NaN or inf (the forward overflows in {dtype})",
        "recompute with --dtype fp32"
        if dtype != "fp32"
        else "the checkpoint's activations overflow even in fp32",
    )
