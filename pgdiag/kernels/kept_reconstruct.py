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

Ties: the references sort stably (`stable=True`, as CUDA's radix sort that vLLM's and SGLang's calls get on a
GPU): among equal logits vLLM's ascending sort drops the lower id first; SGLang's descending sort keeps it first.

Method: chunks of tokens whose fp32 logits (C, V) fit `LOGITS_BUDGET_BYTES`; under TP every rank's (C,
V_local) shard is all-gathered chunk by chunk (every rank gets the same K). The sets come from a threshold
bisection on the chunk's fp32 logits (`kept_threshold.keep_mask_threshold`: counts and masses at 16 thresholds
a pass, Triton on CUDA; the few tokens at the boundary decided one by one), never a sort of the vocabulary.
`keep_mask_vllm` and `keep_mask_sglang` are the literal sort-based references, kept beside it for the tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pgdiag.kernels.kept_set import KeptSet
from pgdiag.kernels.kept_threshold import Levels, kept_coordinates, levels_torch
from pgdiag.kernels.lm_head_logprobs_ref import _fp32_logits, head_operands

LOGITS_BUDGET_BYTES = 1 << 29
TEMPORARIES_TRITON = 2  # fp32 logits, two bool masks and their conjunction (window), in 4-byte units
TEMPORARIES_TORCH = 7  # and levels_torch's bucket index (8 B), exp (4 B) and its fp64 copy (8 B)
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
        ordered, order = z.sort(dim=1, descending=False, stable=True)
        cumulative = torch.softmax(ordered, dim=1).cumsum(dim=1)
        drop = cumulative <= (1 - top_p)[:, None]
        drop[:, -1] = False
        drop &= p_on[:, None]
        ordered.masked_fill_(drop, float("-inf"))
        z = torch.empty_like(z).scatter_(1, order, ordered)
    return torch.isfinite(z)


def keep_mask_sglang(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """(C, V) bool kept by SGLang's independent masks on the tempered full softmax of `z` (C, V)."""
    vocab = z.shape[1]
    probs = torch.softmax(z, dim=1)
    ordered, order = probs.sort(dim=1, descending=True, stable=True)
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


def _levels_for(impl: str, device: torch.device) -> Levels:
    """The counting pass of the threshold bisection: the Triton kernel on CUDA ("auto"), else plain torch."""
    if impl == "triton" or (impl == "auto" and device.type == "cuda"):
        from pgdiag.kernels.kept_threshold_triton import levels_triton

        return levels_triton
    return levels_torch


def reconstruct_logits(hidden_op: torch.Tensor, weight_op: torch.Tensor) -> torch.Tensor:
    """(C, V_local) fp32 logits of the head operands. On CUDA, an fp32 hidden against a 16-bit W is split into
    three pieces of W's dtype, h = hi + mid + lo (3 x 8 bits hold fp32's 24), and summed over three cuBLAS
    GEMMs with fp32 accumulation: every product exact, as the fp32 head's "bf16x3" mode (`fp32_head_triton`),
    on the tensor cores instead of an fp32 GEMM; elsewhere `_fp32_logits`."""
    low = weight_op.dtype
    if hidden_op.is_cuda and hidden_op.dtype == torch.float32 and low in (torch.bfloat16, torch.float16):
        hi = hidden_op.to(low)
        rest = hidden_op - hi.float()
        mid = rest.to(low)
        lo = (rest - mid.float()).to(low)
        out = torch.mm(lo, weight_op.T, out_dtype=torch.float32)
        out += torch.mm(mid, weight_op.T, out_dtype=torch.float32)
        out += torch.mm(hi, weight_op.T, out_dtype=torch.float32)
        return out
    return _fp32_logits(hidden_op, weight_op)


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
    impl: str = "auto",
) -> KeptSet:
    """The kept sets of N tokens under `engine`'s truncation (module docstring), as global ids.

    hidden (N, d); weight (V_local, d) this rank's head rows (the whole head without `tp_group`); top_k (N,)
    int64, top_p (N,) fp32, min_p (N,) fp32 per token (the off values: top_k <= 0, top_p >= 1, min_p <= 0).
    `impl`: the threshold bisection's counting pass, "auto" (Triton on CUDA), "triton" or "torch".
    """
    levels = _levels_for(impl, hidden.device)
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    n_tokens = hidden.shape[0]
    vocab_local = weight.shape[0]
    vocab_total = vocab_local * world  # an upper bound for the chunk size when shards are uneven
    hidden_op, weight_op = head_operands(hidden, weight, head_dtype)
    if head_dtype == "fp32" and not hidden.is_cuda:
        weight_op = weight_op.float()
    per_logit = 4 * (TEMPORARIES_TRITON if levels is not levels_torch else TEMPORARIES_TORCH)
    chunk = max(1, LOGITS_BUDGET_BYTES // (per_logit * max(vocab_total, 1)))
    ids: list[torch.Tensor] = []
    sizes = torch.zeros(n_tokens, dtype=torch.int64, device=hidden.device)
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)
        z = reconstruct_logits(hidden_op[start:stop], weight_op)  # (C, V_local)
        if temperature != 1.0:
            z.div_(temperature)
        if world > 1:
            z = _gather_vocab(z, tp_group)  # (C, V) in rank order = vocab order
        rows, cols = kept_coordinates(
            z,
            top_k[start:stop].long(),
            top_p[start:stop].float(),
            min_p[start:stop].float(),
            engine=engine,
            levels=levels,
        )  # row-major: ids ascending within a token
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
