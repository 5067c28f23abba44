"""Rebuild the kept sets K from the model's own distribution and the run's top-k / top-p / min-p, as an engine does.

What: `reconstruct_kept` returns the `KeptSet` (CSR, global ids) that an engine's truncation keeps at each
token, from fp32 logits z = (hidden @ W.T) / T. For runs that recorded no K. Two engines' orders:

``vllm``   vLLM V1 (vllm-project/vllm 3e342658 ``Sampler.sample``; 3babc05a ``apply_top_k_top_p``; bf17660
           ``MinPLogitsProcessor.apply``): temperature, then min-p (drop p_j < min_p * max p, on the tempered
           softmax), then top-k (drop z_j below the k-th largest: ties at the k-th logit are kept), then top-p on
           the distribution renormalised after top-k: sort ascending, drop the tokens whose ascending cumulative
           probability is <= 1 - p, always keep the largest. The boundary token: token j is kept iff the mass
           of the tokens sorted after it (the larger ones) is < p.
``sglang`` SGLang (sgl-project/sglang 584f55d ``top_k_top_p_min_p_sampling_from_probs_torch``): independent
           masks on the full tempered distribution sorted descending: rank < k (ties broken by the sort, not
           kept), mass strictly before the token <= p, and p_j >= min_p * max p.

Method: chunks of tokens whose fp32 logits (C, V) fit `LOGITS_BUDGET_BYTES`; under TP every rank's (C,
V_local) shard is all-gathered chunk by chunk (every rank gets the same K). vLLM order: min-p and top-k are
elementwise thresholds (`torch.topk` finds the k-th largest), and top-p is decided on the top m tokens (m
doubled from 64 until they hold mass >= p: `keep_mask_vllm_topk`), so no row of V floats is sorted; SGLang's
masks sort the row (`keep_mask_sglang`). `keep_mask_vllm` is the literal sort-based reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pgdiag.kernels.kept_set import KeptSet
from pgdiag.kernels.lm_head_logprobs_ref import _fp32_logits, head_operands

LOGITS_BUDGET_BYTES = 1 << 29
TEMPORARIES = 6  # logits, sorted logits, indices (8 B), probs, cumsum, mask
ENGINES = ("vllm", "sglang")


def keep_mask_vllm(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """(C, V) bool kept by vLLM V1's order on tempered fp32 logits `z` (C, V); top_k (C,) int64 (<= 0 or >= V:
    off), top_p (C,) fp32 (>= 1: off), min_p (C,) fp32 (<= 0: off)."""
    z = z.clone()
    vocab = z.shape[1]
    if bool((min_p > 0).any()):
        probs = torch.softmax(z, dim=1)
        threshold = probs.amax(dim=1, keepdim=True) * min_p[:, None]
        z.masked_fill_((probs < threshold) & (min_p[:, None] > 0), float("-inf"))
    k_on = (top_k > 0) & (top_k < vocab)
    if bool(k_on.any()):
        k = torch.where(k_on, top_k, 1).clamp(max=vocab)
        kth = torch.topk(z, int(k.max()), dim=1).values.gather(1, (k - 1)[:, None])  # (C, 1) the k-th largest
        z.masked_fill_((z < kth) & k_on[:, None], float("-inf"))
    p_on = top_p < 1
    if bool(p_on.any()):
        ordered, order = z.sort(dim=1, descending=False)
        cumulative = torch.softmax(ordered, dim=1).cumsum(dim=1)
        drop = cumulative <= (1 - top_p)[:, None]
        drop[:, -1] = False
        drop &= p_on[:, None]
        ordered.masked_fill_(drop, float("-inf"))
        z = torch.empty_like(z).scatter_(1, order, ordered)
    return torch.isfinite(z)


FAST_MAX_CANDIDATES = 8192  # top-p decided on at most this many top tokens a row, else the full sort


def keep_mask_vllm_topk(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """`keep_mask_vllm` without sorting the vocabulary: min-p and top-k are elementwise thresholds (the k-th
    largest from `torch.topk`), and top-p is decided on the m largest remaining logits, m doubled from 64 until
    they hold mass >= p in every row that uses top-p (all kept tokens are then among them). Token j is kept iff
    the renormalised mass of the tokens above it is < p, the largest always (vLLM's test: the ascending cumulative
    probability > 1 - p, with the tail below the candidates taken as 1 - their mass: a token whose cumulative
    mass is within float rounding of 1 - p may flip, and tied logits may be ordered otherwise). Falls
    back to `keep_mask_vllm` when m would exceed `FAST_MAX_CANDIDATES`."""
    z = z.clone()
    vocab = z.shape[1]
    if bool((min_p > 0).any()):
        probs = torch.softmax(z, dim=1)
        threshold = probs.amax(dim=1, keepdim=True) * min_p[:, None]
        z.masked_fill_((probs < threshold) & (min_p[:, None] > 0), float("-inf"))
    k_on = (top_k > 0) & (top_k < vocab)
    if bool(k_on.any()):
        k = torch.where(k_on, top_k, 1).clamp(max=vocab)
        kth = torch.topk(z, int(k.max()), dim=1).values.gather(1, (k - 1)[:, None])  # (C, 1)
        z.masked_fill_((z < kth) & k_on[:, None], float("-inf"))
    keep = torch.isfinite(z)
    p_on = top_p < 1
    if not bool(p_on.any()):
        return keep
    lse = torch.logsumexp(z, dim=1, keepdim=True)  # (C, 1) over the remaining tokens
    m = min(64, vocab)
    while True:
        values, index = torch.topk(z, m, dim=1)  # (C, m) descending
        probs = torch.exp(values - lse)
        mass = probs.sum(dim=1)
        done = ~p_on | (mass >= top_p) | (keep.sum(dim=1) <= m)
        if bool(done.all()):
            break
        if m >= min(vocab, FAST_MAX_CANDIDATES):
            return keep_mask_vllm(z, torch.zeros_like(top_k), top_p, torch.zeros_like(min_p))
        m = min(2 * m, vocab)
    # vLLM's test on the ascending cumulative probability, the tail below the m candidates summed first
    tail = (1.0 - mass).clamp(min=0.0)[:, None]  # (C, 1) mass of the tokens below the candidates
    ascending = tail + probs.flip(1).cumsum(dim=1).flip(1)  # (C, m) mass of the token and all below it
    drop = (ascending <= (1 - top_p)[:, None]) & p_on[:, None]
    drop[:, 0] = False
    out = keep & ~p_on[:, None]  # rows without top-p keep what min-p and top-k left
    kept_top = torch.zeros_like(keep).scatter_(1, index, ~drop & torch.isfinite(values))
    return torch.where(p_on[:, None], kept_top, out)


def keep_mask_sglang(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """(C, V) bool kept by SGLang's independent masks on the tempered full softmax of `z` (C, V)."""
    vocab = z.shape[1]
    probs = torch.softmax(z, dim=1)
    ordered, order = probs.sort(dim=1, descending=True)
    before = ordered.cumsum(dim=1) - ordered  # mass strictly before each sorted token
    keep = torch.ones_like(ordered, dtype=torch.bool)
    k_on = (top_k > 0) & (top_k < vocab)
    rank = torch.arange(vocab, device=z.device)[None, :]
    keep &= ~((rank >= top_k[:, None]) & k_on[:, None])
    keep &= ~((before > top_p[:, None]) & (top_p < 1)[:, None])
    threshold = ordered[:, :1] * min_p[:, None]
    keep &= ~((ordered < threshold) & (min_p > 0)[:, None])
    keep &= ordered > 0
    return torch.zeros_like(keep).scatter_(1, order, keep)


def reconstruct_kept(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    temperature: float,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    engine: str,
    head_dtype: str = "fp32",
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> KeptSet:
    """The kept sets of N tokens under `engine`'s truncation (module docstring), as global ids.

    hidden (N, d); weight (V_local, d) this rank's head rows (the whole head without `tp_group`); top_k (N,)
    int64, top_p (N,) fp32, min_p (N,) fp32 per token (the off values: top_k <= 0, top_p >= 1, min_p <= 0).
    """
    mask_of = keep_mask_vllm_topk if engine == "vllm" else keep_mask_sglang
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    n_tokens = hidden.shape[0]
    vocab_local = weight.shape[0]
    vocab_total = vocab_local * world  # an upper bound for the chunk size when shards are uneven
    hidden_op, weight_op = head_operands(hidden, weight, head_dtype)
    if head_dtype == "fp32":
        weight_op = weight_op.float()
    chunk = max(1, LOGITS_BUDGET_BYTES // (TEMPORARIES * 4 * max(vocab_total, 1)))
    ids: list[torch.Tensor] = []
    sizes = torch.zeros(n_tokens, dtype=torch.int64, device=hidden.device)
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)
        z = _fp32_logits(hidden_op[start:stop], weight_op) / temperature  # (C, V_local)
        if world > 1:
            z = _gather_vocab(z, tp_group)  # (C, V) in rank order = vocab order
        keep = mask_of(z, top_k[start:stop].long(), top_p[start:stop].float(), min_p[start:stop].float())
        rows, cols = keep.nonzero(as_tuple=True)  # row-major: ids ascending within a token
        ids.append(cols.long() + (vocab_start if world == 1 else 0))
        sizes[start:stop] = torch.bincount(rows, minlength=stop - start)
    offsets = torch.zeros(n_tokens + 1, dtype=torch.int64, device=hidden.device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=hidden.device)
    return KeptSet(flat, offsets)


def _gather_vocab(local: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """(C, V) logits from every rank's (C, V_local) shard (shards may differ in size by one row)."""
    world = dist.get_world_size(tp_group)
    width = torch.tensor([local.shape[1]], dtype=torch.int64, device=local.device)
    widths = [torch.zeros_like(width) for _ in range(world)]
    dist.all_gather(widths, width, group=tp_group)
    widest = int(max(int(w.item()) for w in widths))
    padded = torch.full((local.shape[0], widest), float("-inf"), dtype=local.dtype, device=local.device)
    padded[:, : local.shape[1]] = local
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded.contiguous(), group=tp_group)
    return torch.cat([p[:, : int(w.item())] for p, w in zip(pieces, widths, strict=True)], dim=1)
