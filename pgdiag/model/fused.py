"""Projections of the same input fused into one GEMM: q/k/v of every attention block, gate/up of every dense MLP.

What: `FusedProjection(weight, bias, widths)` holds several `nn.Linear` of one module as one weight, their rows
back to back (this rank's rows under tensor parallelism); calling it on x (N, H) runs one GEMM and returns the
parts as column views of its output. `fused_slots(model, device, dtype)` allocates every module's fused weight (a
module lists its parts in ``FUSED_PARTS``), sets ``module.fused``, and returns where each part's HF-named parameter
is to be written: the loader copies each tensor it reads straight into those rows and makes the parameter a view
of them, so the fused weights are the only copy and `named_parameters` keeps the HF names.
`unfuse_projections(model)` puts the separate GEMMs back (the weights stay where they are): the baseline of the
tests and benchmarks.

Why: under tensor parallelism each rank's q/k/v and gate/up are narrow (at TP 2 on the Qwen3-8B shape, k and v
are 512 columns each); one wider GEMM reads the activations once and runs closer to peak, and it also saves two
launches per block at TP 1 (docs/benchmarks.md, issue 26).

How: sharding is untouched: each part is read with its own entry of the plan (`pgdiag.model.tp.SHARD_PLAN`), and a
rank's column-parallel rows of q, k and v stay whole heads, so the output columns split exactly as the separate
GEMMs' outputs did.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class FusedProjection:
    """Parts of widths `widths` as one GEMM: weight (sum(widths), H), bias (sum(widths),) or None."""

    weight: Tensor
    bias: Tensor | None
    widths: tuple[int, ...]

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (N, H) -> one (N, width) column view per part, in `widths` order."""
        return F.linear(x, self.weight, self.bias).split(self.widths, dim=-1)


def fused_slots(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Allocate the fused weight (and bias) of every module of `model` that lists ``FUSED_PARTS``, set its
    ``fused``, and return {HF parameter name: the rows of the fused tensor that parameter is}."""
    slots: dict[str, Tensor] = {}
    for path, module in model.named_modules():
        parts = getattr(module, "FUSED_PARTS", ())
        if not parts:
            continue
        linears = [module.get_submodule(part) for part in parts]
        widths = tuple(linear.out_features for linear in linears)
        rows = sum(widths)
        weight = torch.empty(rows, linears[0].in_features, device=device, dtype=dtype)  # (sum(widths), H)
        bias = None if linears[0].bias is None else torch.empty(rows, device=device, dtype=dtype)
        for part, stop, width in zip(parts, accumulate(widths), widths, strict=True):
            slots[f"{path}.{part}.weight"] = weight[stop - width : stop]
            if bias is not None:
                slots[f"{path}.{part}.bias"] = bias[stop - width : stop]
        module.fused = FusedProjection(weight, bias, widths)
    return slots


def unfuse_projections(model: nn.Module) -> None:
    """Run every fused module's parts as separate GEMMs again (their weights stay views of the fused rows)."""
    for module in model.modules():
        if getattr(module, "FUSED_PARTS", ()):
            module.fused = None
