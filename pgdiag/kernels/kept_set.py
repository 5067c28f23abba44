"""LM-head scoring over a kept set K: the kept set as per-row packed bitmasks, read by the head kernel itself.

What: an inference engine samples token y from the distribution renormalised over its kept set K (the tokens
that survived min-p / top-k / top-p after temperature T). With z = logits / T, per token:

    logprobs      = z_y - logsumexp_{j in K} z_j                   (the renormalised log-prob)
    entropy       = entropy of softmax(z) restricted to K and renormalised
    kept_mass     = sum_{j in K} softmax(z)_j = exp(lse_K - lse)    (the kept mass under the model)
    logprobs_full = z_y - logsumexp_j z_j                          (the full-vocabulary log-prob)

so ``logprobs - logprobs_full = -log kept_mass`` (>= 0). A token with no recorded K scores the full vocabulary:
its kept mass is 1.

How: K arrives as a `KeptSet`: CSR ids (E,) and offsets (N + 1,), and optionally some tokens' sets as packed
little-endian bitmasks over the global vocabulary (vLLM sends a bitmask beyond 2,048 ids). `kept_words` turns a
chunk of C tokens into (C, ceil(V_local / 32)) int32 words over this vocab shard (bit j of word w: local row
32 w + j), on the device: CSR ids by an atomic OR (Triton, `kept_set_triton`) or its plain-torch twin, bitmask
rows by a funnel shift of their words to the shard's first row. The head (`lm_head_partials` of the torch
reference or the Triton kernels) reads these words inside its vocabulary-tile loop and writes, in the same
pass, the partials of the full vocabulary and of K (`vocab_parallel`: max, sum of exponentials, centred sum;
8 rows a token). The Triton kernels centre K's sums on the full maximum (they reuse its exponentials); a row
whose K underflows there (all kept logits > ~87 nats below it) is rescored by the reference, and a one-token K
gives log-prob and entropy exactly 0.0 (`finish_kept`). Chunks keep the words within `KEPT_WORDS_BUDGET_BYTES` (at V = 151936 a row is 18,992 bytes).
The kept target logit is the head's own where the target's bit is set.
Under TP each rank's words cover its shard and `lm_head_logprobs` gathers the full and the kept partials in one
collective.

The engine's own log-probs of K (`KeptSet.logprobs`, for `kept_kl`) need Σ p_e z_e over K, a weighted sum the
bitmask cannot carry: that term alone is a gather-dot (`kept_logits`, plain torch, or the Triton kernel of
`kept_set_triton`), run only when the engine log-probs are present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pgdiag.kernels.lm_head_logprobs_ref import head_operands
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, merge_partials

GATHER_CHUNK = 1 << 16  # kept elements per torch gather-dot chunk: 65536 x d x 4 B x 2 operands
KEPT_WORDS_BUDGET_BYTES = 512 << 20  # the (C, W) int32 words of one chunk: 28,268 tokens at V = 151936
CHUNK_ALIGN = 256  # chunks of whole token blocks of the head kernels
WORD_BITS = 32
BITMASK_ROWS = 2048  # bitmask rows shifted into words at once: ~0.4 GB of temporaries at V = 151936


@dataclass(frozen=True)
class KeptSet:
    """Kept sets of N tokens: token n's set is ``ids[offsets[n]:offsets[n + 1]]`` (global ids, CSR), or, for the
    tokens `bitmask_tokens`, the packed little-endian bitmask of the same row of `bitmasks` (bit j of byte b:
    id 8 b + j; their CSR range is empty). An empty set means "not recorded" (score the full vocabulary)."""

    ids: torch.Tensor  # (E,) int64 global token ids
    offsets: torch.Tensor  # (N + 1,) int64, offsets[0] == 0, offsets[-1] == E
    logprobs: torch.Tensor | None = None  # (E,) the engine's own log-probs of the kept ids (for kept_kl)
    bitmask_tokens: torch.Tensor | None = None  # (Q_b,) int64 ascending tokens whose set is a bitmask
    bitmasks: torch.Tensor | None = None  # (Q_b, B) uint8 their packed bitmasks over the global vocabulary

    @property
    def n_tokens(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def sizes(self) -> torch.Tensor:
        """(N,) int64 size of each token's set."""
        return self.offsets[1:] - self.offsets[:-1]

    def element_token(self) -> torch.Tensor:
        """(E,) int64 token owning each kept element."""
        return torch.repeat_interleave(torch.arange(self.n_tokens, device=self.ids.device), self.sizes())

    def recorded(self) -> torch.Tensor:
        """(N,) bool: the token has a set (CSR ids, or a bitmask with a bit set)."""
        return self.set_sizes() > 0

    def set_sizes(self) -> torch.Tensor:
        """(N,) int64 size of each token's set, ids or bitmask (bits counted byte by byte, in uint8)."""
        out = self.sizes().clone()
        if self.bitmask_tokens is not None and self.bitmasks is not None:
            for first in range(0, self.bitmasks.shape[0], BITMASK_ROWS):
                bits = self.bitmasks[first : first + BITMASK_ROWS]
                x = bits - ((bits >> 1) & 0x55)  # (rows, B) uint8: 2-bit counts
                x = (x & 0x33) + ((x >> 2) & 0x33)  # 4-bit counts
                out[self.bitmask_tokens[first : first + BITMASK_ROWS]] += ((x + (x >> 4)) & 0x0F).sum(dim=1)
        return out

    def to(self, device: torch.device) -> KeptSet:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return KeptSet(
            self.ids.to(device),
            self.offsets.to(device),
            move(self.logprobs),
            move(self.bitmask_tokens),
            move(self.bitmasks),
        )

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


def kept_chunk(n_tokens: int, vocab_local: int) -> int:
    """Tokens per chunk so that a chunk's (C, W) int32 words stay within `KEPT_WORDS_BUDGET_BYTES`, in equal
    chunks of whole `CHUNK_ALIGN` blocks. Example: V_local = 151936 (18,992 bytes a row): 65536 tokens -> 3
    chunks of 22,016 (418 MB of words); 16384 tokens -> one chunk."""
    row_bytes = 4 * max(1, -(-vocab_local // WORD_BITS))
    most = max(CHUNK_ALIGN, KEPT_WORDS_BUDGET_BYTES // row_bytes // CHUNK_ALIGN * CHUNK_ALIGN)
    n_chunks = max(1, -(-n_tokens // most))
    per_chunk = -(-n_tokens // n_chunks)
    return max(1, -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN)


def to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the int32 words of the same bits (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def or_bits_torch(n_words: int, word_index: torch.Tensor, bit: torch.Tensor) -> torch.Tensor:
    """(n_words,) int32 with bit `bit[e]` of word `word_index[e]` set for every element e: the plain-torch OR
    (duplicates removed by `torch.unique`, then distinct bits summed, which is their OR). The reference of
    `kept_set_triton.csr_words_triton`, which packs the same words a row at a time."""
    flat = torch.unique(word_index * WORD_BITS + bit)
    sums = torch.zeros(n_words, dtype=torch.int64, device=word_index.device)
    sums.index_add_(0, flat // WORD_BITS, torch.bitwise_left_shift(torch.ones_like(flat), flat % WORD_BITS))
    return to_int32_words(sums)


def bitmask_words(bitmasks: torch.Tensor, vocab_start: int, vocab_local: int) -> torch.Tensor:
    """(Q, B) uint8 packed bitmasks over the global vocabulary -> (Q, W) int32 words over the shard
    [vocab_start, vocab_start + V_local) (bit j of word w: local row 32 w + j): the bytes read as little-endian
    32-bit words, shifted by vocab_start mod 32 across word boundaries (in int64) where the shard starts
    mid-word. Bits past the bitmask's end, or past the shard, are 0."""
    n_rows, width = bitmasks.shape
    n_words = -(-vocab_local // WORD_BITS)
    base, shift = divmod(vocab_start, WORD_BITS)
    needed = 4 * (base + n_words + 1)  # bytes up to the word after the shard's last one
    padded = torch.zeros(n_rows, max(needed, -(-width // 4) * 4), dtype=torch.uint8, device=bitmasks.device)
    padded[:, :width] = bitmasks
    if shift == 0:  # the shard starts at a word (TP = 1, or aligned shards): the bytes are the words
        aligned = padded.view(torch.int32)[:, base : base + n_words]
        if vocab_local % WORD_BITS:
            aligned[:, -1] &= (1 << (vocab_local % WORD_BITS)) - 1
        return aligned
    words = padded.view(torch.int32).long() & 0xFFFFFFFF  # (Q, >= base + W + 1) global words, unsigned
    low = words[:, base : base + n_words] >> shift
    high = (words[:, base + 1 : base + n_words + 1] << (WORD_BITS - shift)) & 0xFFFFFFFF
    local = low | high
    if vocab_local % WORD_BITS:  # the last word's bits past the shard (the next shard's ids) cleared
        local[:, -1] &= (1 << (vocab_local % WORD_BITS)) - 1
    return to_int32_words(local)


def chunk_bounds(kept: KeptSet, start: int, stop: int) -> tuple[int, int]:
    """The CSR element range [lo, hi) of tokens [start, stop), within [0, len(ids)] whatever the offsets hold
    (`lm_head_logprobs` checks them after the head pass). The ends of the whole set are known on the host; an
    inner boundary costs one host sync."""
    n_elements = int(kept.ids.shape[0])
    lo = 0 if start == 0 else int(kept.offsets[start])
    hi = n_elements if stop == kept.n_tokens else int(kept.offsets[stop])
    lo = min(max(lo, 0), n_elements)
    return lo, min(max(hi, lo), n_elements)


def csr_words_torch(
    kept: KeptSet, start: int, stop: int, *, vocab_start: int, vocab_local: int
) -> torch.Tensor:
    """(stop - start, W) int32 words of the CSR sets of tokens [start, stop): each element's token found by a
    search (offsets that do not rise cannot push it out of bounds), its bit OR-ed in by `or_bits_torch`."""
    n_rows = stop - start
    n_words = -(-vocab_local // WORD_BITS)
    lo, hi = chunk_bounds(kept, start, stop)
    local = kept.ids[lo:hi] - vocab_start  # (E_c,)
    ends = kept.offsets[start + 1 : stop + 1]  # (C,) each token's end in the CSR elements
    element = torch.arange(lo, hi, device=kept.ids.device, dtype=ends.dtype)  # (E_c,)
    row = torch.searchsorted(ends, element, right=True).clamp_(
        max=max(n_rows - 1, 0)
    )  # (E_c,) token in chunk
    inside = (local >= 0) & (local < vocab_local)
    spare = n_rows * n_words  # ids outside the shard set a bit of one spare word past the end, cut off below
    word_index = torch.where(inside, row * n_words + local // WORD_BITS, spare)
    bit = torch.where(inside, local % WORD_BITS, 0)
    return or_bits_torch(spare + 1, word_index, bit)[:spare].view(n_rows, n_words)


def kept_words(
    kept: KeptSet, start: int, stop: int, *, vocab_start: int, vocab_local: int, impl: str
) -> torch.Tensor:
    """(stop - start, W) int32 packed kept sets of tokens [start, stop) over this vocab shard, W =
    ceil(V_local / 32); ids outside the shard are left out, a token without a set is all zeros. `impl`
    "triton" packs the CSR ids with one Triton kernel (`kept_set_triton.csr_words_triton`), "torch" with the
    tensor ops below (its reference). Neither reads out of bounds when the offsets do not rise from 0 to len(ids)
    (`lm_head_logprobs` reports that after the head pass)."""
    if impl == "triton":
        from pgdiag.kernels.kept_set_triton import csr_words_triton

        words = csr_words_triton(
            kept.ids, kept.offsets, start, stop, vocab_start=vocab_start, vocab_local=vocab_local
        )
    else:
        words = csr_words_torch(kept, start, stop, vocab_start=vocab_start, vocab_local=vocab_local)
    if kept.bitmask_tokens is not None and kept.bitmasks is not None:
        chosen = ((kept.bitmask_tokens >= start) & (kept.bitmask_tokens < stop)).nonzero()[:, 0]
        for first in range(0, chosen.shape[0], BITMASK_ROWS):  # its int64 temporaries: 5 x 8 B a word a row
            some = chosen[first : first + BITMASK_ROWS]
            rows = kept.bitmask_tokens[some] - start
            words[rows] = words[rows] | bitmask_words(kept.bitmasks[some], vocab_start, vocab_local)
    return words


def target_in_words(words: torch.Tensor, local_targets: torch.Tensor) -> torch.Tensor:
    """(C,) bool: the target's bit is set in its row of `words` (C, W); local_targets (C,) row in this shard
    or -1 (False)."""
    if words.shape[1] == 0:  # an empty shard holds no target
        return torch.zeros(local_targets.shape[0], dtype=torch.bool, device=words.device)
    safe = local_targets.clamp(min=0).long()
    word = words.gather(1, (safe // WORD_BITS)[:, None])[:, 0]
    return (local_targets >= 0) & (((word >> (safe % WORD_BITS).to(word.dtype)) & 1) != 0)


def kept_head_partials(
    partials_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    local_targets: torch.Tensor,
    kept: KeptSet,
    *,
    vocab_start: int,
    vocab_local: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merged (4, N) full and (4, N) kept partials of this shard, one head pass a chunk of tokens, and the
    (N,) bool rows whose kept sums underflowed; no host sync.

    `partials_fn(hidden_chunk, local_targets_chunk, words)` is the head (`lm_head_partials` of the torch
    reference or Triton) returning (S, 8, C): rows 0-3 the full vocabulary, 4-7 K. The kept target logit is
    the head's target logit where its bit is set. The Triton heads sum K's exponentials centred on the full
    maximum: a row whose kept ids all lie more than ~87 nats below it underflows to a zero sum. Such a row is
    rare (the engine sampled from K); the caller reads the flags once, after every head pass is queued, and
    hands the rows to `rescore_underflow`."""
    n_tokens = hidden.shape[0]
    full_parts, kept_parts, underflow_parts = [], [], []
    chunk = kept_chunk(n_tokens, vocab_local)
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)
        words = kept_words(kept, start, stop, vocab_start=vocab_start, vocab_local=vocab_local, impl=impl)
        targets = local_targets[start:stop]
        partials = partials_fn(hidden[start:stop], targets, words)  # (S, 8, C)
        full = merge_partials(partials[:, :PARTIAL_ROWS])
        masked = merge_partials(partials[:, PARTIAL_ROWS:])
        underflow_parts.append(words.any(dim=1) & (masked[1] == 0))  # (C,) bits here, yet no mass
        masked[3] = torch.where(target_in_words(words, targets), full[3], float("-inf"))
        full_parts.append(full)
        kept_parts.append(masked)
    if not full_parts:
        empty = torch.zeros(PARTIAL_ROWS, 0, dtype=torch.float32, device=hidden.device)
        return empty, empty.clone(), torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(full_parts, dim=1), torch.cat(kept_parts, dim=1), torch.cat(underflow_parts)


def rescore_underflow(
    exact_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    local_targets: torch.Tensor,
    kept: KeptSet,
    kept_partials: torch.Tensor,
    underflow: torch.Tensor,
    *,
    vocab_start: int,
    vocab_local: int,
    impl: str,
) -> None:
    """Score the `underflow` (N,) rows' kept sets again with `exact_fn` (the torch reference: K's own maximum)
    and write their max, sum and centred sum into `kept_partials` (4, N) in place (the target logit, row 3,
    stays the head's). The words are rebuilt for the chunks that hold such rows."""
    chunk = kept_chunk(hidden.shape[0], vocab_local)
    rows = underflow.nonzero()[:, 0]  # (R,) ascending
    for start in range(0, hidden.shape[0], chunk):
        stop = min(start + chunk, hidden.shape[0])
        here = rows[(rows >= start) & (rows < stop)]
        if here.shape[0] == 0:
            continue
        words = kept_words(kept, start, stop, vocab_start=vocab_start, vocab_local=vocab_local, impl=impl)
        exact = exact_fn(hidden[here], local_targets[here], words[here - start])  # (1, 8, R_c)
        kept_partials[:3, here] = merge_partials(exact[:, PARTIAL_ROWS:])[:3]


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


def engine_dot(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    kept: KeptSet,
    *,
    vocab_start: int,
    temperature: float,
    head_dtype: str,
    impl: str,
) -> torch.Tensor:
    """(N,) fp64 ``Σ_e p_e z_e - z_y`` over the CSR ids of this vocab shard (the target's term where the target
    is among them), p_e the engine's probabilities renormalised over K (`KeptSet.engine_terms`); summed over
    the TP ranks it is Σ_{e in K} p_e (z_e - z_y), for `kept_kl`. The logits are the gather-dot's
    (`kept_logits`, or the Triton kernel with `impl` "triton"); a one-token set gives exactly 0."""
    element_token = kept.element_token()  # (E,)
    local = kept.ids - vocab_start
    element_row = torch.where((local >= 0) & (local < weight.shape[0]), local, -1)  # (E,)
    if impl == "triton":
        from pgdiag.kernels.kept_set_triton import kept_logits_triton as logits_fn
    else:
        logits_fn = kept_logits
    z = logits_fn(hidden, weight, element_token, element_row, temperature=temperature, head_dtype=head_dtype)
    here = torch.isfinite(z)  # ids of other shards count 0 here
    p, _ = kept.engine_terms()
    is_target = kept.ids == targets.long()[element_token]
    weighted = torch.where(here, p * z.double(), 0.0) - torch.where(here & is_target, z.double(), 0.0)
    return torch.zeros(kept.n_tokens, dtype=torch.float64, device=z.device).index_add_(
        0, element_token, weighted
    )


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
    single: torch.Tensor,
) -> KeptScores:
    """`KeptScores` from the merged (4, N) full and kept partials; `nonempty` (N,) bool tokens with a set,
    `single` (N,) bool tokens whose set holds one id: a point mass, log-prob and entropy exactly 0.0 (the head's
    sums, centred on the full maximum, give them within an ulp)."""
    full_max, full_sum = full[0], full[1]
    kept_max, kept_sum, kept_centred, kept_target = kept.unbind(0)
    has = nonempty & (kept_sum > 0)
    safe_sum = torch.where(has, kept_sum, 1.0)
    kept_lse = torch.where(has, kept_max + torch.log(safe_sum), 0.0)  # (N,)
    full_lse = full_max + torch.log(full_sum)  # (N,)
    target_in = torch.isfinite(kept_target)
    logprobs = torch.where(has & target_in, kept_target - kept_lse, full_logprobs)
    logprobs = torch.where(has & ~target_in, float("-inf"), logprobs)
    logprobs = torch.where(has & target_in & single, 0.0, logprobs)
    entropy = torch.where(has, torch.log(safe_sum) - kept_centred / safe_sum, full_entropy)
    entropy = torch.where(has & single, 0.0, entropy)
    kept_mass = torch.where(has, torch.exp(kept_lse - full_lse).clamp(max=1.0), 1.0)
    return KeptScores(
        logprobs, entropy, kept_mass, full_logprobs, full_entropy, ~has | target_in, kept_lse, has
    )


def kept_kl(scores: KeptScores, plogp: torch.Tensor, pz: torch.Tensor, has_ids: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 KL(engine ‖ trainer) over K, both renormalised over K: Σ p_e (log p_e − (z_e − lse_K)) =
    Σ p_e log p_e − Σ p_e (z_e − z_y) − (z_y − lse_K), with `pz` the middle sum (`engine_dot`) and the last
    term the renormalised log-prob (−lse_K where the target is not in K: an ignored token, whose `pz` holds no
    z_y); NaN where no set is recorded or it is a bitmask (`has_ids` (N,) False: no engine log-probs)."""
    target_in = scores.has_set & torch.isfinite(scores.logprobs)
    value = plogp - pz - torch.where(target_in, scores.logprobs.double(), -scores.kept_lse.double())
    return torch.where(scores.has_set & has_ids, value, float("nan")).float()


__all__ = [
    "KeptScores",
    "KeptSet",
    "bitmask_words",
    "csr_words_torch",
    "engine_dot",
    "finish_kept",
    "kept_head_partials",
    "kept_kl",
    "kept_logits",
    "kept_words",
    "or_bits_torch",
    "rescore_underflow",
    "target_in_words",
]
