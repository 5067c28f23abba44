"""The MoE combine in Triton: out[t] = sum_j round(weights[t, j] * rows[row_of[t, j]]), one pass over the rows.

What: the same function as `pgdiag.model.moe.combine_rows` (its plain-torch reference): each weighted expert
output is rounded to the rows' dtype (as HF does), the k outputs of a token are summed in fp32 in order
j = 0 .. k-1, and the sum is rounded to the rows' dtype once.

Why: `torch.compile` of the reference (gather, multiply, sum over k) ran at a tenth of the memory bandwidth on
an H200 (2.5 ms a layer for a 30k-token batch of Qwen3-30B-A3B, 19 % of the whole pass: docs/benchmarks.md,
"Issue 26"); the combine only has to read each expert row once and write each token's row once.

How: one program per (block of BLOCK_T tokens, block of BLOCK_H columns); for each of the k slots it loads the
row index and the weight of every token of the block and the (BLOCK_T, BLOCK_H) slice of those rows (contiguous
along the hidden dimension), multiplies in fp32, rounds to the rows' dtype and adds into an fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 4
BLOCK_H = 1024


@triton.jit
def _combine_kernel(
    rows_ptr,  # (M, H) 16-bit or fp32 expert outputs, READ-ONLY
    row_of_ptr,  # (N, K) int64 row of each assignment, READ-ONLY
    weights_ptr,  # (N, K) fp32, READ-ONLY
    out_ptr,  # (N, H) rows' dtype, OUT
    n_tokens,
    hidden,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    t_ok = offs_t < n_tokens
    h_ok = offs_h < hidden
    ok = t_ok[:, None] & h_ok[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for j in tl.static_range(K):
        row = tl.load(row_of_ptr + offs_t.to(tl.int64) * K + j, mask=t_ok, other=0)  # (BLOCK_T,) int64
        weight = tl.load(weights_ptr + offs_t.to(tl.int64) * K + j, mask=t_ok, other=0.0)  # (BLOCK_T,)
        values = tl.load(rows_ptr + row[:, None] * hidden + offs_h[None, :], mask=ok, other=0.0)
        weighted = (values.to(tl.float32) * weight[:, None]).to(rows_ptr.dtype.element_ty)  # rounded as HF
        total += weighted.to(tl.float32)
    dest = out_ptr + offs_t.to(tl.int64)[:, None] * hidden + offs_h[None, :]
    tl.store(dest, total.to(out_ptr.dtype.element_ty), mask=ok)


def combine_rows_triton(rows: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`pgdiag.model.moe.combine_rows` in one Triton kernel: rows (M, H), row_of (N, k) int64 (every entry a
    valid row), weights (N, k) fp32 -> (N, H) in rows.dtype."""
    n_tokens, k = weights.shape
    hidden = rows.shape[1]
    rows = rows.contiguous()
    out = torch.empty(n_tokens, hidden, dtype=rows.dtype, device=rows.device)
    if n_tokens == 0:
        return out
    grid = (triton.cdiv(n_tokens, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
    _combine_kernel[grid](
        rows,
        row_of.to(torch.int64).contiguous(),
        weights.float().contiguous(),
        out,
        n_tokens,
        hidden,
        K=k,
        BLOCK_T=BLOCK_T,
        BLOCK_H=BLOCK_H,
        num_warps=4,
    )
    return out
