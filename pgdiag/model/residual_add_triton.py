"""out = x + (p + q) in one pass: the residual add of a two-rank row-parallel output from its two partials.

What: the same function as `pgdiag.model.tp_sums.residual_add_reference` (plain torch, the reference): p + q
rounded to the inputs' dtype, then x added and rounded again, as two eager adds do. Both ranks of a TP = 2 group
get the same bits (p + q = q + p), and the bits of NCCL's two-rank sum followed by the add.

Why: `pgdiag.model.tp_sums.PeerCopySums` receives the other rank's partial whole instead of a summed one; one
kernel reads x, p and q once and writes out once, where two adds would also write and read p + q.

How: one program per BLOCK elements of the flattened (n, H) tensors (all contiguous, one shape and dtype), fp32
arithmetic, one rounding to the dtype after p + q and one after the add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _residual_add_kernel(
    out_ptr,  # (n * H,) OUT
    x_ptr,  # (n * H,) the residual stream, READ-ONLY
    p_ptr,  # (n * H,) this rank's partial, READ-ONLY
    q_ptr,  # (n * H,) the other rank's partial, READ-ONLY
    n_elements,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elements
    x = tl.load(x_ptr + offs, mask=ok)
    p = tl.load(p_ptr + offs, mask=ok)
    q = tl.load(q_ptr + offs, mask=ok)
    summed = (p.to(tl.float32) + q.to(tl.float32)).to(x.dtype)  # rounded once, as a two-rank all-reduce
    total = x.to(tl.float32) + summed.to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def residual_add_triton(
    x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x + (p + q) for contiguous tensors of one shape and dtype; written into `out` (contiguous) when given."""
    if out is None:
        out = torch.empty_like(x)
    n_elements = x.numel()
    if n_elements:
        grid = (triton.cdiv(n_elements, BLOCK),)
        _residual_add_kernel[grid](out, x, p, q, n_elements, BLOCK=BLOCK, num_warps=8)
    return out
