"""The split-piece fp32 LM head on Hopper, written in Gluon: one W tile load for all pieces of a K step.

What: the same (S, 4, N) partials as `fp32_head_triton` in its "bf16x3" / "fp16x3" modes (three pieces of H)
and "bf16x1" / "fp16x1" (H as it is), with the same arithmetic: per K step of 64 columns, one MMA per piece into
a *fresh* tensor-core accumulator; every `gluon_fresh_steps` K steps (a *chain*) the CUDA cores fold the fresh
sum into a group sum, and every `gluon_fresh_per_group` chains the group sum into the tile's sum (why:
`fp32_head_triton`'s docstring). Each K step issues its pieces smallest first (lo, mid, hi), so a chain of one
step adds the small pieces while the accumulator is still small, as the Triton kernel's chains of two steps do
(they issue all lo steps, then all mid, then all hi); chains of two steps issued step by step put the second
step's small pieces on top of the first step's hi sum, and measured twice the truncation bias (uniform targets:
mean 5.8e-6 against 2.6e-6). Hence chains of one step in groups of eight for three pieces; one piece keeps
chains of two steps in groups of four (`lm_head_logprobs_triton.default_tiles`).

Why Gluon: Triton 3.6 keeps one dot per pipelined loop iteration in flight (a second dot on the same
accumulator in the same iteration gets a full wait after the first), so the Triton kernel loads the W tile
again for each piece (three TMA loads of the same tile per K step), and it resets an accumulator on Hopper
with a pass over its registers (its use-accumulator rewrite runs on Blackwell only). Here the program issues
its own TMA loads and `wgmma`s:
* one W tile and the N_PIECES H tiles of a K step arrive on one mbarrier in one of NUM_STAGES buffers (64 KiB
  a step for three pieces: 3 buffers); the step's MMAs chain on the fresh accumulator in the tensor cores with
  no wait between them, and a step's buffers are refilled once the next step's MMAs are issued and its own
  have finished (`warpgroup_mma_wait` with the step's MMAs still outstanding);
* a chain's first MMA ignores the accumulator (`use_acc=False`): no pass over the registers to zero it;
* the chain's sum joins the group sum by one FMA per element (group_sum * keep + fresh, keep = 0 on a group's
  first chain), the group sum the tile's sum likewise: no zeroing passes either;
* the loads run ahead across vocab tiles (one stream of K steps per program), so the fold of a tile overlaps
  the first loads of the next one.
A CTA-wide barrier before each load keeps one warpgroup from refilling a buffer the other still reads.
Measured (H200, docs/benchmarks.md): 101 ms against the Triton kernel's 107 ms at 16384 x 4096 x 151936, and
more accurate (the order above).

Used by `fp32_head_triton.fp32_head_partials` on sm_90 with TMA-ready 16-bit operands and no kept sets
(`gluon_ready`); everywhere else (CPU interpreter, kept sets, tf32x3, other GPUs) the Triton kernel runs, and
it stays the reference of this one (tests/kernels/test_lm_head_gpu.py checks both against fp64 logits).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pgdiag.kernels.triton_shared import SplitPlan, TritonTiles, tma_ready

SHARED_BUDGET_BYTES = 200 << 10  # tile buffers per program (the H100 / H200 give a block up to 227 KiB)
MASKED = gl.constexpr(-1.0e30)  # a padded column's logit, as triton_shared.MASKED_LOGIT


def gluon_api_present() -> bool:
    """True where this Triton's Gluon has the calls the kernel makes. Written and measured with Triton 3.6;
    Triton 3.9 has ``gl.barrier`` instead of ``gl.thread_barrier`` and refuses ``tma.async_copy_global_to_shared``
    (``tma.async_load`` now), so there the kernel does not compile and the Triton kernel runs instead
    (tests/kernels/test_lm_head_triton.py compiles it offline for sm_90 to check this answer against the
    installed Triton)."""
    return hasattr(gl, "thread_barrier")


def gluon_ready(operand: torch.Tensor, weight: torch.Tensor, tiles: TritonTiles) -> bool:
    """True where this kernel runs: Hopper (sm_90), 16-bit operands of one dtype, TMA-ready strides, the
    128 x 128 x 64 tile it is written for."""
    return (
        tiles.use_tma
        and tiles.gluon
        and operand.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
        and (tiles.block_n, tiles.block_v, tiles.block_k, tiles.num_warps) == (128, 128, 64, 8)
        and tma_ready(operand)
        and tma_ready(weight)
        and torch.cuda.get_device_capability(operand.device) == (9, 0)
    )


@gluon.jit
def _issue_loads(
    h_desc,
    w_desc,
    h_smem,
    w_smem,
    ready,
    step,  # this program's K-step number (all its vocab tiles in a row)
    total_steps,
    n_k,
    v_begin,
    row_start,
    piece_rows,
    N_PIECES: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """TMA loads of K step `step` (if < total_steps): the W tile and the N_PIECES H tiles, on one mbarrier."""
    stage = step % NUM_STAGES
    tile = step // n_k
    k = (step - tile * n_k) * w_desc.block_type.shape[1]
    v = v_begin + tile * w_desc.block_type.shape[0]
    ok = step < total_steps
    bar = ready.index(stage)
    mbarrier.expect(bar, N_PIECES * h_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [v, k], bar, w_smem.index(stage), pred=ok)
    for piece in gl.static_range(N_PIECES):  # piece 0: lo, stored last
        row = (N_PIECES - 1 - piece) * piece_rows + row_start
        tma.async_copy_global_to_shared(
            h_desc, [row, k], bar, h_smem.index(stage * N_PIECES + piece), pred=ok
        )


@gluon.jit
def _fp32_head_gluon_kernel(
    h_desc,  # TMA descriptor over (N_PIECES * piece_rows, D) 16-bit pieces, stacked hi, mid, lo
    w_desc,  # TMA descriptor over (V_local, D), same dtype
    targets_ptr,  # (N,) int32, the target's row in this shard or -1, READ-ONLY
    partials_ptr,  # (n_splits, 4, >= N) fp32, OUT at [split * stride_split + stat * stride_stat + token]
    n_tokens,
    piece_rows,
    vocab_local,
    hidden_size,
    stride_split,
    stride_stat,
    inv_temperature,
    tiles_per_split,
    n_splits,
    group_blocks,
    N_PIECES: gl.constexpr,
    FRESH_STEPS: gl.constexpr,
    FRESH_PER_GROUP: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_V, 16]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)

    # program -> (token block, split), as triton_shared.program_tile
    pid = gl.program_id(0)
    n_token_blocks = gl.cdiv(n_tokens, BLOCK_N)
    programs_per_group = group_blocks * n_splits
    first_block = (pid // programs_per_group) * group_blocks
    blocks_here = gl.minimum(n_token_blocks - first_block, group_blocks)
    in_group = pid % programs_per_group
    token_block = first_block + in_group % blocks_here
    split = in_group // blocks_here

    row_start = token_block * BLOCK_N
    offs_n = row_start + gl.arange(0, BLOCK_N, layout=rows_layout)  # (BLOCK_N,)
    row_ok = offs_n < n_tokens
    tile_targets = gl.load(targets_ptr + gl.where(row_ok, offs_n, 0))  # (BLOCK_N,) int32
    cols = gl.arange(0, BLOCK_V, layout=cols_layout)  # (BLOCK_V,)
    exp2_scale = inv_temperature * 1.4426950408889634  # log2(e) / temperature

    v_begin = split * tiles_per_split * BLOCK_V
    v_end = gl.minimum(v_begin + tiles_per_split * BLOCK_V, vocab_local)
    n_tiles = gl.cdiv(v_end - v_begin, BLOCK_V)
    n_k = gl.cdiv(hidden_size, BLOCK_K)
    n_chains = gl.cdiv(n_k, FRESH_STEPS)
    total_steps = n_tiles * n_k

    h_smem = gl.allocate_shared_memory(h_desc.dtype, [NUM_STAGES * N_PIECES, BLOCK_N, BLOCK_K], h_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(NUM_STAGES - 1):
        _issue_loads(
            h_desc, w_desc, h_smem, w_smem, ready, s, total_steps, n_k, v_begin, row_start, piece_rows,
            N_PIECES, NUM_STAGES,
        )  # fmt: skip

    run_max = gl.full([BLOCK_N], MASKED, gl.float32, layout=rows_layout)
    run_sumexp = gl.zeros([BLOCK_N], gl.float32, layout=rows_layout)
    run_centred = gl.zeros([BLOCK_N], gl.float32, layout=rows_layout)
    target_raw = gl.full([BLOCK_N], float("-inf"), gl.float32, layout=rows_layout)
    step = 0
    for tile in range(n_tiles):
        v_start = v_begin + tile * BLOCK_V
        # set anew for each tile, so that none of them is live across the fold below (no spills)
        fresh = gl.zeros([BLOCK_N, BLOCK_V], gl.float32, layout=mma)  # tensor-core sum of one chain
        group_sum = gl.zeros([BLOCK_N, BLOCK_V], gl.float32, layout=mma)  # this group's chains
        acc = gl.zeros([BLOCK_N, BLOCK_V], gl.float32, layout=mma)  # the tile's sum over K
        for kk in range(n_k):
            stage = step % NUM_STAGES
            mbarrier.wait(ready.index(stage), (step // NUM_STAGES) & 1)
            w_t = w_smem.index(stage).permute((1, 0))  # (BLOCK_K, BLOCK_V)
            in_chain = kk % FRESH_STEPS != 0  # False: the chain's first MMA ignores the old accumulator
            chain = kk // FRESH_STEPS
            chain_end = (kk % FRESH_STEPS == FRESH_STEPS - 1) | (kk == n_k - 1)
            fresh = warpgroup_mma(h_smem.index(stage * N_PIECES), w_t, fresh, use_acc=in_chain, is_async=True)
            for piece in gl.static_range(1, N_PIECES):  # lo, mid, hi: smallest first
                fresh = warpgroup_mma(h_smem.index(stage * N_PIECES + piece), w_t, fresh, is_async=True)
            # the MMAs of the previous step are done: its buffers may be refilled, once both warpgroups are
            fresh = warpgroup_mma_wait(num_outstanding=N_PIECES, deps=(fresh,))
            gl.thread_barrier()
            _issue_loads(
                h_desc, w_desc, h_smem, w_smem, ready, step + NUM_STAGES - 1, total_steps, n_k, v_begin,
                row_start, piece_rows, N_PIECES, NUM_STAGES,
            )  # fmt: skip
            if chain_end:  # fold the chain into the group sum, a finished group into the tile's sum
                fresh = warpgroup_mma_wait(num_outstanding=0, deps=(fresh,))
                keep = gl.where(chain % FRESH_PER_GROUP == 0, 0.0, 1.0)
                group_sum = gl.fma(group_sum, keep, fresh)
                if (chain % FRESH_PER_GROUP == FRESH_PER_GROUP - 1) | (chain == n_chains - 1):
                    keep_acc = gl.where(chain < FRESH_PER_GROUP, 0.0, 1.0)
                    acc = gl.fma(acc, keep_acc, group_sum)
            step += 1

        # fold the tile into the online softmax (as triton_shared.fold_tile, KEPT off)
        logits = acc
        if v_start + BLOCK_V > vocab_local:
            logits = gl.where((v_start + cols)[None, :] < vocab_local, acc, MASKED)
        new_max = gl.maximum(run_max, gl.max(logits, axis=1))
        centred = logits - new_max[:, None]
        p = gl.exp2(centred * exp2_scale)
        rescale = gl.exp2((run_max - new_max) * exp2_scale)
        run_centred = rescale * (run_centred + (run_max - new_max) * run_sumexp) + gl.sum(p * centred, axis=1)
        run_sumexp = rescale * run_sumexp + gl.sum(p, axis=1)
        run_max = new_max
        in_tile = tile_targets - v_start
        if gl.max(((in_tile >= 0) & (in_tile < BLOCK_V)).to(gl.int32), axis=0) > 0:
            picked = gl.max(gl.where(cols[None, :] == in_tile[:, None], logits, float("-inf")), axis=1)
            target_raw = gl.maximum(target_raw, picked)

    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))
    out = partials_ptr + split * stride_split + offs_n
    gl.store(out, run_max * inv_temperature, mask=row_ok)
    gl.store(out + stride_stat, run_sumexp, mask=row_ok)
    gl.store(out + 2 * stride_stat, run_centred * inv_temperature, mask=row_ok)
    gl.store(out + 3 * stride_stat, target_raw * inv_temperature, mask=row_ok)


def launch_gluon(
    operand: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    partials: torch.Tensor,
    *,
    piece_rows: int,
    n_pieces: int,
    temperature: float,
    plan: SplitPlan,
    tiles: TritonTiles,
) -> None:
    """One launch over `targets.shape[0]` tokens: operand (n_pieces * piece_rows, d) pieces (or H), weight
    (V_local, d) of the same 16-bit dtype; writes partials (n_splits, 4, n_tokens)."""
    low = gl.bfloat16 if weight.dtype == torch.bfloat16 else gl.float16
    h_layout = gl.NVMMASharedLayout.get_default_for([tiles.block_n, tiles.block_k], low)
    w_layout = gl.NVMMASharedLayout.get_default_for([tiles.block_v, tiles.block_k], low)
    h_desc = TensorDescriptor.from_tensor(operand, [tiles.block_n, tiles.block_k], h_layout)
    w_desc = TensorDescriptor.from_tensor(weight, [tiles.block_v, tiles.block_k], w_layout)
    n_tokens = targets.shape[0]
    stage_bytes = (n_pieces * tiles.block_n + tiles.block_v) * tiles.block_k * weight.element_size()
    grid = (triton.cdiv(n_tokens, tiles.block_n) * plan.n_splits,)
    _fp32_head_gluon_kernel[grid](
        h_desc,
        w_desc,
        targets,
        partials,
        n_tokens,
        piece_rows,
        weight.shape[0],
        operand.shape[1],
        partials.stride(0),
        partials.stride(1),
        1.0 / temperature,
        plan.tiles_per_split,
        plan.n_splits,
        plan.group_blocks,
        N_PIECES=n_pieces,
        FRESH_STEPS=tiles.gluon_fresh_steps,
        FRESH_PER_GROUP=tiles.gluon_fresh_per_group,
        NUM_STAGES=min(tiles.num_stages, SHARED_BUDGET_BYTES // stage_bytes),
        num_warps=tiles.num_warps,
    )
