"""GPU checks of the direct FlashAttention call (skipped without CUDA): `pgdiag.model.attention` calls
``aten::_flash_attention_forward`` itself, not through `torch.nn.attention.varlen.varlen_attn` (whose custom op
imports dynamo at its first call). Its output must be the bits `varlen_attn` gave before: with the kv heads
repeated over each query group where that torch's `varlen_attn` has no ``enable_gqa`` (torch 2.11), with
``enable_gqa`` where it has, and the log-sum-exp the sinks path reads the same."""

from __future__ import annotations

import inspect

import pytest
import torch

from pgdiag.model import attention
from pgdiag.model.attention import PackedDocs, packed_attention, varlen_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not varlen_available(), reason="needs CUDA and varlen"
    ),
]
LENGTHS = [700, 17, 1, 1500, 64, 333]


def _inputs(hq: int, hkv: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedDocs]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = sum(LENGTHS)
    q, k, v = (torch.randn(n, h, dim, device="cuda", generator=gen).bfloat16() for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, PackedDocs.from_cu_seqlens(cu, n, torch.device("cuda"))


def _varlen_attn_as_before(q, k, v, docs, window, *, lse=False):  # type: ignore[no-untyped-def]
    """`varlen_attn` called as pgdiag called it before the direct call."""
    from torch.nn.attention import varlen as varlen_module

    params = inspect.signature(varlen_module.varlen_attn).parameters
    kwargs: dict[str, object] = {"window_size": (-1 if window is None else window - 1, 0)}
    k, v = attention._grouped_kv(q, k, v, params, kwargs)
    if lse:
        kwargs["return_aux"] = varlen_module.AuxRequest(lse=True)
    cu = docs.cu_seqlens
    return varlen_module.varlen_attn(q, k, v, cu, cu, docs.max_len, docs.max_len, **kwargs)


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize(("hq", "hkv", "dim"), [(32, 8, 128), (16, 16, 64)])
def test_direct_call_equals_varlen_attn_bit_for_bit(window: int | None, hq: int, hkv: int, dim: int) -> None:
    assert attention._flash_forward_op() is not None
    q, k, v, docs = _inputs(hq, hkv, dim)
    got = packed_attention(q, k, v, docs, window=window, backend="varlen")
    expected = _varlen_attn_as_before(q, k, v, docs, window)
    assert torch.equal(got, expected)
    group = hq // hkv  # the kv heads repeated by hand: still the same bits (the kernel reads head h // group)
    repeated = attention._flash_varlen(
        attention._flash_forward_op(),
        q,
        k.repeat_interleave(group, 1),
        v.repeat_interleave(group, 1),
        docs,
        window,
    )[0]
    assert torch.equal(got, repeated)


@pytest.mark.parametrize("window", [None, 128])
def test_direct_call_log_sum_exp_equals_varlen_attn(window: int | None) -> None:
    """The sinks path's log-sum-exp: (Hq, N) from the op, as `varlen_attn`'s ``return_aux`` gave it."""
    from torch.nn.attention import varlen as varlen_module

    if not hasattr(varlen_module, "AuxRequest"):
        pytest.skip("this torch's varlen_attn returns no log-sum-exp")
    q, k, v, docs = _inputs(32, 8, 64)
    out, lse = attention._flash_varlen(attention._flash_forward_op(), q, k, v, docs, window)
    expected_out, expected_lse = _varlen_attn_as_before(q, k, v, docs, window, lse=True)
    assert torch.equal(out, expected_out)
    expected_lse = expected_lse if expected_lse.shape == lse.shape else expected_lse.transpose(0, 1)
    assert torch.equal(lse, expected_lse)
    sinks = torch.randn(32, device="cuda")
    with_sinks = packed_attention(q, k, v, docs, window=window, backend="varlen", sinks=sinks)
    eager = packed_attention(q, k, v, docs, window=window, backend="sdpa", sinks=sinks)
    error = (with_sinks.double() - eager.double()).norm() / eager.double().norm()
    assert error < 1e-2, error  # bf16 against bf16 in another order; a wrong scale would be O(1)
