"""Triton helpers of the kept-set head: the atomic OR that packs CSR kept ids into bitmask words, and the
gather-dot of the engine-log-prob term.

`or_bits_triton`: sets bit ``bit[e]`` of word ``word_index[e]`` of an (n_words,) int32 buffer for every element
e with `tl.atomic_or` (duplicate ids are harmless); the plain-torch reference is `kept_set.or_bits_torch`. It
builds the (C, V_local / 32) words that the head kernels read (`kept_set.kept_words`).

`kept_logits_triton`: the (E,) fp32 kept logits of `kept_set.kept_logits` (the plain-torch reference beside
it), z_e = (hidden[token_e] . weight[row_e]) / temperature, -inf where row_e is -1 (the id is in another TP
shard). Only `kept_set.engine_dot` uses it: Σ p_e z_e over K with the engine's log-probs, a weighted sum the
bitmask cannot carry. One program per BLOCK_E elements walks the hidden dimension in BLOCK_K steps, loads the
(BLOCK_E, BLOCK_K) slices of the hidden rows and the weight rows, multiplies them in fp32 (16-bit operands are
exact in fp32: fp32 products, fp32 sums, as the head's "bf16" mode) and sums along K: bound by reading
2 x E x d operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pgdiag.errors import Code, UsageError
from pgdiag.kernels.lm_head_logprobs_ref import head_operands

BLOCK_E = 32
BLOCK_K = 64
OR_BLOCK = 1024


@triton.jit
def _or_bits_kernel(
    words_ptr,  # (n_words,) int32, OUT (OR-ed into)
    word_ptr,  # (E,) int64 READ-ONLY: the word of each element
    bit_ptr,  # (E,) int64 READ-ONLY: the bit of each element, in [0, 32)
    n_elements,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elements
    word = tl.load(word_ptr + offs, mask=ok, other=0)
    bit = tl.load(bit_ptr + offs, mask=ok, other=0).to(tl.int32)
    tl.atomic_or(words_ptr + word, tl.full([BLOCK], 1, tl.int32) << bit, mask=ok)


def or_bits_triton(
    n_words: int, word_index: torch.Tensor, bit: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """(n_words,) int32 with bit `bit[e]` of word `word_index[e]` set (the contract of `kept_set.or_bits_torch`)."""
    words = torch.zeros(n_words, dtype=torch.int32, device=device)
    n_elements = int(word_index.shape[0])
    if n_elements:
        _or_bits_kernel[(triton.cdiv(n_elements, OR_BLOCK),)](
            words, word_index.long().contiguous(), bit.long().contiguous(), n_elements, BLOCK=OR_BLOCK
        )
    return words


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
