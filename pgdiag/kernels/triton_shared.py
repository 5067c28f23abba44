"""Pieces shared by pgdiag's two Triton LM-head kernels (bf16 head, fp32 head): launch shape, program
numbering, tile loads, the online-softmax fold of a logits tile, and the store of the per-token partials.

Both kernels compute the same (S, 4, N) fp32 partials (max, sum of exponentials, centred weighted sum,
target logit per token and vocab split; see `vocab_parallel`); they differ only in how a (BLOCK_N, BLOCK_V)
tile of raw logits ``H[block] @ W[tile].T`` is accumulated over the hidden dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# a padded column's logit: exp() underflows to 0 and 0 * (z - m) stays 0 (no inf * 0)
MASKED_LOGIT = tl.constexpr(-1.0e30)
MAX_SPLITS = 64
ALIGNED_SLACK = 1.05  # see choose_plan
# at most this many token blocks in flight at once (groups of n_slots // n_splits blocks): each re-reads its H panel
# for every vocab tile, and more panels than this thrash L2 (fp32 head at TP = 2, 16k x 8192: 2 splits in groups
# of 66 blocks ran 0.57x the TP = 1 time instead of ~0.5x)
MAX_GROUP_BLOCKS = 12


@dataclass(frozen=True)
class TritonTiles:
    """Launch shape of a partials kernel. `n_splits` 0: chosen by `choose_plan`.

    `aligned_group_blocks` > 0 lets `choose_plan` prefer the L2-aligned plan (groups of that many token blocks
    spanning exactly two waves of the GPU, or one); 0: the wave-filling plan only.
    fp32 head only (see `fp32_head_triton`): `fresh_steps` K steps are summed by the tensor cores into one
    fresh accumulator, and `fresh_per_group` such sums into a group sum before it joins the tile's sum.
    """

    block_n: int = 256
    block_v: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1
    n_splits: int = 0
    aligned_group_blocks: int = 0
    use_tma: bool = True  # load tiles through host-side TMA descriptors where the strides allow it
    fresh_steps: int = 1
    fresh_per_group: int = 8
    gluon: bool = True  # fp32 head on sm_90: the Gluon kernel (fp32_head_gluon) where it applies, with
    gluon_fresh_steps: int = 1  # its own chains (K steps of all pieces per fresh accumulator),
    gluon_fresh_per_group: int = 8  # and chains per group sum


@dataclass(frozen=True)
class SplitPlan:
    """How the vocab tiles of a shard are dealt to programs: `n_splits` splits of `tiles_per_split` tiles;
    `group_blocks` token blocks share their W panels in L2 (see `program_tile`)."""

    n_splits: int
    tiles_per_split: int
    group_blocks: int


def plan_cost(n_token_blocks: int, n_vocab_tiles: int, n_slots: int, wanted_splits: int) -> tuple[float, int]:
    """(cost, n_splits) of dealing the vocab tiles into about `wanted_splits` splits.

    Cost model: a wave of `n_slots` concurrent programs costs as long as one program, ``tiles_per_split + 0.25``
    tile times (the 0.25 covers a program's start and its partials store); cost = waves x that. The split count
    is adjusted so that every split holds at least one vocab tile.
    """
    tiles_per_split = triton.cdiv(n_vocab_tiles, wanted_splits)
    n_splits = triton.cdiv(n_vocab_tiles, tiles_per_split)
    waves = triton.cdiv(n_token_blocks * n_splits, n_slots)
    return waves * (tiles_per_split + 0.25), n_splits


def choose_n_splits(n_token_blocks: int, n_vocab_tiles: int, n_slots: int) -> int:
    """Vocab splits that make the programs fill whole waves of `n_slots` concurrent programs (`plan_cost`),
    with at least ``n_slots / MAX_GROUP_BLOCKS`` splits where the shard has that many tiles.

    Ties go to fewer splits. Example: 128 token blocks x 594 vocab tiles on 132 SMs: 1 split -> 1 wave of
    594.25; 33 splits of 18 tiles -> 32 waves of 18.25 = 584 (the floor is 128 x 594 / 132 = 576).
    """
    fewest = min(n_vocab_tiles, triton.cdiv(n_slots, MAX_GROUP_BLOCKS))
    best_splits, best_cost = fewest, float("inf")
    for wanted in range(fewest, min(n_vocab_tiles, MAX_SPLITS) + 1):
        cost, n_splits = plan_cost(n_token_blocks, n_vocab_tiles, n_slots, wanted)
        if cost < best_cost - 1e-9:
            best_splits, best_cost = n_splits, cost
    return best_splits


def choose_plan(
    n_token_blocks: int, n_vocab_tiles: int, n_slots: int, aligned_group_blocks: int = 0
) -> SplitPlan:
    """The split plan for `n_token_blocks` x `n_vocab_tiles` tiles on `n_slots` concurrent programs.

    Two candidates:
    * wave-filling: `choose_n_splits`, groups of ``n_slots // n_splits`` token blocks;
    * L2-aligned (when `aligned_group_blocks` G > 0): groups of G token blocks and ``2 * (n_slots // G)`` splits
      (a group spans exactly two waves), or ``n_slots // G`` splits (one wave) where the tiles do not deal into
      the first count exactly; either way each wave covers G token blocks x ``n_slots // G`` splits and no wave
      straddles two groups. On an H100 this ran 6-20 % faster at T >= 16k tokens (docs/benchmarks.md): the
      programs that share an H panel or a W tile in L2 then run at the same time, as neighbours.
    The aligned plan is taken unless its wave quantization costs more than `ALIGNED_SLACK` over the
    wave-filling one (small batches: T <= 4096 tokens at 132 SMs).
    Example: 512 token blocks x 501 vocab tiles, 132 slots, G = 12: aligned 22 splits of 23 tiles, 86 waves,
    cost 1999.5 against 1977.5 for 18 wave-filling splits (1.1 % more): aligned. 16 blocks x 594 tiles: 81.75
    against 73.0 for 33 splits (12 % more): wave-filling.
    """
    fill_splits = choose_n_splits(n_token_blocks, n_vocab_tiles, n_slots)
    fill_cost, _ = plan_cost(n_token_blocks, n_vocab_tiles, n_slots, fill_splits)
    if aligned_group_blocks > 0:
        per_wave = max(1, n_slots // aligned_group_blocks)
        for wanted in (2 * per_wave, per_wave):
            aligned_cost, aligned_splits = plan_cost(n_token_blocks, n_vocab_tiles, n_slots, wanted)
            if aligned_splits == wanted:
                if aligned_cost <= ALIGNED_SLACK * fill_cost:
                    return _split_plan(n_vocab_tiles, wanted, aligned_group_blocks)
                break
    return _split_plan(n_vocab_tiles, fill_splits, max(1, n_slots // fill_splits))


def _split_plan(n_vocab_tiles: int, n_splits: int, group_blocks: int) -> SplitPlan:
    """The plan of `n_splits` (already dealt by `plan_cost`, every split holding a tile) in groups of
    `group_blocks` token blocks."""
    return SplitPlan(n_splits, triton.cdiv(n_vocab_tiles, n_splits), group_blocks)


def plan_splits(n_tokens: int, vocab_local: int, tiles: TritonTiles, device: torch.device) -> SplitPlan:
    """The split plan for `n_tokens` tokens over a shard of `vocab_local` rows on `device` (`choose_plan`;
    `tiles.n_splits` > 0 forces the split count)."""
    n_token_blocks = triton.cdiv(n_tokens, tiles.block_n)
    n_vocab_tiles = triton.cdiv(vocab_local, tiles.block_v)
    n_slots = sm_count(device) * tiles.programs_per_sm
    if tiles.n_splits <= 0:
        return choose_plan(n_token_blocks, n_vocab_tiles, n_slots, tiles.aligned_group_blocks)
    _, n_splits = plan_cost(n_token_blocks, n_vocab_tiles, n_slots, min(tiles.n_splits, n_vocab_tiles))
    return _split_plan(n_vocab_tiles, n_splits, max(1, n_slots // n_splits))


def tma_ready(tensor: torch.Tensor) -> bool:
    """True when `tensor` (2-D, rows contiguous) meets TMA's rules: on a GPU, 16-byte aligned base and rows."""
    return (
        tensor.is_cuda
        and tensor.data_ptr() % 16 == 0
        and (tensor.stride(0) * tensor.element_size()) % 16 == 0
        and torch.cuda.get_device_capability(tensor.device)[0] >= 9
    )


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (1 on the CPU, where only the Triton interpreter runs these kernels)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def program_tile(n_tokens, n_splits, group_blocks, BLOCK_N: tl.constexpr):
    """(token_block, split) of this program. Programs are numbered in groups of `group_blocks` token blocks x
    all splits, so that the ~#SM programs running at once share a few H panels and all W panels in L2."""
    pid = tl.program_id(0)
    n_token_blocks = tl.cdiv(n_tokens, BLOCK_N)
    programs_per_group = group_blocks * n_splits
    first_block = (pid // programs_per_group) * group_blocks
    blocks_here = tl.minimum(n_token_blocks - first_block, group_blocks)
    in_group = pid % programs_per_group
    return first_block + in_group % blocks_here, in_group // blocks_here


@triton.jit
def load_tiles(
    hidden,
    weight,
    h_row,
    safe_rows,
    v_start,
    safe_v,
    k_start,
    offs_k,
    hidden_size,
    stride_hidden,
    stride_weight,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The (BLOCK_N, BLOCK_K) hidden tile at row `h_row` (TMA) or rows `safe_rows` (pointers) and the
    (BLOCK_K, BLOCK_V) W^T tile of vocab rows from `v_start` (TMA) or `safe_v` (pointers), at column `k_start`."""
    if USE_TMA:  # out-of-bounds rows/columns arrive as zeros
        h = hidden.load([h_row, k_start])
        w = weight.load([v_start, k_start]).T
    else:
        h_ptrs = hidden + safe_rows[:, None] * stride_hidden + (k_start + offs_k)[None, :]
        w_ptrs = weight + safe_v[None, :] * stride_weight + (k_start + offs_k)[:, None]
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k_start + offs_k) < hidden_size
            h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
    return h, w


@triton.jit
def fold_tile(
    acc,
    run_max,
    run_sumexp,
    run_centred,
    target_raw,
    tile_targets,
    v_start,
    vocab_local,
    exp2_scale,
    kept,
    kept_sumexp,
    kept_centred,
    BLOCK_V: tl.constexpr,
    MASK_COLS: tl.constexpr,
    KEPT: tl.constexpr,
):
    """Fold one (BLOCK_N, BLOCK_V) tile of raw accumulators into the running statistics.

    Everything is kept in raw accumulator units (z = acc / temperature, temperature > 0, so the max commutes);
    exp2_scale = log2(e) / temperature turns ``acc - max`` into the exponent. Per element: one max, one
    subtract, one multiply + ex2, one add and one FMA. The target is picked only in tiles that hold one.

    KEPT: `kept` (BLOCK_N, BLOCK_V) bool marks the tile's columns in each row's kept set K, and the same
    exponentials, masked, also feed K's sums: Σ_K exp(z - m) and Σ_K exp(z - m) (z - m), centred on the full
    running max m (one select and two adds more per element, no second max or exponential, no tile-sized
    value live across a reduction: the bf16 head's 256 x 128 accumulator leaves no registers for one).
    """
    cols = tl.arange(0, BLOCK_V)
    if MASK_COLS:  # only the last tile of the shard has padded columns
        acc = tl.where((v_start + cols)[None, :] < vocab_local, acc, MASKED_LOGIT)
    new_max = tl.maximum(run_max, tl.max(acc, axis=1))
    centred = acc - new_max[:, None]  # (BLOCK_N, BLOCK_V), <= 0
    p = tl.math.exp2(centred * exp2_scale)
    rescale = tl.math.exp2((run_max - new_max) * exp2_scale)
    if KEPT:
        kept_p = tl.where(kept, p, 0.0)
        kept_centred = rescale * (kept_centred + (run_max - new_max) * kept_sumexp) + tl.sum(
            kept_p * centred, axis=1
        )
        kept_sumexp = rescale * kept_sumexp + tl.sum(kept_p, axis=1)
    run_centred = rescale * (run_centred + (run_max - new_max) * run_sumexp) + tl.sum(p * centred, axis=1)
    run_sumexp = rescale * run_sumexp + tl.sum(p, axis=1)
    in_tile = tile_targets - v_start  # (BLOCK_N,) int32, the target's column in this tile
    if tl.max(((in_tile >= 0) & (in_tile < BLOCK_V)).to(tl.int32), axis=0) > 0:
        picked = tl.max(tl.where(cols[None, :] == in_tile[:, None], acc, float("-inf")), axis=1)
        target_raw = tl.maximum(target_raw, picked)
    return new_max, run_sumexp, run_centred, target_raw, kept_sumexp, kept_centred


@triton.jit
def fold_any_tile(
    acc,
    run_max,
    run_sumexp,
    run_centred,
    target_raw,
    tile_targets,
    v_start,
    vocab_local,
    exp2_scale,
    kept,
    kept_sumexp,
    kept_centred,
    BLOCK_V: tl.constexpr,
    KEPT: tl.constexpr,
):
    """`fold_tile`, masking the padded columns only in the shard's last (ragged) tile."""
    if v_start + BLOCK_V > vocab_local:
        out = fold_tile(
            acc,
            run_max,
            run_sumexp,
            run_centred,
            target_raw,
            tile_targets,
            v_start,
            vocab_local,
            exp2_scale,
            kept,
            kept_sumexp,
            kept_centred,
            BLOCK_V,
            True,
            KEPT,
        )
    else:
        out = fold_tile(
            acc,
            run_max,
            run_sumexp,
            run_centred,
            target_raw,
            tile_targets,
            v_start,
            vocab_local,
            exp2_scale,
            kept,
            kept_sumexp,
            kept_centred,
            BLOCK_V,
            False,
            KEPT,
        )
    return out


@triton.jit
def store_partials(
    partials_ptr,
    split,
    offs_n,
    row_ok,
    stride_split,
    stride_stat,
    run_max,
    run_sumexp,
    run_centred,
    target_raw,
    inv_temperature,
):
    """Store this split's partials, converted from accumulator units to z = acc / temperature."""
    out = partials_ptr + split * stride_split + offs_n
    tl.store(out, run_max * inv_temperature, mask=row_ok)
    tl.store(out + stride_stat, run_sumexp, mask=row_ok)
    tl.store(out + 2 * stride_stat, run_centred * inv_temperature, mask=row_ok)
    tl.store(out + 3 * stride_stat, target_raw * inv_temperature, mask=row_ok)


@triton.jit
def load_kept_bits(kept_ptr, safe_n, stride_kept, v_start, vocab_local, BLOCK_V: tl.constexpr):
    """(BLOCK_N, BLOCK_V) bool: column v_start + c of the tile is in the row's kept set. The kept set arrives as
    packed int32 words (bit j of word w: local row 32 w + j). The tile's ceil(BLOCK_V / 32) words of each row
    are loaded as 1-D vectors and broadcast along the columns, so that no 2-D load exists: the bits are built
    in the accumulator's own layout (a 2-D load would make the compiler move the (BLOCK_N, BLOCK_V) logits
    through shared memory). Padded columns (>= vocab_local) read 0."""
    cols = tl.arange(0, BLOCK_V)
    first_word = v_start // 32
    col_word = ((v_start % 32) + cols) // 32  # (BLOCK_V,) the column's word, relative to first_word
    row_ptr = kept_ptr + safe_n.to(tl.int64) * stride_kept + first_word  # (BLOCK_N,)
    n_words = tl.cdiv(vocab_local, 32)
    word = tl.zeros([1, BLOCK_V], tl.int32) + (safe_n * 0)[:, None]  # (BLOCK_N, BLOCK_V)
    for j in tl.static_range((BLOCK_V + 31) // 32):
        one = tl.load(row_ptr + j, mask=(safe_n * 0 + first_word + j) < n_words, other=0)  # (BLOCK_N,) int32
        word = tl.where(col_word[None, :] == j, one[:, None], word)
    inside = (v_start + cols) < vocab_local
    return (((word >> ((v_start + cols) % 32)[None, :]) & 1) != 0) & inside[None, :]


@triton.jit
def store_kept_partials(
    partials_ptr,
    split,
    offs_n,
    row_ok,
    stride_split,
    stride_stat,
    run_max,
    kept_sumexp,
    kept_centred,
    inv_temperature,
):
    """Store this split's kept-set partials in stat rows 4-7: K's sums are centred on the full max `run_max` (-inf
    where the split holds no kept column, or K's exponentials underflowed there: `kept_set.kept_head_partials`
    then scores the row with the reference); the target row -inf (the caller takes the head's target logit where
    the target's bit is set)."""
    out = partials_ptr + split * stride_split + 4 * stride_stat + offs_n
    found = kept_sumexp > 0
    tl.store(out, tl.where(found, run_max * inv_temperature, float("-inf")), mask=row_ok)
    tl.store(out + stride_stat, kept_sumexp, mask=row_ok)
    tl.store(out + 2 * stride_stat, kept_centred * inv_temperature, mask=row_ok)
    tl.store(out + 3 * stride_stat, tl.full(run_max.shape, float("-inf"), tl.float32), mask=row_ok)
