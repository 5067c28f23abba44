"""Per-token softmax partials: how vocab pieces (kernel splits, TP ranks) are merged into one answer.

What: every LM-head implementation in pgdiag reduces its piece of the vocabulary to four fp32 numbers per
token, the *partials* (rows of a ``(4, N)`` tensor, stacked as ``(P, 4, N)`` for P pieces):

    m   = max_j z_j                          (the piece's max logit; -inf for an empty piece)
    s   = sum_j exp(z_j - m)                 (sum of exponentials, relative to m)
    s1  = sum_j exp(z_j - m) * (z_j - m)     (centred weighted sum, for the entropy)
    t   = z_y if the target y is in the piece, else -inf

with ``z = logits / temperature``. Merging pieces needs only these: with M = max m_p and a_p = exp(m_p - M),
``S = sum_p a_p s_p`` and ``S1 = sum_p a_p (s1_p + (m_p - M) s_p)``; then ``lse = M + log S``,
``entropy = log S - S1 / S`` and ``logprob = t - lse``.

Why centred: ``sum p*z`` and ``lse`` are both ~|z| ~ 30 and their difference (the entropy) can be ~1e-3, so
computing ``entropy = lse - sum p*z`` from uncentred sums loses digits; ``s1`` keeps ``z - m`` small.

Tensor parallelism (vocab-parallel W): each rank reduces its shard to ``(4, N)`` partials, then **one**
collective (an all-gather of the ``(4, N)`` partials, 16 bytes a token) gives every rank all shards'
partials, and each rank merges them locally with the same function that merges kernel splits. TP=1 does no
collective. Uneven shards (V not divisible by the TP degree, even an empty shard) need no special case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PARTIAL_ROWS = 4  # m, s, s1, t


def vocab_shard_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the vocab rows that `rank` holds when `vocab_size` rows are split over `world_size`.

    The first ``vocab_size % world_size`` ranks get one row more (e.g. 37 over 3 -> 13, 12, 12).
    """
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def empty_partials(n_tokens: int, device: torch.device) -> torch.Tensor:
    """(1, 4, N) partials of an empty vocab piece: m = -inf, s = 0, s1 = 0, t = -inf."""
    partials = torch.zeros(1, PARTIAL_ROWS, n_tokens, dtype=torch.float32, device=device)
    partials[:, 0] = float("-inf")
    partials[:, 3] = float("-inf")
    return partials


def merge_partials(partials: torch.Tensor) -> torch.Tensor:
    """Merge (P, 4, N) fp32 partials of disjoint vocab pieces into (4, N) partials of their union."""
    piece_max, sumexp, centred, target_logit = partials.unbind(1)  # each (P, N)
    merged_max = piece_max.amax(0)  # (N,)
    nonempty = sumexp > 0  # an empty piece has m = -inf and s = 0; its shift would be NaN
    shift = torch.where(nonempty, piece_max - merged_max, 0.0)  # (P, N), <= 0
    scale = torch.where(nonempty, torch.exp(shift), 0.0)  # (P, N)
    merged_sumexp = (scale * sumexp).sum(0)  # (N,)
    merged_centred = (scale * (centred + shift * sumexp)).sum(0)  # (N,)
    merged_target = target_logit.amax(0)  # (N,), -inf where no piece holds the target
    return torch.stack([merged_max, merged_sumexp, merged_centred, merged_target])


def gather_partials(local: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """All ranks' (4, N) partials as (world, 4, N): the one collective of a vocab-parallel call."""
    world_size = dist.get_world_size(tp_group)
    gathered = torch.empty((world_size, *local.shape), dtype=local.dtype, device=local.device)
    dist.all_gather(list(gathered.unbind(0)), local.contiguous(), group=tp_group)  # views of one buffer
    return gathered


def finish_partials(merged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(4, N) merged partials -> fp32 (logprobs (N,), entropy (N,), target_found (N,) bool)."""
    merged_max, sumexp, centred, target_logit = merged.unbind(0)
    log_sumexp = torch.log(sumexp)  # (N,)
    entropy = log_sumexp - centred / sumexp
    target_found = torch.isfinite(target_logit)
    logprobs = torch.where(target_found, (target_logit - merged_max) - log_sumexp, 0.0)
    return logprobs, entropy, target_found
