"""LM-head scoring over a kept set K: the partials of the renormalised distribution, beside the full ones.

What: an inference engine samples token y from the distribution renormalised over its kept set K (the tokens
that survived min-p / top-k / top-p after temperature T). With z = logits / T, per token:

    logprobs      = z_y - logsumexp_{j in K} z_j                   (the renormalised log-prob)
    entropy       = entropy of softmax(z) restricted to K and renormalised
    kept_mass     = sum_{j in K} softmax(z)_j = exp(lse_K - lse)    (the kept mass under the model)
    logprobs_full = z_y - logsumexp_j z_j                          (the full-vocabulary log-prob)

so ``logprobs - logprobs_full = -log kept_mass`` (>= 0). A token with an empty K (not recorded) scores the full
vocabulary: its kept mass is 1.

How: K arrives in CSR form over the N tokens (`KeptSet`: ids (E,), offsets (N + 1,)). The kept logits are E dot
products ``hidden[n] . W[id]`` (a gather-dot, O(E d), against O(N V d) for the full head: |K| = 64 at V = 152k
is 0.04 % more work), computed by `kept_logits` (plain torch, the reference) or by the Triton gather-dot kernel
(`kept_set_triton`), then reduced per token to the same four partials as the full head (`vocab_parallel`:
max, sum of exponentials, centred sum, target logit), so kernel splits and TP ranks merge with the same
`merge_partials`. Under TP each rank scores the ids of K in its shard; `lm_head_logprobs` gathers the full
and the kept partials in one collective (8 numbers a token). The target logit of the renormalised log-prob is
the gather-dot's own (a one-token K gives exactly 0.0), the full one the head's.

Operands follow the head: "bf16" multiplies the 16-bit operands with fp32 products and sums, "fp32" the fp32
hidden with the (upcast) weight, as `lm_head_logprobs_ref.head_operands` does for the full head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pgdiag.kernels.lm_head_logprobs_ref import head_operands
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, empty_partials

GATHER_CHUNK = 1 << 16  # kept elements per torch gather-dot chunk: 65536 x d x 4 B x 2 operands


@dataclass(frozen=True)
class KeptSet:
    """Kept sets of N tokens in CSR form: token n's set is ``ids[offsets[n]:offsets[n + 1]]`` (global ids);
    an empty set means "not recorded" (score the full vocabulary there)."""

    ids: torch.Tensor  # (E,) int64 global token ids
    offsets: torch.Tensor  # (N + 1,) int64, offsets[0] == 0, offsets[-1] == E
    logprobs: torch.Tensor | None = None  # (E,) the engine's own log-probs of the kept ids (for kept_kl)

    @property
    def n_tokens(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def sizes(self) -> torch.Tensor:
        """(N,) int64 size of each token's set."""
        return self.offsets[1:] - self.offsets[:-1]

    def element_token(self) -> torch.Tensor:
        """(E,) int64 token owning each kept element."""
        return torch.repeat_interleave(torch.arange(self.n_tokens, device=self.ids.device), self.sizes())

    def to(self, device: torch.device) -> KeptSet:
        logprobs = None if self.logprobs is None else self.logprobs.to(device)
        return KeptSet(self.ids.to(device), self.offsets.to(device), logprobs)

    def engine_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """((E,) p_e, the engine's probabilities renormalised over each set; (N,) Σ p_e log p_e per token), in
        fp64 from `logprobs` (the same on every TP rank: they are inputs, not shards)."""
        assert self.logprobs is not None
        token = self.element_token()
        lp = self.logprobs.double()
        top = torch.full((self.n_tokens,), float("-inf"), dtype=torch.float64, device=lp.device)
        top = top.scatter_reduce(0, token, lp, reduce="amax", include_self=True)
        sums = torch.zeros(self.n_tokens, dtype=torch.float64, device=lp.device).index_add_(
            0, token, torch.exp(lp - top[token])
        )
        lp_k = lp - (top + torch.log(sums))[token]  # (E,) log p_e over K
        p = torch.exp(lp_k)
        plogp = torch.zeros(self.n_tokens, dtype=torch.float64, device=lp.device).index_add_(
            0, token, p * lp_k
        )
        return p, plogp


BITMASK_CHUNK_BYTES = 256 << 20  # unpacked bits (one byte each) of one bitmask expansion chunk


def expand_bitmasks(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q packed little-endian bitmasks (Q, B) uint8 -> ((E,) int64 ids ascending within a row, (Q + 1,) int64
    offsets), on the bitmasks' device: bytes shifted into (rows, B, 8) bits, one `nonzero` a chunk of rows
    (`BITMASK_CHUNK_BYTES` of bits). The torch twin of `pgdiag.data.kept.bitmask_sets`."""
    n_rows, width = bits.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    step = max(1, BITMASK_CHUNK_BYTES // max(8 * width, 1))
    ids: list[torch.Tensor] = []
    sizes = torch.zeros(n_rows, dtype=torch.int64, device=bits.device)
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        unpacked = ((bits[start:stop, :, None] >> shifts) & 1).bool().reshape(stop - start, 8 * width)
        rows, cols = unpacked.nonzero(as_tuple=True)  # row-major: ids ascending within a row
        ids.append(cols)
        sizes[start:stop] = torch.bincount(rows, minlength=stop - start)
    offsets = torch.zeros(n_rows + 1, dtype=torch.int64, device=bits.device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=bits.device)
    return flat, offsets


def with_bitmasks(kept: KeptSet, queries: torch.Tensor, bits: torch.Tensor) -> KeptSet:
    """`kept` with the empty sets of tokens `queries` (Q_b,) int64 replaced by the packed bitmasks `bits`
    (Q_b, B) uint8, expanded on their device (`expand_bitmasks`); their engine log-probs are NaN."""
    device = kept.ids.device
    extra_ids, extra_offsets = expand_bitmasks(bits.to(device))
    extra_sizes = extra_offsets[1:] - extra_offsets[:-1]  # (Q_b,)
    sizes = kept.sizes().clone()
    sizes[queries.to(device)] = extra_sizes
    offsets = torch.zeros_like(kept.offsets)
    torch.cumsum(sizes, 0, out=offsets[1:])
    out = torch.empty(int(offsets[-1]), dtype=torch.int64, device=device)
    plain_token = kept.element_token()  # (E1,) their rank inside a set is unchanged
    plain_rank = torch.arange(kept.ids.shape[0], device=device) - kept.offsets[plain_token]
    out[offsets[plain_token] + plain_rank] = kept.ids
    extra_token = torch.repeat_interleave(queries.to(device), extra_sizes)
    extra_rank = torch.arange(extra_ids.shape[0], device=device) - torch.repeat_interleave(
        extra_offsets[:-1], extra_sizes
    )
    out[offsets[extra_token] + extra_rank] = extra_ids
    logprobs = None
    if kept.logprobs is not None:
        logprobs = torch.full((out.shape[0],), float("nan"), dtype=kept.logprobs.dtype, device=device)
        logprobs[offsets[plain_token] + plain_rank] = kept.logprobs
    return KeptSet(out, offsets, logprobs)


def kept_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    element_token: torch.Tensor,
    element_row: torch.Tensor,
    *,
    temperature: float,
    head_dtype: str,
) -> torch.Tensor:
    """(E,) fp32 ``(hidden[element_token] . weight[element_row]) / temperature``; element_row -1: -inf.

    hidden (N, d); weight (V_local, d); element_token (E,) int64; element_row (E,) int64 row in this shard or -1.
    """
    n_elements = element_token.shape[0]
    out = torch.full((n_elements,), float("-inf"), dtype=torch.float32, device=hidden.device)
    if n_elements == 0 or weight.shape[0] == 0:
        return out
    hidden_op, weight_op = head_operands(hidden, weight, head_dtype)
    inv_temperature = 1.0 / temperature
    for start in range(0, n_elements, GATHER_CHUNK):
        stop = min(start + GATHER_CHUNK, n_elements)
        rows = element_row[start:stop]
        inside = rows >= 0
        h = hidden_op.index_select(0, element_token[start:stop]).float()  # (C, d)
        w = weight_op.index_select(0, rows.clamp(min=0)).float()  # (C, d)
        z = (h * w).sum(dim=1) * inv_temperature  # (C,) fp32 products and sums
        out[start:stop] = torch.where(inside, z, float("-inf"))
    return out


def segment_partials(
    z: torch.Tensor, element_token: torch.Tensor, is_target: torch.Tensor, n_tokens: int
) -> torch.Tensor:
    """(1, 4, N) partials (max, sum exp, centred sum, target logit) of the kept logits `z` (E,) per token.

    element_token (E,) int64 owner of each element; is_target (E,) bool the element is the token's target.
    Elements with z = -inf (outside this shard) count as absent; a token without one is an empty piece."""
    partials = empty_partials(n_tokens, z.device)
    if z.numel() == 0:
        return partials
    row_max = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=z.device)
    row_max = row_max.scatter_reduce(0, element_token, z, reduce="amax", include_self=True)  # (N,)
    present = torch.isfinite(z)
    centred = torch.where(present, z - row_max[element_token], 0.0)  # (E,)
    weights = torch.where(present, torch.exp(centred), 0.0)  # (E,)
    sumexp = torch.zeros(n_tokens, dtype=torch.float32, device=z.device).index_add_(0, element_token, weights)
    centred_sum = torch.zeros(n_tokens, dtype=torch.float32, device=z.device).index_add_(
        0, element_token, weights * centred
    )
    target = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=z.device)
    target = target.scatter_reduce(
        0, element_token, torch.where(is_target & present, z, float("-inf")), reduce="amax", include_self=True
    )
    nonempty = sumexp > 0
    partials[0, 0] = torch.where(nonempty, row_max, float("-inf"))
    partials[0, 1] = sumexp
    partials[0, 2] = centred_sum
    partials[0, 3] = target
    return partials


def kept_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    kept: KeptSet,
    *,
    vocab_start: int,
    temperature: float,
    head_dtype: str,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(1, PARTIAL_ROWS, N) partials of the kept logits of this vocab shard (rows ``[vocab_start, vocab_start +
    V_local)``) and, when the kept set carries the engine's log-probs, (N,) fp64 Σ p_e z over this shard's ids
    (for kept_kl); `impl` "torch" or "triton" computes the gather-dot. targets (N,) global target ids."""
    element_token = kept.element_token()  # (E,)
    local = kept.ids - vocab_start
    element_row = torch.where((local >= 0) & (local < weight.shape[0]), local, -1)  # (E,)
    if impl == "triton":
        from pgdiag.kernels.kept_set_triton import kept_logits_triton

        z = kept_logits_triton(
            hidden, weight, element_token, element_row, temperature=temperature, head_dtype=head_dtype
        )
    else:
        z = kept_logits(
            hidden, weight, element_token, element_row, temperature=temperature, head_dtype=head_dtype
        )
    is_target = kept.ids == targets.long()[element_token]
    out = segment_partials(z, element_token, is_target, kept.n_tokens)
    assert out.shape[1] == PARTIAL_ROWS
    if kept.logprobs is None:
        return out, None
    p, _ = kept.engine_terms()
    weighted = torch.where(torch.isfinite(z), p * z.double(), 0.0)  # (E,) ids of other shards count 0 here
    pz = torch.zeros(kept.n_tokens, dtype=torch.float64, device=z.device).index_add_(
        0, element_token, weighted
    )
    return out, pz


@dataclass(frozen=True)
class KeptScores:
    """Per-token results over K (fp32, (N,) each); where K is empty they equal the full-vocabulary ones."""

    logprobs: torch.Tensor  # renormalised over K
    entropy: torch.Tensor  # of the renormalised distribution
    kept_mass: torch.Tensor  # sum of the full softmax over K (1 where K is empty)
    logprobs_full: torch.Tensor
    entropy_full: torch.Tensor
    target_in_set: torch.Tensor  # (N,) bool: K empty, or the target is in K
    kept_lse: torch.Tensor  # (N,) logsumexp of z over K (0 where K is empty)
    has_set: torch.Tensor  # (N,) bool: K recorded there


def finish_kept(
    full: torch.Tensor,
    kept: torch.Tensor,
    nonempty: torch.Tensor,
    full_logprobs: torch.Tensor,
    full_entropy: torch.Tensor,
) -> KeptScores:
    """`KeptScores` from the merged (4, N) full and kept partials; `nonempty` (N,) bool tokens with a set."""
    full_max, full_sum = full[0], full[1]
    kept_max, kept_sum, kept_centred, kept_target = kept.unbind(0)
    has = nonempty & (kept_sum > 0)
    safe_sum = torch.where(has, kept_sum, 1.0)
    kept_lse = torch.where(has, kept_max + torch.log(safe_sum), 0.0)  # (N,)
    full_lse = full_max + torch.log(full_sum)  # (N,)
    target_in = torch.isfinite(kept_target)
    logprobs = torch.where(has & target_in, kept_target - kept_lse, full_logprobs)
    logprobs = torch.where(has & ~target_in, float("-inf"), logprobs)
    entropy = torch.where(has, torch.log(safe_sum) - kept_centred / safe_sum, full_entropy)
    kept_mass = torch.where(has, torch.exp(kept_lse - full_lse).clamp(max=1.0), 1.0)
    return KeptScores(
        logprobs, entropy, kept_mass, full_logprobs, full_entropy, ~has | target_in, kept_lse, has
    )


def kept_kl(scores: KeptScores, plogp: torch.Tensor, pz: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 KL(engine ‖ trainer) over K, both renormalised over K: Σ p_e (log p_e − (z − lse_K)) =
    Σ p_e log p_e − Σ p_e z + lse_K; NaN where no set is recorded."""
    value = plogp - pz + scores.kept_lse.double()
    return torch.where(scores.has_set, value, float("nan")).float()


__all__ = [
    "KeptScores",
    "KeptSet",
    "expand_bitmasks",
    "finish_kept",
    "kept_kl",
    "kept_logits",
    "kept_partials",
    "segment_partials",
    "with_bitmasks",
]
