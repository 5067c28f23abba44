"""Fused Triton LM-head partials: logits tiles live in registers only, never in memory.

What: the same (S, 4, N) fp32 softmax partials as `lm_head_logprobs_ref.lm_head_partials` (max, sum of
exponentials, centred weighted sum, target logit per token and vocab split; see `vocab_parallel`), computed
by one forward-only kernel. The caller merges the S splits (and the TP ranks) with
`vocab_parallel.merge_partials`.

How: the grid has one program per (token block, vocab split). A program keeps a (BLOCK_N, BLOCK_V) fp32
accumulator, runs the K loop of ``H[block] @ W[tile].T`` with `tl.dot` for each vocab tile of its split (tiles
arrive through host-side TMA descriptors on Hopper, through pointer loads elsewhere), masks the padded columns
of the shard's last tile, and folds the tile into running per-token statistics (online softmax in raw
accumulator units with exp2, the entropy sum kept centred on the running max). Temperature acts on the fp32
accumulator (pre-scaling bf16 H or W would add ~0.03 nats at |z| ~ 30). Programs are numbered so that the
~#SM programs running at once cover a few token blocks times all splits, which keeps the W and H panels they
share in L2. The split count is chosen to fill whole waves of the GPU (`choose_n_splits`).

Head precision (`head_mode`):
  "bf16"   plain 16-bit dot (bf16 or fp16 operands), fp32 accumulation chained over K as cuBLAS does.
  "bf16x3" fp32 hidden with a bf16 W (the usual "fp32 head": engines upcast the stored bf16 W): each hidden
           tile is split into three bf16 parts h = hi + mid + lo (residual 2^-24 |h|) and three MMAs are
           issued per W tile; products of bf16 numbers are exact in fp32. ("fp16x3" is the same with fp16.)
           A 16-bit hidden state (a bf16 trunk) takes the same path: its lower parts are zero. A one-MMA path
           for it measured exactly the bf16 head's error on an H200 (max 7e-5 nats, the accumulator's
           truncation), so it was removed: the fp32 head's accuracy comes from the per-step accumulators.
  "tf32x3" fp32 hidden and fp32 W: Triton's 3-pass tf32 dot.
  The tensor cores add into their accumulator with truncation; over a K = 4096 chain that biases logits by
  ~5e-6 relative (cuBLAS bf16 GEMMs too). The split modes therefore sum every K step into a fresh accumulator
  and add it to the running one with a rounded fp32 add (accuracy and cost in docs/kernels.md).

Memory math (why nothing of size N x V exists): the only outputs are the partials, 16 bytes per token and
split: T = 65536 tokens x S = 17 splits -> 17.8 MB, against 65536 x 151936 x 4 B = 39.8 GB for one fp32 logits
tensor. Inputs are read in tiles; per program the registers hold the (BLOCK_N, BLOCK_V) accumulator (256 x 128
fp32 = 128 KB over 256 threads) and shared memory holds `num_stages` (BLOCK_N + BLOCK_V) x BLOCK_K input tiles
(3 x 384 x 64 x 2 B = 144 KB). Peak extra memory measured at T = 65536: 0.02 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pgdiag.errors import UsageError
from pgdiag.kernels.lm_head_logprobs_ref import head_operands
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, empty_partials

HEAD_MODE_CODES = {"bf16": 0, "bf16x3": 1, "fp16x3": 1, "tf32x3": 2}
# a padded column's logit: exp() underflows to 0 and 0 * (z - m) stays 0 (no inf * 0)
MASKED_LOGIT = tl.constexpr(-1.0e30)
MAX_SPLITS = 64


@dataclass(frozen=True)
class TritonTiles:
    """Launch shape of the partials kernel (defaults: the bf16 one). `n_splits` 0: see `choose_n_splits`."""

    block_n: int = 256
    block_v: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1
    n_splits: int = 0
    use_tma: bool = True  # load tiles through host-side TMA descriptors where the strides allow it
    # 0: chain the accumulator over all of K; else sum every k_chunk columns afresh (a multiple of block_k)
    k_chunk: int = 0


def head_mode_for(head_dtype: str, weight_dtype: torch.dtype, hidden_dtype: torch.dtype) -> str:
    """The head arithmetic that runs for `head_dtype` with these operand dtypes (see the module docstring)."""
    if head_dtype == "bf16":
        return "bf16"
    if weight_dtype not in (torch.bfloat16, torch.float16):
        return "tf32x3"
    return "bf16x3" if weight_dtype == torch.bfloat16 else "fp16x3"


def default_tiles(head_mode: str) -> TritonTiles:
    """Launch shape per head mode, from the H100 sweep recorded in docs/benchmarks.md.

    bf16: 256 x 128 tiles, K step 64, TMA loads: 30.4 ms at 16384 x 4096 x 151936, against 31.6 ms for 128 x 256
    tiles and 34.6 ms for 128 x 256 with pointer loads (cuBLAS alone: 28.3 ms).
    Split modes: 128 x 256 tiles, K step 32 (fp32 hidden tiles are twice as wide in bytes, and each K step is
    summed into a fresh accumulator, see the kernel), four stages.
    """
    if head_mode == "bf16":
        return TritonTiles()
    return TritonTiles(block_n=128, block_v=256, block_k=32, num_stages=4, k_chunk=32)


def choose_n_splits(n_token_blocks: int, n_vocab_tiles: int, n_slots: int) -> int:
    """Vocab splits that make the programs fill whole waves of `n_slots` concurrent programs.

    Cost model: a wave costs as long as one program, ``tiles_per_split + 0.25`` tile times (the 0.25 covers a
    program's start and its partials store); total = waves x that. Ties go to fewer splits.
    Example: 128 token blocks x 594 vocab tiles on 132 SMs: 1 split -> 1 wave of 594.25; 33 splits of 18
    tiles -> 32 waves of 18.25 = 584 (the floor is 128 x 594 / 132 = 576).
    """
    best_splits, best_cost = 1, float("inf")
    for wanted in range(1, min(n_vocab_tiles, MAX_SPLITS) + 1):
        tiles_per_split = triton.cdiv(n_vocab_tiles, wanted)
        n_splits = triton.cdiv(n_vocab_tiles, tiles_per_split)
        waves = triton.cdiv(n_token_blocks * n_splits, n_slots)
        cost = waves * (tiles_per_split + 0.25)
        if cost < best_cost - 1e-9:
            best_splits, best_cost = n_splits, cost
    return best_splits


@triton.jit
def _fold_tile(
    acc,
    run_max,
    run_sumexp,
    run_centred,
    target_raw,
    tile_targets,
    v_start,
    vocab_local,
    exp2_scale,
    BLOCK_V: tl.constexpr,
    MASK_COLS: tl.constexpr,
):
    """Fold one (BLOCK_N, BLOCK_V) tile of raw accumulators into the running statistics.

    Everything is kept in raw accumulator units (z = acc / temperature, temperature > 0, so the max commutes);
    exp2_scale = log2(e) / temperature turns ``acc - max`` into the exponent. Per element: one max, one
    subtract, one multiply + ex2, one add and one FMA. The target is picked only in tiles that hold one.
    """
    cols = tl.arange(0, BLOCK_V)
    if MASK_COLS:  # only the last tile of the shard has padded columns
        acc = tl.where((v_start + cols)[None, :] < vocab_local, acc, MASKED_LOGIT)
    new_max = tl.maximum(run_max, tl.max(acc, axis=1))
    centred = acc - new_max[:, None]  # (BLOCK_N, BLOCK_V), <= 0
    p = tl.math.exp2(centred * exp2_scale)
    rescale = tl.math.exp2((run_max - new_max) * exp2_scale)
    run_centred = rescale * (run_centred + (run_max - new_max) * run_sumexp) + tl.sum(p * centred, axis=1)
    run_sumexp = rescale * run_sumexp + tl.sum(p, axis=1)
    in_tile = tile_targets - v_start  # (BLOCK_N,) int32, the target's column in this tile
    if tl.max(((in_tile >= 0) & (in_tile < BLOCK_V)).to(tl.int32), axis=0) > 0:
        picked = tl.max(tl.where(cols[None, :] == in_tile[:, None], acc, float("-inf")), axis=1)
        target_raw = tl.maximum(target_raw, picked)
    return new_max, run_sumexp, run_centred, target_raw


@triton.jit
def _load_tiles(
    hidden,
    weight,
    row_start,
    v_start,
    k_start,
    safe_n,
    safe_v,
    offs_k,
    hidden_size,
    stride_hidden,
    stride_weight,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The (BLOCK_N, BLOCK_K) hidden tile and the (BLOCK_K, BLOCK_V) W^T tile at column `k_start`."""
    if USE_TMA:  # out-of-bounds rows/columns arrive as zeros
        h = hidden.load([row_start, k_start])
        w = weight.load([v_start, k_start]).T
    else:
        h_ptrs = hidden + safe_n[:, None] * stride_hidden + (k_start + offs_k)[None, :]
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
def _mma(h, w, acc, HEAD_MODE: tl.constexpr):
    """acc + h @ w in the head mode's arithmetic (0 plain dot, 1 hidden split in three 16-bit parts, 2 tf32x3)."""
    if HEAD_MODE == 1:
        h_hi = h.to(w.dtype)
        rest = h - h_hi.to(tl.float32)
        h_mid = rest.to(w.dtype)
        h_lo = (rest - h_mid.to(tl.float32)).to(w.dtype)
        acc = tl.dot(h_lo, w, acc)
        acc = tl.dot(h_mid, w, acc)
        acc = tl.dot(h_hi, w, acc)
    elif HEAD_MODE == 2:
        acc = tl.dot(h, w, acc, input_precision="tf32x3")
    else:
        acc = tl.dot(h, w, acc)
    return acc


@triton.jit
def _lm_head_partials_kernel(
    hidden,  # (N, D) bf16/fp16 ("bf16" mode) or fp32 ("x3" modes), READ-ONLY: pointer or TMA descriptor
    weight,  # (V_local, D) bf16/fp16 (fp32 for "tf32x3"), READ-ONLY: pointer or TMA descriptor
    targets_ptr,  # (N,) int32, the target's row in this shard or -1, READ-ONLY
    partials_ptr,  # (n_splits, 4, N) fp32 contiguous, OUT: max, sumexp, centred sum, target logit
    n_tokens,
    vocab_local,
    hidden_size,
    stride_hidden,
    stride_weight,
    inv_temperature,
    tiles_per_split,
    n_splits,
    group_blocks,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HEAD_MODE: tl.constexpr,  # 0 plain dot, 1 hidden split in three 16-bit parts, 2 tf32x3
    USE_TMA: tl.constexpr,  # hidden and weight are host-side TMA descriptors (block shapes as above)
    K_CHUNK: tl.constexpr,  # 0: one accumulator chained over K; else a fresh one every K_CHUNK columns
):
    # 1. which (token block, split) this program owns: groups of `group_blocks` token blocks x all splits
    pid = tl.program_id(0)
    n_token_blocks = tl.cdiv(n_tokens, BLOCK_N)
    programs_per_group = group_blocks * n_splits
    first_block = (pid // programs_per_group) * group_blocks
    blocks_here = tl.minimum(n_token_blocks - first_block, group_blocks)
    in_group = pid % programs_per_group
    token_block = first_block + in_group % blocks_here
    split = in_group // blocks_here

    row_start = token_block * BLOCK_N
    offs_n = row_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = offs_n < n_tokens
    safe_n = tl.where(row_ok, offs_n, 0)  # padded rows read row 0 and are never stored
    tile_targets = tl.load(targets_ptr + safe_n)  # (BLOCK_N,) int32
    offs_k = tl.arange(0, BLOCK_K)
    exp2_scale = inv_temperature * 1.4426950408889634  # log2(e) / temperature

    # 2. running statistics per token in raw accumulator units; a finite start max avoids inf * 0
    run_max = tl.full([BLOCK_N], MASKED_LOGIT, tl.float32)
    run_sumexp = tl.zeros([BLOCK_N], tl.float32)
    run_centred = tl.zeros([BLOCK_N], tl.float32)
    target_raw = tl.full([BLOCK_N], float("-inf"), tl.float32)

    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, vocab_local)
    for v_start in range(v_begin, v_end, BLOCK_V):
        offs_v = v_start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        safe_v = tl.where(offs_v < vocab_local, offs_v, 0)
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        # 3. logits tile H[block] @ W[tile].T in the fp32 accumulator. The tensor cores add into their
        # accumulator with truncation (a bias of ~5e-6 relative over a K = 4096 chain, as in cuBLAS), so
        # K_CHUNK > 0 sums every K_CHUNK columns into a fresh accumulator and adds it to `acc` with a
        # rounded fp32 add: the truncations then act on small partial sums of either sign and average out.
        if K_CHUNK == 0:
            for k_start in range(0, hidden_size, BLOCK_K):
                h, w = _load_tiles(
                    hidden,
                    weight,
                    row_start,
                    v_start,
                    k_start,
                    safe_n,
                    safe_v,
                    offs_k,
                    hidden_size,
                    stride_hidden,
                    stride_weight,
                    USE_TMA,
                    EVEN_K,
                )
                acc = _mma(h, w, acc, HEAD_MODE)
        elif K_CHUNK == BLOCK_K:
            for k_start in range(0, hidden_size, BLOCK_K):
                h, w = _load_tiles(
                    hidden,
                    weight,
                    row_start,
                    v_start,
                    k_start,
                    safe_n,
                    safe_v,
                    offs_k,
                    hidden_size,
                    stride_hidden,
                    stride_weight,
                    USE_TMA,
                    EVEN_K,
                )
                acc += _mma(h, w, tl.zeros([BLOCK_N, BLOCK_V], tl.float32), HEAD_MODE)
        else:
            for chunk_start in range(0, hidden_size, K_CHUNK):
                part = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
                for k_start in range(chunk_start, tl.minimum(chunk_start + K_CHUNK, hidden_size), BLOCK_K):
                    h, w = _load_tiles(
                        hidden,
                        weight,
                        row_start,
                        v_start,
                        k_start,
                        safe_n,
                        safe_v,
                        offs_k,
                        hidden_size,
                        stride_hidden,
                        stride_weight,
                        USE_TMA,
                        EVEN_K,
                    )
                    part = _mma(h, w, part, HEAD_MODE)
                acc += part
        # 4. padded columns masked (last tile only), online softmax update, target pick
        if v_start + BLOCK_V > vocab_local:
            run_max, run_sumexp, run_centred, target_raw = _fold_tile(
                acc,
                run_max,
                run_sumexp,
                run_centred,
                target_raw,
                tile_targets,
                v_start,
                vocab_local,
                exp2_scale,
                BLOCK_V,
                True,
            )
        else:
            run_max, run_sumexp, run_centred, target_raw = _fold_tile(
                acc,
                run_max,
                run_sumexp,
                run_centred,
                target_raw,
                tile_targets,
                v_start,
                vocab_local,
                exp2_scale,
                BLOCK_V,
                False,
            )

    # 5. this split's partials, converted from accumulator units to z = acc / temperature
    out = partials_ptr + split * (4 * n_tokens) + offs_n
    tl.store(out, run_max * inv_temperature, mask=row_ok)
    tl.store(out + n_tokens, run_sumexp, mask=row_ok)
    tl.store(out + 2 * n_tokens, run_centred * inv_temperature, mask=row_ok)
    tl.store(out + 3 * n_tokens, target_raw * inv_temperature, mask=row_ok)


def lm_head_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_targets: torch.Tensor,
    *,
    temperature: float,
    head_dtype: str,
    tiles: TritonTiles | None = None,
) -> torch.Tensor:
    """(S, 4, N) fp32 partials of ``z = (hidden @ weight.T) / temperature`` over this vocab shard.

    Same contract as `lm_head_logprobs_ref.lm_head_partials`; `tiles` overrides the launch shape (benchmarks).
    """
    mode = head_mode_for(head_dtype, weight.dtype, hidden.dtype)
    tiles = tiles or default_tiles(mode)
    if tiles.k_chunk % tiles.block_k:
        raise UsageError("E503", f"k_chunk {tiles.k_chunk} is not a multiple of block_k {tiles.block_k}")
    if hidden.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise UsageError("E503", f"impl='triton' needs CUDA tensors (got {hidden.device}); use impl='torch'")
    n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    if vocab_local == 0 or n_tokens == 0:
        return empty_partials(n_tokens, hidden.device)
    hidden_op, weight_op = head_operands(hidden, weight, head_dtype)
    if mode == "tf32x3":
        weight_op = weight_op.float()
    hidden_op = hidden_op if hidden_op.stride(1) == 1 else hidden_op.contiguous()
    weight_op = weight_op if weight_op.stride(1) == 1 else weight_op.contiguous()
    hidden_size = hidden.shape[1]

    n_token_blocks = triton.cdiv(n_tokens, tiles.block_n)
    n_vocab_tiles = triton.cdiv(vocab_local, tiles.block_v)
    if tiles.n_splits > 0:
        wanted = min(tiles.n_splits, n_vocab_tiles)
    else:
        n_slots = _sm_count(hidden.device) * tiles.programs_per_sm
        wanted = choose_n_splits(n_token_blocks, n_vocab_tiles, n_slots)
    tiles_per_split = triton.cdiv(n_vocab_tiles, wanted)
    n_splits = triton.cdiv(n_vocab_tiles, tiles_per_split)  # every split holds at least one real column
    group_blocks = max(1, _sm_count(hidden.device) * tiles.programs_per_sm // n_splits)

    hidden_arg, weight_arg = hidden_op, weight_op
    use_tma = tiles.use_tma and _tma_ready(hidden_op) and _tma_ready(weight_op)
    if use_tma:
        hidden_arg = TensorDescriptor.from_tensor(hidden_op, [tiles.block_n, tiles.block_k])
        weight_arg = TensorDescriptor.from_tensor(weight_op, [tiles.block_v, tiles.block_k])
    partials = torch.empty(n_splits, PARTIAL_ROWS, n_tokens, dtype=torch.float32, device=hidden.device)
    grid = (n_token_blocks * n_splits,)
    _lm_head_partials_kernel[grid](
        hidden_arg,
        weight_arg,
        local_targets.to(torch.int32),
        partials,
        n_tokens,
        vocab_local,
        hidden_size,
        hidden_op.stride(0),
        weight_op.stride(0),
        1.0 / temperature,
        tiles_per_split,
        n_splits,
        group_blocks,
        BLOCK_N=tiles.block_n,
        BLOCK_V=tiles.block_v,
        BLOCK_K=tiles.block_k,
        EVEN_K=hidden_size % tiles.block_k == 0,
        HEAD_MODE=HEAD_MODE_CODES[mode],
        USE_TMA=use_tma,
        K_CHUNK=tiles.k_chunk,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return partials


def _tma_ready(tensor: torch.Tensor) -> bool:
    """True when `tensor` (2-D, rows contiguous) meets TMA's rules: on a GPU, 16-byte aligned base and rows."""
    return (
        tensor.is_cuda
        and tensor.data_ptr() % 16 == 0
        and (tensor.stride(0) * tensor.element_size()) % 16 == 0
        and torch.cuda.get_device_capability(tensor.device)[0] >= 9
    )


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (1 on the CPU, where only the Triton interpreter runs this kernel)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
