"""Fused Triton LM-head partials: logits tiles live in registers only, never in memory.

What: the same (S, 4, N) fp32 softmax partials as `lm_head_logprobs_ref.lm_head_partials` (max, sum of
exponentials, centred weighted sum, target logit per token and vocab split; see `vocab_parallel`), computed
by one forward-only kernel; with per-token kept sets K (packed bitmask words, `kept_set.kept_words`) the same
pass also writes the partials over K, (S, 8, N). The caller merges the S splits (and the TP ranks) with
`vocab_parallel.merge_partials`. This module holds the bf16 head's kernel and `lm_head_partials`, which
picks the head arithmetic; the fp32 head's kernel is in `fp32_head_triton`.

How (bf16 head): the grid has one program per (token block, vocab split). A program keeps a (BLOCK_N,
BLOCK_V) fp32 accumulator, runs the K loop of ``H[block] @ W[tile].T`` with `tl.dot` for each vocab tile of
its split (tiles arrive through host-side TMA descriptors on Hopper, through pointer loads elsewhere), masks
the padded columns of the shard's last tile, and folds the tile into running per-token statistics (online
softmax in raw accumulator units with exp2, the entropy sum kept centred on the running max). With `KEPT` on,
each tile also folds into a second online softmax restricted to the tile's set bits of K
(`triton_shared.load_kept_bits`, `fold_kept_tile`). Temperature acts
on the fp32 accumulator (pre-scaling bf16 H or W would add ~0.03 nats at |z| ~ 30). The accumulator is
chained over all of K as in cuBLAS: the tensor cores' truncating adds bias logits by ~5e-6 relative over
K = 4096, far below the bf16 rounding of the inputs. The split count and the order of the programs are chosen
for L2 reuse and whole waves of the GPU (`triton_shared.choose_plan`).

Head precision (`head_mode`, see `head_mode_for`):
  "bf16"          plain 16-bit dot (bf16 or fp16 operands), this module's kernel.
  "bf16x3"        fp32 head, fp32 hidden, bf16 W: hidden split in three bf16 parts ("fp16x3": fp16 W).
  "bf16x1"        fp32 head, hidden already bf16 like W (a bf16 trunk): exact, one MMA per K step ("fp16x1").
  "tf32x3"        fp32 head, fp32 W: Triton's 3-pass tf32 dot.
  The fp32 modes run `fp32_head_triton` (fresh accumulator per K step, fp32 sums).

Memory math (why nothing of size N x V exists): the only outputs are the partials, 16 bytes per token and
split: T = 65536 tokens x S = 44 splits -> 46 MB, against 65536 x 151936 x 4 B = 39.8 GB for one fp32 logits
tensor. Inputs are read in tiles; per program the registers hold the (BLOCK_N, BLOCK_V) accumulator (256 x 128
or 128 x 256 fp32 = 128 KB over 256 threads) and shared memory holds `num_stages` (BLOCK_N + BLOCK_V) x BLOCK_K
input tiles (3 x 384 x 64 x 2 B = 144 KB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pgdiag.errors import Code, UsageError
from pgdiag.kernels.lm_head_logprobs_ref import head_operands
from pgdiag.kernels.triton_shared import (
    MASKED_LOGIT,
    TritonTiles,
    fold_any_tile,
    load_kept_bits,
    load_tiles,
    plan_splits,
    program_tile,
    store_kept_partials,
    store_partials,
    tma_ready,
)
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, empty_partials

FP32_HEAD_MODES = ("bf16x3", "fp16x3", "bf16x1", "fp16x1", "tf32x3")


def head_mode_for(head_dtype: str, weight_dtype: torch.dtype, hidden_dtype: torch.dtype) -> str:
    """The head arithmetic that runs for `head_dtype` with these operand dtypes (see the module docstring)."""
    if head_dtype == "bf16":
        return "bf16"
    if weight_dtype not in (torch.bfloat16, torch.float16):
        return "tf32x3"
    low = "bf16" if weight_dtype == torch.bfloat16 else "fp16"
    return f"{low}x1" if hidden_dtype == weight_dtype else f"{low}x3"


def default_tiles(head_mode: str, hidden_size: int) -> TritonTiles:
    """Launch shape per head mode and hidden size, from the H100 sweeps recorded in docs/benchmarks.md.

    bf16, d <= 4096: 256 x 128 tiles, K step 64, TMA loads, L2-aligned groups of 6 token blocks (44 splits):
    1.08-1.09x cuBLAS at T = 16k / 64k, d = 4096 (128 x 256 tiles: 1.10-1.13x). d > 4096: 128 x 256 tiles in
    groups of 12 token blocks (22 splits): 1.10 / 1.11-1.12x at T = 16k / 64k, d = 8192 (256 x 128: 1.14 / 1.18-1.25x).
    fp32 modes: 128 x 128 tiles (three fp32 accumulators must fit in the registers), K step 64, 8 K steps per
    middle sum; tf32x3 takes K steps of 32 (its fp32 tiles are twice as wide in bytes). Their split count made
    no difference beyond 1-2 % in the sweep, so they keep the wave-filling plan. Chains of 4 K steps for the
    one-piece modes (bf16x1: the default recompute's head) ran 1.27-1.36x the bf16 head instead of 1.44x (H200,
    issue 26) but reached 1.8e-5 nats on uniform targets at tau 0.7 (the GPU test's bound is 1.5e-5), so every
    fp32 mode keeps chains of 2. On sm_90 the Gluon kernel (`fp32_head_gluon`) takes the 16-bit fp32 modes with
    its own chains: one K step (lo, mid, hi) in groups of 8 for three pieces (101 ms against the Triton kernel's
    107 ms, H200, issue 26; uniform-target error mean 1.7e-6 against 2.6e-6), two steps in groups of 4 for one.
    """
    if head_mode == "bf16":
        if hidden_size > 4096:
            return TritonTiles(block_n=128, block_v=256, aligned_group_blocks=12)
        return TritonTiles(aligned_group_blocks=6)
    if head_mode == "tf32x3":
        return TritonTiles(
            block_n=128, block_v=128, block_k=32, num_stages=3, fresh_steps=1, fresh_per_group=8
        )
    if head_mode.endswith("x1"):
        return TritonTiles(
            block_n=128, block_v=128, block_k=64, num_stages=4, fresh_steps=2, fresh_per_group=4,
            gluon_fresh_steps=2, gluon_fresh_per_group=4,
        )  # fmt: skip
    return TritonTiles(
        block_n=128, block_v=128, block_k=64, num_stages=4, fresh_steps=2, fresh_per_group=4,
        gluon_fresh_steps=1, gluon_fresh_per_group=8,
    )  # fmt: skip


@triton.jit
def _bf16_head_partials_kernel(
    hidden,  # (N, D) bf16/fp16, READ-ONLY: pointer or TMA descriptor
    weight,  # (V_local, D) bf16/fp16, READ-ONLY: pointer or TMA descriptor
    targets_ptr,  # (N,) int32, the target's row in this shard or -1, READ-ONLY
    partials_ptr,  # (n_splits, 4 or 8, N) fp32 contiguous, OUT: max, sumexp, centred sum, target logit (x2: K)
    kept_ptr,  # (N, ceil(V_local / 32)) int32 packed kept sets, READ-ONLY (KEPT only)
    n_tokens,
    vocab_local,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_kept,
    inv_temperature,
    tiles_per_split,
    n_splits,
    group_blocks,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,  # hidden and weight are host-side TMA descriptors (block shapes as above)
    KEPT: tl.constexpr,  # also the partials over each token's kept set (stat rows 4-7)
):
    # 1. which (token block, split) this program owns
    token_block, split = program_tile(n_tokens, n_splits, group_blocks, BLOCK_N)
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
    kept_sumexp = tl.zeros([BLOCK_N], tl.float32)  # K's sums, centred on run_max (KEPT only)
    kept_centred = tl.zeros([BLOCK_N], tl.float32)

    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, vocab_local)
    for v_start in range(v_begin, v_end, BLOCK_V):
        offs_v = v_start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        safe_v = tl.where(offs_v < vocab_local, offs_v, 0)
        # 3. logits tile H[block] @ W[tile].T, fp32 accumulator chained over K
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for k_start in range(0, hidden_size, BLOCK_K):
            h, w = load_tiles(
                hidden,
                weight,
                row_start,
                safe_n,
                v_start,
                safe_v,
                k_start,
                offs_k,
                hidden_size,
                stride_hidden,
                stride_weight,
                USE_TMA,
                EVEN_K,
            )
            acc = tl.dot(h, w, acc)
        # 4. padded columns masked (last tile only), online softmax update (and K's masked sums), target pick
        kept = 0  # the tile's columns in K (KEPT only)
        if KEPT:
            kept = load_kept_bits(kept_ptr, safe_n, stride_kept, v_start, vocab_local, BLOCK_V)
        run_max, run_sumexp, run_centred, target_raw, kept_sumexp, kept_centred = fold_any_tile(
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
            KEPT,
        )

    # 5. this split's partials, converted from accumulator units to z = acc / temperature
    n_stats = 8 if KEPT else 4
    store_partials(
        partials_ptr,
        split,
        offs_n,
        row_ok,
        n_stats * n_tokens,
        n_tokens,
        run_max,
        run_sumexp,
        run_centred,
        target_raw,
        inv_temperature,
    )
    if KEPT:
        store_kept_partials(
            partials_ptr,
            split,
            offs_n,
            row_ok,
            n_stats * n_tokens,
            n_tokens,
            run_max,
            kept_sumexp,
            kept_centred,
            inv_temperature,
        )


def lm_head_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_targets: torch.Tensor,
    *,
    temperature: float,
    head_dtype: str,
    tiles: TritonTiles | None = None,
    kept_words: torch.Tensor | None = None,
) -> torch.Tensor:
    """(S, 4, N) fp32 partials of ``z = (hidden @ weight.T) / temperature`` over this vocab shard; with
    `kept_words` (N, ceil(V_local / 32)) int32, (S, 8, N): rows 4-7 over each token's kept set.

    Same contract as `lm_head_logprobs_ref.lm_head_partials`; `tiles` overrides the launch shape (benchmarks).
    """
    mode = head_mode_for(head_dtype, weight.dtype, hidden.dtype)
    tiles = tiles or default_tiles(mode, hidden.shape[1])
    if hidden.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise UsageError(
            Code.DEVICE_UNAVAILABLE,
            f"impl='triton' needs CUDA tensors (got {hidden.device}); use impl='torch'",
        )
    n_tokens, vocab_local = hidden.shape[0], weight.shape[0]
    n_stats = PARTIAL_ROWS if kept_words is None else 2 * PARTIAL_ROWS
    if vocab_local == 0 or n_tokens == 0:
        return empty_partials(n_tokens, hidden.device).repeat(1, n_stats // PARTIAL_ROWS, 1)
    if kept_words is not None:
        kept_words = kept_words.to(torch.int32).contiguous()
    if mode in FP32_HEAD_MODES:  # imported here: the bf16 head does not need it
        from pgdiag.kernels.fp32_head_triton import fp32_head_partials

        return fp32_head_partials(
            hidden,
            weight,
            local_targets.to(torch.int32),
            temperature=temperature,
            mode=mode,
            tiles=tiles,
            kept_words=kept_words,
        )
    hidden_op, weight_op = (_rows_contiguous(t) for t in head_operands(hidden, weight, head_dtype))
    plan = plan_splits(n_tokens, vocab_local, tiles, hidden.device)
    hidden_arg, weight_arg = hidden_op, weight_op
    use_tma = tiles.use_tma and tma_ready(hidden_op) and tma_ready(weight_op)
    if use_tma:
        hidden_arg = TensorDescriptor.from_tensor(hidden_op, [tiles.block_n, tiles.block_k])
        weight_arg = TensorDescriptor.from_tensor(weight_op, [tiles.block_v, tiles.block_k])
    partials = torch.empty(plan.n_splits, n_stats, n_tokens, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(n_tokens, tiles.block_n) * plan.n_splits,)
    _bf16_head_partials_kernel[grid](
        hidden_arg,
        weight_arg,
        local_targets.to(torch.int32),
        partials,
        partials if kept_words is None else kept_words,
        n_tokens,
        vocab_local,
        hidden.shape[1],
        hidden_op.stride(0),
        weight_op.stride(0),
        0 if kept_words is None else kept_words.stride(0),
        1.0 / temperature,
        plan.tiles_per_split,
        plan.n_splits,
        plan.group_blocks,
        BLOCK_N=tiles.block_n,
        BLOCK_V=tiles.block_v,
        BLOCK_K=tiles.block_k,
        EVEN_K=hidden.shape[1] % tiles.block_k == 0,
        USE_TMA=use_tma,
        KEPT=kept_words is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return partials


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself if its rows are contiguous (stride 1 along the last dim), else a contiguous copy."""
    return tensor if tensor.stride(1) == 1 else tensor.contiguous()
