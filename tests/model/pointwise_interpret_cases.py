"""`pgdiag.model.pointwise_triton` under the Triton interpreter (TRITON_INTERPRET=1) on the CPU, against the
plain-torch references of `pgdiag.model.transformer`.

Not collected by the main test run: `test_pointwise_triton.py` runs this file in a child pytest with the
interpreter switched on. fp16 and fp32 (the interpreter's bf16 is not trusted); the bf16 bit-for-bit checks on a
GPU are in `test_pointwise_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from pgdiag.model import pointwise_triton as kernels
from pgdiag.model.transformer import apply_rope, rms_norm, rms_norm_fp32_weight, swiglu

DTYPES = [torch.float32, torch.float16]


def test_interpreter_is_on() -> None:
    assert triton.knobs.runtime.interpret


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of b's dtype spacing at |b|."""
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return ((a.float() - b.float()).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 16), (2, 70)], ids=str)
@pytest.mark.parametrize("fp32_weight", [False, True], ids=["cast_then_weight", "fp32_weight"])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...], fp32_weight: bool) -> None:
    x, w = _rand(*shape, dtype=dtype), _rand(shape[-1], dtype=dtype, seed=1)
    ours = (kernels.rms_norm_fp32_weight_triton if fp32_weight else kernels.rms_norm_triton)(x, w, 1e-6)
    ref = (rms_norm_fp32_weight if fp32_weight else rms_norm)(x, w, 1e-6)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    # the sum of squares in another order and another rsqrt: the fp32 statistic may differ in its last bits, so
    # a fp16 result by at most one rounding step, a fp32 one by a few of its own
    assert _ulps(ours, ref) <= (1.0 if dtype == torch.float16 else 4.0)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.double()
    assert (ours.double() - exact).abs().max().item() < 4 * torch.finfo(dtype).eps * exact.abs().max().item()


def test_rms_norm_worked_example() -> None:
    """x = (3, 4): rms = sqrt(12.5), so x / rms = (0.8485, 1.1314); times w = (2, -1)."""
    x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([2.0, -1.0])
    out = kernels.rms_norm_triton(x, w, 0.0)
    assert torch.allclose(out, torch.tensor([[2 * 3 / 12.5**0.5, -4 / 12.5**0.5]]), rtol=1e-6)


@pytest.mark.parametrize("fp32_weight", [False, True], ids=["cast_then_weight", "fp32_weight"])
def test_rms_norm_into_rows_of_a_buffer(fp32_weight: bool) -> None:
    """`out=`: the rows 2:5 of a larger buffer get exactly what the kernel returns on its own, the others stay (the
    sharded residual normalises its piece of a chunk straight into the gather buffer)."""
    norm = kernels.rms_norm_fp32_weight_triton if fp32_weight else kernels.rms_norm_triton
    x, w = _rand(3, 48, dtype=torch.float16), _rand(48, dtype=torch.float16, seed=1)
    buffer = torch.full((7, 48), 5.0, dtype=torch.float16)
    returned = norm(x, w, 1e-6, out=buffer[2:5])
    assert returned.data_ptr() == buffer[2:5].data_ptr()
    assert torch.equal(buffer[2:5], norm(x, w, 1e-6))
    assert (buffer[:2] == 5).all() and (buffer[5:] == 5).all()
    with pytest.raises(ValueError, match="contiguous"):
        norm(x, w, 1e-6, out=buffer[:, :48:2][:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "heads", "dim"), [(7, 3, 16), (1, 1, 2), (5, 2, 24)], ids=str)
def test_rope_equals_the_reference(dtype: torch.dtype, n: int, heads: int, dim: int) -> None:
    x = _rand(n, heads, dim, dtype=dtype)
    cos, sin = _rand(n, 1, dim, dtype=dtype, seed=1), _rand(n, 1, dim, dtype=dtype, seed=2)
    ours, ref = kernels.apply_rope_triton(x, cos, sin), apply_rope(x, cos, sin)
    assert ours.dtype == ref.dtype
    assert torch.equal(ours, ref)  # each product and the sum rounded as the reference rounds them


def test_rope_worked_example() -> None:
    """D = 2: (a, b) -> (a cos - b sin, b cos + a sin), a rotation by the angle."""
    x = torch.tensor([[[1.0, 2.0]]])
    cos, sin = torch.full((1, 1, 2), 0.5), torch.full((1, 1, 2), 0.25)
    assert torch.equal(kernels.apply_rope_triton(x, cos, sin), torch.tensor([[[0.0, 1.25]]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_equals_the_reference(dtype: torch.dtype) -> None:
    gate, up = _rand(6, 40, dtype=dtype), _rand(6, 40, dtype=dtype, seed=1)
    ours, ref = kernels.swiglu_triton(gate, up), swiglu(gate, up)
    assert ours.dtype == ref.dtype
    # fp16: equal (the rounding hides the exponentials' last bits); fp32: numpy's exp here against torch's
    assert _ulps(ours, ref) <= (0.0 if dtype == torch.float16 else 4.0)


def test_swiglu_of_row_strided_halves_and_ranks() -> None:
    """The MoE experts' gate/up halves of one (M, 2I) output are read in place; 3-D inputs keep their shape."""
    h = _rand(6, 80, dtype=torch.float32)
    gate, up = h.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    assert torch.allclose(kernels.swiglu_triton(gate, up), F.silu(gate) * up, rtol=1e-6, atol=0)
    g3, u3 = _rand(2, 3, 8, dtype=torch.float32), _rand(2, 3, 8, dtype=torch.float32, seed=1)
    out = kernels.swiglu_triton(g3, u3)
    assert out.shape == (2, 3, 8) and torch.allclose(out, F.silu(g3) * u3, rtol=1e-6, atol=0)


def test_swiglu_worked_example() -> None:
    """silu(0) = 0, silu(x) -> x for large x; times up."""
    gate, up = torch.tensor([[0.0, 30.0, -30.0]]), torch.tensor([[5.0, 2.0, 3.0]])
    out = kernels.swiglu_triton(gate, up)
    assert out[0, 0] == 0 and out[0, 1] == 60.0 and abs(out[0, 2].item()) < 1e-11


def test_empty_inputs() -> None:
    assert kernels.rms_norm_triton(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    assert kernels.apply_rope_triton(
        torch.zeros(0, 2, 8), torch.zeros(0, 1, 8), torch.zeros(0, 1, 8)
    ).shape == (0, 2, 8)
    assert kernels.swiglu_triton(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)
