"""RMSNorm, RoPE and SwiGLU of the decoder as Triton kernels, one pass each, for CUDA tensors.

What: `rms_norm_triton`, `rms_norm_fp32_weight_triton`, `apply_rope_triton` and `swiglu_triton` compute the same
functions as `pgdiag.model.transformer.rms_norm`, `rms_norm_fp32_weight`, `apply_rope` and `swiglu` (their
plain-torch references), with every rounding of the eager code: RoPE's two products and their sum are each
rounded to the input's dtype, SwiGLU rounds ``silu(gate)`` before the product, and RMSNorm casts the normalised
row back before the weight (or after it, the fp32-weight form). RoPE and SwiGLU equal the eager functions bit for
bit (silu is ``x / (1 + exp(-x))`` with the full-precision exponential and an IEEE division, as PyTorch's CUDA
kernel computes it; no multiply-add is fused). RMSNorm sums the squares in another order than PyTorch's reduction,
so its fp32 statistic can differ in the last bits (tests/model/test_pointwise_triton.py bounds it).

Why: `torch.compile` made these one kernel each, but every process paid dynamo's and Inductor's imports, the
tracing of each function and the guards (about 6 s of a warm 16 s start on an H200: docs/benchmarks.md, "Start-up:
the warm fixed cost"); these kernels load from Triton's cache in milliseconds.

How: RMSNorm: one program per block of rows (``(rows, D)``: the whole row in registers, the sum of squares by
`tl.sum`). RoPE: one program per block of (token, head) rows of ``x (N, heads, D)``, the two halves of each row
and the token's cos/sin halves loaded apart. SwiGLU: a 2-D grid over ``(rows, columns)``; gate and up may be
row-strided views (the halves of the MoE experts' gate/up GEMM output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_ELEMENTS = 4096  # per program: rows x columns held at once
_NO_FMA = {"enable_fp_fusion": False}  # every product rounded before the sum, as the eager kernels compute it


@triton.jit(do_not_specialize=["n_rows"])  # one kernel for every token count
def _rms_norm_kernel(
    x_ptr,  # (R, D) contiguous, READ-ONLY
    w_ptr,  # (D,), READ-ONLY
    out_ptr,  # (R, D) x's dtype, OUT
    n_rows,
    dim,
    inv_dim,  # 1 / D as fp32 (PyTorch's mean multiplies by it)
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,  # weight times the fp32 row, one cast (gpt-oss); else cast, then weight
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_ok = cols < dim
    ok = (rows < n_rows)[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    mean = tl.sum(x * x, axis=1) * inv_dim  # (ROWS,)
    scaled = x * tl.rsqrt(mean + eps)[:, None]
    weight = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if not WEIGHT_FP32:
        scaled = scaled.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (weight * scaled).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_rows"])  # one kernel for every token count
def _rope_kernel(
    x_ptr,  # (N * heads, D) contiguous, READ-ONLY
    cos_ptr,  # (N, D) contiguous, READ-ONLY
    sin_ptr,  # (N, D) contiguous, READ-ONLY
    out_ptr,  # (N * heads, D), OUT
    n_rows,
    heads,
    HALF: tl.constexpr,  # D / 2
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,) token * heads + head
    cols = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,)
    ok = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
    dtype = out_ptr.dtype.element_ty
    first = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    angle = (rows // heads).to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    a = tl.load(x_ptr + first, mask=ok, other=0.0).to(tl.float32)  # x[..., :D/2]
    b = tl.load(x_ptr + first + HALF, mask=ok, other=0.0).to(tl.float32)  # x[..., D/2:]
    cos_a = tl.load(cos_ptr + angle, mask=ok, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + angle + HALF, mask=ok, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + angle, mask=ok, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + angle + HALF, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a): each product and the sum rounded to the dtype
    out_a = (a * cos_a).to(dtype).to(tl.float32) + ((-b) * sin_a).to(dtype).to(tl.float32)
    out_b = (b * cos_b).to(dtype).to(tl.float32) + (a * sin_b).to(dtype).to(tl.float32)
    tl.store(out_ptr + first, out_a.to(dtype), mask=ok)
    tl.store(out_ptr + first + HALF, out_b.to(dtype), mask=ok)


@triton.jit(do_not_specialize=["n_rows"])  # one kernel for every token count
def _swiglu_kernel(
    gate_ptr,  # (R, C) row stride gate_stride, columns contiguous, READ-ONLY
    up_ptr,  # (R, C) row stride up_stride, READ-ONLY
    out_ptr,  # (R, C) contiguous, OUT
    n_rows,
    n_cols,
    gate_stride,
    up_stride,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PRECISE_EXP: tl.constexpr,  # libdevice's expf (PyTorch's); the interpreter has only tl.exp
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + rows[:, None] * gate_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + rows[:, None] * up_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if PRECISE_EXP:  # noqa: SIM108 (a constexpr branch: the interpreter never sees libdevice)
        decay = libdevice.exp(-gate)
    else:
        decay = tl.exp(-gate)
    silu = tl.div_rn(gate, 1.0 + decay).to(dtype).to(tl.float32)  # F.silu as PyTorch's kernel, rounded
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (silu * up).to(dtype), mask=ok)


def _rows_per_program(width: int) -> int:
    return max(1, _ELEMENTS // width)


def _norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_fp32: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()  # (R, D)
    if out is None:
        out = torch.empty_like(rows)
    elif out.shape != x.shape or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        per = _rows_per_program(block)
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], per),)](
            rows, weight.contiguous(), out, rows.shape[0], dim, 1.0 / dim, eps,
            ROWS=per, BLOCK_D=block, WEIGHT_FP32=weight_fp32, num_warps=8 if per * block >= 4096 else 4, **_NO_FMA,
        )  # fmt: skip
    return out.view(x.shape)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`transformer.rms_norm`: x (..., D), weight (D,) of x's dtype -> (..., D), written into `out` (contiguous,
    x's shape and dtype) when given."""
    return _norm(x, weight, eps, weight_fp32=False, out=out)


def rms_norm_fp32_weight_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`transformer.rms_norm_fp32_weight`: x (..., D), weight (D,) of x's dtype -> (..., D), into `out` if given."""
    return _norm(x, weight, eps, weight_fp32=True, out=out)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`transformer.apply_rope`: x (N, heads, D), cos/sin (N, 1, D), all one dtype, D even -> (N, heads, D)."""
    n, heads, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        half = dim // 2
        block = triton.next_power_of_2(half)
        per = _rows_per_program(2 * block)
        _rope_kernel[(triton.cdiv(n * heads, per),)](
            x, cos.reshape(n, dim).contiguous(), sin.reshape(n, dim).contiguous(), out, n * heads, heads,
            HALF=half, ROWS=per, BLOCK_HALF=block, num_warps=4, **_NO_FMA,
        )  # fmt: skip
    return out


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`transformer.swiglu`: silu(gate) * up for gate, up (..., C) of one dtype (2-D row-strided views, such as
    the halves of one GEMM output, are read in place) -> gate's shape, contiguous."""
    shape = gate.shape
    if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.reshape(-1, shape[-1]).contiguous(), up.reshape(-1, shape[-1]).contiguous()
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(cols))
        per = _rows_per_program(block)
        _swiglu_kernel[(triton.cdiv(rows, per), triton.cdiv(cols, block))](
            gate, up, out, rows, cols, gate.stride(0), up.stride(0), ROWS=per, BLOCK_C=block,
            PRECISE_EXP=not triton.knobs.runtime.interpret, num_warps=4, **_NO_FMA,
        )  # fmt: skip
    return out.view(shape)
