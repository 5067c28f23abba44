"""Triton gather-dot for the kept-set head: E dot products ``hidden[token_e] . W[row_e]`` without an (E, d) copy.

What: the (E,) fp32 kept logits of `kept_set.kept_logits` (the plain-torch reference beside it), z_e =
(hidden[token_e] . weight[row_e]) / temperature, -inf where row_e is -1 (the id is in another TP shard).

How: one program per BLOCK_E elements loads their token and row indices, walks the hidden dimension in
BLOCK_K steps, loads the (BLOCK_E, BLOCK_K) slices of the hidden rows and the weight rows, multiplies them in
fp32 (16-bit operands are exact in fp32: fp32 products, fp32 sums, as the head's "bf16" mode) and sums along
K. The loads are row gathers, so the kernel is bound by reading 2 x E x d operands: at |K| = 64 per token and
d = 4096 that is 1 MB a token of bf16, against the full head's V x d weight reads shared by a token block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pgdiag.errors import Code, UsageError
from pgdiag.kernels.lm_head_logprobs_ref import head_operands

BLOCK_E = 32
BLOCK_K = 64


@triton.jit
def _kept_logits_kernel(
    hidden_ptr,  # (N, D) READ-ONLY, rows contiguous
    weight_ptr,  # (V_local, D) READ-ONLY, rows contiguous
    token_ptr,  # (E,) int64 READ-ONLY: the token of each element
    row_ptr,  # (E,) int64 READ-ONLY: the weight row of each element, -1 = not in this shard
    out_ptr,  # (E,) fp32 OUT
    n_elements,
    hidden_size,
    stride_hidden,
    stride_weight,
    inv_temperature,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)  # (BLOCK_E,)
    e_ok = offs_e < n_elements
    token = tl.load(token_ptr + offs_e, mask=e_ok, other=0)
    row = tl.load(row_ptr + offs_e, mask=e_ok, other=-1)
    inside = row >= 0
    safe_row = tl.where(inside, row, 0)
    acc = tl.zeros([BLOCK_E], tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k_start in range(0, hidden_size, BLOCK_K):
        k = k_start + offs_k  # (BLOCK_K,)
        k_ok = k < hidden_size
        load_ok = e_ok[:, None] & k_ok[None, :]
        h = tl.load(hidden_ptr + token[:, None] * stride_hidden + k[None, :], mask=load_ok, other=0.0)
        w = tl.load(weight_ptr + safe_row[:, None] * stride_weight + k[None, :], mask=load_ok, other=0.0)
        acc += tl.sum(h.to(tl.float32) * w.to(tl.float32), axis=1)
    z = tl.where(inside, acc * inv_temperature, float("-inf"))
    tl.store(out_ptr + offs_e, z, mask=e_ok)


def kept_logits_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    element_token: torch.Tensor,
    element_row: torch.Tensor,
    *,
    temperature: float,
    head_dtype: str,
) -> torch.Tensor:
    """(E,) fp32 kept logits, the contract of `kept_set.kept_logits`."""
    if hidden.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise UsageError(
            Code.DEVICE_UNAVAILABLE,
            f"impl='triton' needs CUDA tensors (got {hidden.device}); use impl='torch'",
        )
    n_elements = int(element_token.shape[0])
    out = torch.full((n_elements,), float("-inf"), dtype=torch.float32, device=hidden.device)
    if n_elements == 0 or weight.shape[0] == 0:
        return out
    hidden_op, weight_op = head_operands(hidden, weight, head_dtype)
    hidden_op = hidden_op if hidden_op.stride(1) == 1 else hidden_op.contiguous()
    weight_op = weight_op if weight_op.stride(1) == 1 else weight_op.contiguous()
    grid = (triton.cdiv(n_elements, BLOCK_E),)
    _kept_logits_kernel[grid](
        hidden_op,
        weight_op,
        element_token.to(torch.int64).contiguous(),
        element_row.to(torch.int64).contiguous(),
        out,
        n_elements,
        hidden.shape[1],
        hidden_op.stride(0),
        weight_op.stride(0),
        1.0 / temperature,
        BLOCK_E=BLOCK_E,
        BLOCK_K=BLOCK_K,
    )
    return out
