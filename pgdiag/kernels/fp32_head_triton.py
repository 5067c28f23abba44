"""The fp32 LM head in Triton: logits as accurate as fp32 arithmetic allows, on the tensor cores.

What: the (S, 4, N) softmax partials (see `vocab_parallel`) of ``z = (H @ W.T) / temperature`` where H is
fp32 (or 16-bit) and W is the head as stored (bf16, fp16 or fp32), matching engines that run the last layer
in fp32. Head modes (`lm_head_logprobs_triton.head_mode_for`):

  "bf16x3"  fp32 H, bf16 W: H is split into three bf16 pieces, h = hi + mid + lo exactly (3 x 8 bits hold
            the 24 bits of an fp32 number), by `split_hidden`; products of bf16 numbers are exact in fp32, so
            three MMAs per W tile give every term of H @ W.T exactly. "fp16x3": fp16 pieces for an fp16 W.
  "bf16x1"  16-bit H of W's dtype (a bf16 trunk's fp32 head): H is exact as it is, one MMA per K step.
  "tf32x3"  fp32 W (a head stored in fp32): fp32 H and W with Triton's three-pass tf32 dot.

Why the accumulation differs from cuBLAS's: tensor cores add into their accumulator with truncation, so one
chain over K = 4096 biases every logit toward zero by ~5e-6 of its value (~2e-4 nats on a logprob of -45; the
bf16 GEMM of cuBLAS does the same), and the rounding of a running fp32 sum of ~30 adds ~1e-5 more. So the
tensor cores sum only a short *chain* (`FRESH_STEPS` K steps of 64 columns, all pieces, smallest first) into
a fresh accumulator; the CUDA cores add it into a *group sum*, and every `FRESH_PER_GROUP` chains the group
sum into the tile's sum. Truncation then acts on short sums of either sign, and the big rounded adds happen
K / 512 times instead of K / 16 (measured accuracy and speed: docs/kernels.md, docs/benchmarks.md).

On Hopper (sm_90) the 16-bit modes without kept sets run `fp32_head_gluon` instead: the same arithmetic with
one W tile load per K step for all pieces and no register passes to reset the accumulators (101 ms against
107 ms on an H200 at 16384 x 4096 x 151936); this kernel runs everywhere else and is that one's reference.

How: one program per (token block, vocab split), numbered as in the bf16 kernel (`triton_shared`). The K loop
is flat over (chain, piece, step) so that Triton pipelines the TMA loads across chains and keeps one MMA in
flight; the W tile is loaded again for each piece (it comes from L2). Three (BLOCK_N, BLOCK_V) fp32
accumulators must fit in the registers, hence 128 x 128 tiles over 8 warps (3 x 64 registers a thread).
With per-token kept sets (`kept_words`), the finished tile also folds into the online softmax over K, as in the
bf16 kernel (`triton_shared.fold_kept_tile`): (S, 8, N) partials.

Memory: the pieces of H take 6 bytes per element, written a chunk of tokens at a time (`pieces_chunk`:
at most `PIECES_BUDGET_BYTES`, 384 MiB, i.e. 16384 tokens at d = 4096), so the extra memory stays below
0.4 GiB at any T; "x1" and "tf32x3" use H as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pgdiag.kernels.triton_shared import (
    MASKED_LOGIT,
    SplitPlan,
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
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS

PIECES_BUDGET_BYTES = 384 << 20
SPLIT_BLOCK = 1024


@triton.jit
def _split_hidden_kernel(
    src_ptr,  # (C * D,) fp32, READ-ONLY
    parts_ptr,  # (3, C * D) bf16/fp16, OUT: hi, mid, lo with hi + mid + lo ~= scale * src
    n_elements,
    scale,  # a power of two (exact): keeps fp16 parts in range
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elements
    h = tl.load(src_ptr + offs, mask=ok, other=0.0) * scale
    low = parts_ptr.dtype.element_ty
    hi = h.to(low)
    rest = h - hi.to(tl.float32)  # exact in fp32
    mid = rest.to(low)
    lo = (rest - mid.to(tl.float32)).to(low)
    tl.store(parts_ptr + offs, hi, mask=ok)
    tl.store(parts_ptr + n_elements + offs, mid, mask=ok)
    tl.store(parts_ptr + 2 * n_elements + offs, lo, mask=ok)


def split_hidden(hidden: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write the three pieces of ``scale * hidden`` (fp32 (C, d)) into `out` (>= 3C rows, 16-bit): rows [0, C)
    hi, [C, 2C) mid, [2C, 3C) lo; returns the (3C, d) view that holds them.

    bf16 pieces hold all 24 bits of an fp32 number (hi + mid + lo == scale * hidden exactly); fp16 pieces keep
    ~33 bits but can underflow, which `fp16_scale` makes harmless (absolute error <= 2^-38 max |hidden|).
    """
    chunk, hidden_size = hidden.shape
    pieces = out[: 3 * chunk]
    n_elements = chunk * hidden_size
    _split_hidden_kernel[(triton.cdiv(n_elements, SPLIT_BLOCK),)](
        hidden.contiguous(), pieces, n_elements, scale, BLOCK=SPLIT_BLOCK
    )
    return pieces


def pieces_chunk(n_tokens: int, hidden_size: int, block_n: int) -> int:
    """Tokens per launch so that the pieces (6 bytes per element) stay within `PIECES_BUDGET_BYTES`, in equal
    chunks of whole token blocks (a short last chunk would leave most of its last wave of programs idle).
    Example: 65536 tokens at d = 4096 -> 4 chunks of 16384 (384 MiB of pieces)."""
    most = max(block_n, PIECES_BUDGET_BYTES // (6 * hidden_size) // block_n * block_n)
    n_chunks = triton.cdiv(n_tokens, most)
    return triton.cdiv(triton.cdiv(n_tokens, n_chunks), block_n) * block_n


def fp16_scale(hidden: torch.Tensor) -> float:
    """The power of two that brings max |hidden| to [2^13, 2^14): fp16 parts then neither overflow nor lose
    the small values' bits to underflow. 1.0 for an all-zero or non-finite hidden (those give NaN anyway)."""
    amax = float(hidden.abs().max()) if hidden.numel() else 0.0
    if amax == 0.0 or not math.isfinite(amax):
        return 1.0
    return 2.0 ** max(-100, min(100, math.floor(math.log2(2.0**14 / amax))))


@triton.jit
def _fp32_head_partials_kernel(
    hidden,  # (N_PIECES * piece_rows, D) pieces stacked hi, mid, lo (or one 16-bit / fp32 H), READ-ONLY
    weight,  # (V_local, D) bf16/fp16 (fp32 for TF32X3), READ-ONLY: pointer or TMA descriptor
    targets_ptr,  # (N,) int32, the target's row in this shard or -1, READ-ONLY
    partials_ptr,  # (n_splits, 4 or 8, >= N) fp32, OUT at [split * stride_split + stat * stride_stat + token]
    kept_ptr,  # (N, ceil(V_local / 32)) int32 packed kept sets, READ-ONLY (KEPT only)
    n_tokens,
    piece_rows,
    vocab_local,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_split,
    stride_stat,
    stride_kept,
    inv_temperature,
    tiles_per_split,
    n_splits,
    group_blocks,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden_size is a multiple of BLOCK_K * FRESH_STEPS
    USE_TMA: tl.constexpr,
    N_PIECES: tl.constexpr,  # 3: split fp32 hidden; 1: hidden used as it is
    FRESH_STEPS: tl.constexpr,  # K steps the tensor cores sum into one fresh accumulator
    FRESH_PER_GROUP: tl.constexpr,  # fresh sums per group sum (1: no group sum)
    TF32X3: tl.constexpr,
    KEPT: tl.constexpr,  # also the partials over each token's kept set (stat rows 4-7)
):
    token_block, split = program_tile(n_tokens, n_splits, group_blocks, BLOCK_N)
    row_start = token_block * BLOCK_N
    offs_n = row_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = offs_n < n_tokens
    safe_n = tl.where(row_ok, offs_n, 0)  # padded rows read row 0 and are never stored
    tile_targets = tl.load(targets_ptr + safe_n)  # (BLOCK_N,) int32
    offs_k = tl.arange(0, BLOCK_K)
    exp2_scale = inv_temperature * 1.4426950408889634  # log2(e) / temperature
    n_chains = tl.cdiv(tl.cdiv(hidden_size, BLOCK_K), FRESH_STEPS)
    per_chain: tl.constexpr = N_PIECES * FRESH_STEPS  # MMAs summed into one fresh accumulator

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
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)  # (BLOCK_N, BLOCK_V): the tile's sum over K
        group_sum = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)  # the last < FRESH_PER_GROUP fresh sums
        fresh = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)  # tensor-core sum of one chain: fresh every chain
        # one chain = FRESH_STEPS K steps x all pieces, smallest piece first; the loop is flat so that
        # Triton pipelines the loads across chains and keeps one MMA in flight
        for i in range(0, n_chains * per_chain):
            chain = i // per_chain
            piece = (i % per_chain) // FRESH_STEPS  # 0: lo (or the only piece)
            step = chain * FRESH_STEPS + i % FRESH_STEPS
            piece_base = (N_PIECES - 1 - piece) * piece_rows
            h, w = load_tiles(
                hidden,
                weight,
                piece_base + row_start,
                piece_base + safe_n,
                v_start,
                safe_v,
                step * BLOCK_K,
                offs_k,
                hidden_size,
                stride_hidden,
                stride_weight,
                USE_TMA,
                EVEN_K,
            )
            fresh = tl.dot(h, w, fresh, input_precision="tf32x3") if TF32X3 else tl.dot(h, w, fresh)
            if i % per_chain == per_chain - 1:  # the chain is complete: hand it to the CUDA cores
                if FRESH_PER_GROUP == 1:
                    acc += fresh
                else:
                    group_sum += fresh
                    if chain % FRESH_PER_GROUP == FRESH_PER_GROUP - 1:
                        acc += group_sum
                        group_sum = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
                # zero, but not a constant: Triton would fold `x + dot(a, b, 0)` into `dot(a, b, x)`,
                # which chains the tensor cores onto the large sum (the very thing this kernel avoids)
                fresh = fresh * 0.0
        acc += group_sum
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

    store_partials(
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
    )
    if KEPT:
        store_kept_partials(
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
        )


def fp32_head_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    local_targets: torch.Tensor,
    *,
    temperature: float,
    mode: str,
    tiles: TritonTiles,
    kept_words: torch.Tensor | None = None,
) -> torch.Tensor:
    """(S, 4, N) fp32 partials of the fp32 head in `mode` ("bf16x3", "fp16x3", "bf16x1", "fp16x1", "tf32x3");
    with `kept_words` (N, ceil(V_local / 32)) int32 contiguous, (S, 8, N): rows 4-7 over each token's kept set.

    hidden (N, d); weight (V_local, d) (fp32 for "tf32x3", else 16-bit); local_targets (N,) int32.
    """
    n_tokens, hidden_size = hidden.shape
    weight = (weight.float() if mode == "tf32x3" else weight).contiguous()
    scale, n_pieces, chunk = 1.0, 1, n_tokens
    if mode in ("bf16x3", "fp16x3"):
        hidden = hidden.float().contiguous()
        scale = fp16_scale(hidden) if mode == "fp16x3" else 1.0
        n_pieces = 3
        chunk = pieces_chunk(n_tokens, hidden_size, tiles.block_n)
    else:
        hidden = hidden.to(weight.dtype).contiguous()  # "x1": already W's dtype; "tf32x3": fp32
    plan = plan_splits(chunk, weight.shape[0], tiles, hidden.device)
    n_stats = PARTIAL_ROWS if kept_words is None else 2 * PARTIAL_ROWS
    partials = torch.empty(plan.n_splits, n_stats, n_tokens, dtype=torch.float32, device=hidden.device)
    # one pieces buffer for all chunks: launches on one stream run in order, so reuse is safe
    buffer = (
        torch.empty(3 * chunk, hidden_size, dtype=weight.dtype, device=hidden.device)
        if n_pieces == 3
        else None
    )
    for start in range(0, n_tokens, chunk):
        stop = min(start + chunk, n_tokens)
        operand = split_hidden(hidden[start:stop], buffer, scale) if buffer is not None else hidden
        _launch(
            operand,
            weight,
            local_targets[start:stop],
            partials[:, :, start:stop],
            None if kept_words is None else kept_words[start:stop],
            piece_rows=stop - start,
            n_pieces=n_pieces,
            temperature=temperature * scale,  # the accumulator holds scale * logits
            tf32x3=mode == "tf32x3",
            plan=plan,
            tiles=tiles,
        )
    return partials


def gluon_kernel() -> tuple[Callable, Callable] | None:
    """(`gluon_ready`, `launch_gluon`) of `fp32_head_gluon`, or None where this Triton lacks the Gluon API the
    kernel is written in (Triton 3.6's; `gluon_api_present`): the Triton kernel then runs everywhere."""
    try:
        from pgdiag.kernels.fp32_head_gluon import gluon_api_present, gluon_ready, launch_gluon
    except ImportError:
        return None
    return (gluon_ready, launch_gluon) if gluon_api_present() else None


def _launch(
    operand: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    partials: torch.Tensor,
    kept_words: torch.Tensor | None,
    *,
    piece_rows: int,
    n_pieces: int,
    temperature: float,
    tf32x3: bool,
    plan: SplitPlan,
    tiles: TritonTiles,
) -> None:
    """One launch of the fp32-head kernel over `targets.shape[0]` tokens (`operand`: stacked parts or H): the
    Gluon kernel where it applies (`fp32_head_gluon.gluon_ready`; no kept sets, 16-bit operands), else Triton."""
    gluon = gluon_kernel() if kept_words is None and not tf32x3 and operand.is_cuda else None
    if gluon is not None:
        gluon_ready, launch_gluon = gluon
        if gluon_ready(operand, weight, tiles):
            launch_gluon(
                operand,
                weight,
                targets,
                partials,
                piece_rows=piece_rows,
                n_pieces=n_pieces,
                temperature=temperature,
                plan=plan,
                tiles=tiles,
            )
            return
    n_tokens = targets.shape[0]
    use_tma = tiles.use_tma and tma_ready(operand) and tma_ready(weight)
    hidden_arg, weight_arg = operand, weight
    if use_tma:
        hidden_arg = TensorDescriptor.from_tensor(operand, [tiles.block_n, tiles.block_k])
        weight_arg = TensorDescriptor.from_tensor(weight, [tiles.block_v, tiles.block_k])
    grid = (triton.cdiv(n_tokens, tiles.block_n) * plan.n_splits,)
    _fp32_head_partials_kernel[grid](
        hidden_arg,
        weight_arg,
        targets,
        partials,
        partials if kept_words is None else kept_words,
        n_tokens,
        piece_rows,
        weight.shape[0],
        operand.shape[1],
        operand.stride(0),
        weight.stride(0),
        partials.stride(0),
        partials.stride(1),
        0 if kept_words is None else kept_words.stride(0),
        1.0 / temperature,
        plan.tiles_per_split,
        plan.n_splits,
        plan.group_blocks,
        BLOCK_N=tiles.block_n,
        BLOCK_V=tiles.block_v,
        BLOCK_K=tiles.block_k,
        EVEN_K=operand.shape[1] % (tiles.block_k * tiles.fresh_steps) == 0,
        USE_TMA=use_tma,
        N_PIECES=n_pieces,
        FRESH_STEPS=tiles.fresh_steps,
        FRESH_PER_GROUP=tiles.fresh_per_group,
        TF32X3=tf32x3,
        KEPT=kept_words is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
