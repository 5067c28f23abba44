"""Triton helpers of the kept-set head: the kernel that packs CSR kept ids into bitmask words, and the
gather-dot of the engine-log-prob term.

`csr_words_triton`: the (C, ceil(V_local / 32)) int32 words of tokens [start, start + C) that the head kernels
read (`kept_set.kept_words`, whose torch path is the reference). One program a token reads its offsets, walks its
CSR range in blocks and sets each id's bit in its own row with `tl.atomic_or` (duplicate ids are harmless; ids
outside the shard are left out). One launch instead of the dozen tensor ops of the torch path, whose launches
left the GPU waiting on the host before the head. A range that falls or leaves [0, len(ids)] (offsets that
`lm_head_logprobs` reports after the head) is clipped, never read out of bounds.

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
CSR_BLOCK = 64  # kept ids a program reads at once (|K| <= 64 in one step)


@triton.jit
def _csr_words_kernel(
    words_ptr,  # (C, W) int32, zeroed, OUT (OR-ed into)
    ids_ptr,  # (E,) int64 READ-ONLY: global kept ids, CSR
    offsets_ptr,  # (N + 1,) int64 READ-ONLY
    start,  # the chunk's first token
    n_elements,  # E
    vocab_start,
    vocab_local,
    n_words,  # W
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    token = start + row
    lo = tl.load(offsets_ptr + token)
    hi = tl.load(offsets_ptr + token + 1)
    lo = tl.minimum(tl.maximum(lo, 0), n_elements)
    hi = tl.minimum(tl.maximum(hi, lo), n_elements)
    row_words = words_ptr + row.to(tl.int64) * n_words
    for first in range(lo, hi, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        ok = offs < hi
        local = tl.load(ids_ptr + offs, mask=ok, other=-1) - vocab_start
        inside = ok & (local >= 0) & (local < vocab_local)
        local = tl.where(inside, local, 0)
        bit = (local % 32).to(tl.int32)
        tl.atomic_or(row_words + local // 32, tl.full([BLOCK], 1, tl.int32) << bit, mask=inside)


def csr_words_triton(
    ids: torch.Tensor, offsets: torch.Tensor, start: int, stop: int, *, vocab_start: int, vocab_local: int
) -> torch.Tensor:
    """(stop - start, ceil(vocab_local / 32)) int32 words of the CSR sets of tokens [start, stop) over the shard
    [vocab_start, vocab_start + vocab_local) (the contract of `kept_set.kept_words` for CSR ids)."""
    n_rows, n_words = stop - start, -(-vocab_local // 32)
    words = torch.zeros(n_rows, n_words, dtype=torch.int32, device=ids.device)
    if n_rows and n_words and ids.shape[0]:
        _csr_words_kernel[(n_rows,)](
            words, ids, offsets, start, ids.shape[0], vocab_start, vocab_local, n_words, BLOCK=CSR_BLOCK
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
