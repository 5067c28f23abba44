"""Plain-torch LM-head partials: the reference for the Triton kernel and pgdiag's CPU path.

What: for hidden states H (N, d) and a vocab shard W (V_local, d), the per-token softmax partials
(max, sum of exponentials, centred weighted sum, target logit; see `vocab_parallel`) of
``z = (H @ W.T) / temperature`` over the shard, as a (1, 4, N) fp32 tensor. With per-token kept sets K
(`kept_words`: (N, ceil(V_local / 32)) int32 packed bits, `kept_set.kept_words`) the same pass also gives the
partials of z restricted to K (`masked_partials`: the masked max, sum of exponentials and centred sum; the
target row -inf, filled by the caller): (1, 8, N), the reference of the Triton kernels' kept pass.

Why this way: it is the obvious computation (matmul, max, exp, sums, gather) so that a reader can check it,
written with the same partials as the Triton kernel so that both share the merge, the TP collective and the
final ``logprob`` / ``entropy`` formulas. Logits are always fp32: in "bf16" mode the bf16 (or fp16) operands
are multiplied with fp32 results (exact products, fp32 sums; never a bf16 logit, which would be off by up to
0.06 nats at |z| ~ 30); in "fp32" mode both operands are fp32. Temperature divides the fp32 logits.

How (memory): tokens are processed in chunks so that the fp32 logits and the two same-size temporaries
(``z - m`` and its exp) stay within `LOGITS_BUDGET_BYTES`: chunk = budget / (3 * 4 bytes * V_local), e.g.
at V_local = 151936 and 1 GiB that is 588 tokens a chunk, 0.33 GiB per fp32 logits chunk.
"""

from __future__ import annotations

import torch

from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, empty_partials

LOGITS_BUDGET_BYTES = 1 << 30
TEMPORARIES_PER_LOGIT = 3  # z, z - m, exp(z - m)
TEMPORARIES_PER_KEPT_LOGIT = 7  # and the gathered word, the bit, the masked z - m_K, its exp


def head_operands(
    hidden: torch.Tensor, weight: torch.Tensor, head_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (hidden, weight) operands of the head matmul for `head_dtype`.

    "bf16": 16-bit operands (fp16 stays fp16 if W is fp16, anything else becomes bf16), fp32 products.
    "fp32": hidden becomes fp32; W keeps its dtype (bf16/fp16 upcast exactly inside the matmul).
    """
    if head_dtype == "fp32":
        return hidden.float(), weight
    low = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return hidden.to(low), weight.to(low)


def head_mode_for(head_dtype: str, weight_dtype: torch.dtype, hidden_dtype: torch.dtype) -> str:
    """The head arithmetic this implementation runs: the plain `head_dtype` ("bf16" or "fp32")."""
    return head_dtype


def _fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(C, d) x (V_local, d) -> (C, V_local) fp32 logits with fp32 products and sums."""
    if hidden.dtype == weight.dtype and hidden.dtype != torch.float32 and hidden.is_cuda:
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)  # cuBLAS, fp32 output, no rounding to bf16
    return hidden.float() @ weight.float().T


def unpack_words(words: torch.Tensor, vocab_local: int) -> torch.Tensor:
    """(C, W) int32 packed bits -> (C, V_local) bool, column j = bit j % 32 of word j // 32."""
    cols = torch.arange(vocab_local, device=words.device)
    return ((words[:, cols // 32] >> (cols % 32).to(words.dtype)) & 1).bool()


def masked_partials(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(4, C) partials of the logits `z` (C, V_local) fp32 restricted to `mask` (C, V_local) bool: the masked
    max (-inf where the row's mask is empty), sum of exp(z - m), centred sum, and -inf for the target."""
    has = mask.any(dim=1)  # (C,)
    row_max = z.masked_fill(~mask, float("-inf")).amax(dim=1)  # (C,)
    centred = torch.where(mask, z - torch.where(has, row_max, 0.0)[:, None], 0.0)  # (C, V_local)
    weights = torch.where(mask, torch.exp(centred), 0.0)
    return torch.stack(
        [
            row_max,
            weights.sum(dim=1),
            (weights * centred).sum(dim=1),
            torch.full_like(row_max, float("-inf")),
        ]
    )


def lm_head_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_targets: torch.Tensor,
    *,
    temperature: float,
    head_dtype: str,
    kept_words: torch.Tensor | None = None,
) -> torch.Tensor:
    """(1, 4, N) fp32 partials of ``z = (hidden @ weight.T) / temperature`` over this vocab shard; with
    `kept_words` (N, ceil(V_local / 32)) int32, (1, 8, N): rows 4-7 the partials over each token's kept set.

    hidden (N, d); weight (V_local, d); local_targets (N,) int64: the target's row in this shard, or -1 when
    the target is not in it (or ignored). head_dtype: "bf16" or "fp32" (see `head_operands`).
    """
    n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    n_rows = PARTIAL_ROWS if kept_words is None else 2 * PARTIAL_ROWS
    if vocab_local == 0 or n_tokens == 0:
        return empty_partials(n_tokens, hidden.device).repeat(1, n_rows // PARTIAL_ROWS, 1)
    hidden_op, weight_op = head_operands(hidden, weight, head_dtype)
    if head_dtype == "fp32":  # a 16-bit head (kept so by the loader) is upcast once, not once per chunk
        weight_op = weight_op.float()
    per_logit = TEMPORARIES_PER_LOGIT if kept_words is None else TEMPORARIES_PER_KEPT_LOGIT
    chunk = max(1, LOGITS_BUDGET_BYTES // (per_logit * 4 * vocab_local))
    inv_temperature = 1.0 / temperature
    partials = torch.empty(1, n_rows, n_tokens, dtype=torch.float32, device=hidden.device)
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)
        z = _fp32_logits(hidden_op[start:stop], weight_op) * inv_temperature  # (C, V_local) fp32
        targets = local_targets[start:stop]  # (C,)
        if kept_words is not None:
            mask = unpack_words(kept_words[start:stop], vocab_local)  # (C, V_local)
            partials[0, PARTIAL_ROWS:, start:stop] = masked_partials(z, mask)
        target_logit = z.gather(1, targets.clamp(min=0)[:, None])[:, 0]  # (C,)
        row_max = z.amax(dim=1)  # (C,)
        centred = z.sub_(row_max[:, None])  # (C, V_local), z - m (in place: z is not needed again)
        weights = torch.exp(centred)  # (C, V_local)
        partials[0, 0, start:stop] = row_max
        partials[0, 1, start:stop] = weights.sum(dim=1)
        partials[0, 2, start:stop] = (weights * centred).sum(dim=1)
        partials[0, 3, start:stop] = torch.where(targets >= 0, target_logit, float("-inf"))
    return partials
