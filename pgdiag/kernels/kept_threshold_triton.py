"""Triton pass of the threshold bisection: counts and masses of a chunk's logits at S thresholds a row, one read.

What: `levels_triton(z, row_max, thresholds)` has the contract of `kept_threshold.levels_torch` (the plain-torch
reference beside it): for fp32 logits z (C, V), row maxima (C,) and ascending thresholds (C, S), the count
#{z >= t_s} (int64) and the mass Σ_{z >= t_s} exp(z - row_max) (fp64) at every threshold.

How: one program per (row, vocab split of `SPLIT_COLUMNS`); it walks its columns in BLOCK_V steps, compares
the (BLOCK_V,) logits with the row's (S,) thresholds as a (BLOCK_V, S) tile and sums the tile's columns
(counts in int32; masses in fp32 within a block of BLOCK_V terms, then in fp64 across blocks, so the sums stay
within ~1e-8 of the fp64 reference: the boundary decision adds them to fp64 window sums). The (C, splits, S)
partials are summed in int64 / fp64 by torch. Cost: one read of the chunk (4 bytes a logit) and ~4 S operations a
logit, no atomics, deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pgdiag.errors import Code, UsageError

BLOCK_V = 128
SPLIT_COLUMNS = 8192


@triton.jit
def _levels_kernel(
    z_ptr,  # (C, V) fp32 READ-ONLY, rows contiguous
    max_ptr,  # (C,) fp32 READ-ONLY
    t_ptr,  # (C, S) fp32 READ-ONLY, contiguous
    count_ptr,  # (C, splits, S) int32 OUT
    mass_ptr,  # (C, splits, S) fp64 OUT
    vocab,
    stride_z,
    n_splits,
    SPLIT: tl.constexpr,
    S: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    offs_s = tl.arange(0, S)
    t = tl.load(t_ptr + row * S + offs_s)  # (S,)
    m = tl.load(max_ptr + row)
    counts = tl.zeros([S], tl.int32)
    masses = tl.zeros([S], tl.float64)
    offs_v = tl.arange(0, BLOCK_V)
    base = split * SPLIT
    for start in range(0, SPLIT, BLOCK_V):
        cols = base + start + offs_v  # (BLOCK_V,)
        ok = cols < vocab
        z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=float("-inf"))
        e = tl.where(ok, tl.exp(z - m), 0.0)
        ge = (z[:, None] >= t[None, :]) & ok[:, None]  # (BLOCK_V, S)
        counts += tl.sum(ge.to(tl.int32), axis=0)
        masses += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0).to(tl.float64)
    out = (row * n_splits + split) * S + offs_s
    tl.store(count_ptr + out, counts)
    tl.store(mass_ptr + out, masses)


def levels_triton(
    z: torch.Tensor, row_max: torch.Tensor, thresholds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """((C, S) int64 counts, (C, S) fp64 masses): the contract of `kept_threshold.levels_torch`."""
    if z.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise UsageError(
            Code.DEVICE_UNAVAILABLE, f"levels_triton needs CUDA tensors (got {z.device}); use levels_torch"
        )
    n_rows, vocab = z.shape
    n_levels = thresholds.shape[1]
    z = z if z.stride(1) == 1 else z.contiguous()
    n_splits = triton.cdiv(vocab, SPLIT_COLUMNS)
    counts = torch.empty(n_rows, n_splits, n_levels, dtype=torch.int32, device=z.device)
    masses = torch.empty(n_rows, n_splits, n_levels, dtype=torch.float64, device=z.device)
    if n_rows == 0:
        return counts.sum(1).long(), masses.sum(1).double()
    _levels_kernel[(n_rows, n_splits)](
        z,
        row_max.float().contiguous(),
        thresholds.float().contiguous(),
        counts,
        masses,
        vocab,
        z.stride(0),
        n_splits,
        SPLIT=SPLIT_COLUMNS,
        S=n_levels,
        BLOCK_V=BLOCK_V,
    )
    return counts.long().sum(1), masses.sum(1)
