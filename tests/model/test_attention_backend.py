"""Attention backend resolution: FlashAttention varlen only for a 16-bit body on CUDA (it has no fp32 kernel).

Seen on two H200s: `pgdiag logprobs --dtype fp32` resolved `auto` to varlen and died inside FlashAttention.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pgdiag.errors import UsageError
from pgdiag.model import attention


@pytest.fixture
def varlen_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "varlen_available", lambda: True)


def test_auto_picks_varlen_only_for_16_bit_bodies_on_cuda(varlen_present: None) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attention.resolve_attention_backend("auto", cuda, torch.bfloat16) == "varlen"
    assert attention.resolve_attention_backend("auto", cuda, torch.float16) == "varlen"
    assert attention.resolve_attention_backend("auto", cuda, torch.float32) == "sdpa"
    assert attention.resolve_attention_backend("auto", cpu, torch.bfloat16) == "sdpa"


def test_explicit_varlen_with_fp32_is_a_usage_error(varlen_present: None) -> None:
    with pytest.raises(UsageError) as info:
        attention.resolve_attention_backend("varlen", torch.device("cuda"), torch.float32)
    assert info.value.code == "E508" and "16-bit" in info.value.message
    with pytest.raises(UsageError, match="unknown attention backend"):
        attention.resolve_attention_backend("flash", torch.device("cuda"), torch.bfloat16)


def _fake_varlen(monkeypatch: pytest.MonkeyPatch, *, gqa: bool) -> list[tuple[int, int, dict]]:
    """Replace `varlen_attn` with a stand-in (with or without ``enable_gqa``) that records what it was given and
    answers per-document causal SDPA over the heads it received."""
    import torch.nn.attention.varlen as varlen_module

    seen: list[tuple[int, int, dict]] = []

    def answer(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append((k.shape[1], v.shape[1], kwargs))
        docs = attention.PackedDocs.from_cu_seqlens(cu_q, q.shape[0], q.device)
        return attention._sdpa_per_document(q, k, v, docs, None)

    if gqa:

        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
            return answer(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, enable_gqa=enable_gqa)
    else:

        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
            return answer(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size)

    monkeypatch.setattr(varlen_module, "varlen_attn", fake)
    return seen


@pytest.mark.parametrize("gqa", [True, False])
def test_varlen_grouped_query_heads_match_sdpa(monkeypatch: pytest.MonkeyPatch, gqa: bool) -> None:
    """The fallback through `varlen_attn` (a torch whose FlashAttention op lacks the window arguments): 4 query
    heads over 2 kv heads, passed as they are with ``enable_gqa``, else each kv head repeated twice; either way
    the output equals SDPA's per document."""
    monkeypatch.setattr(attention, "_flash_forward_op", lambda: None)
    seen = _fake_varlen(monkeypatch, gqa=gqa)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 8, generator=gen)  # (N, Hq, D)
    k = torch.randn(7, 2, 8, generator=gen)  # (N, Hkv, D)
    v = torch.randn(7, 2, 8, generator=gen)
    docs = attention.PackedDocs.from_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32), 7, q.device)
    out = attention._varlen(q, k, v, docs, None)
    assert seen[0][:2] == ((2, 2) if gqa else (4, 4))
    assert seen[0][2].get("enable_gqa", False) is gqa
    assert seen[0][2]["window_size"] == (-1, 0)
    torch.testing.assert_close(out, attention._sdpa_per_document(q, k, v, docs, None), rtol=0, atol=0)


class FlashOpStandIn:
    """Stands in for ``torch.ops.aten._flash_attention_forward`` (the packet and its ``.default``) on the CPU:
    records each call by the real op's argument names (None-valued ones dropped: the op's defaults are None) and
    answers what FlashAttention computes, in fp32: per document, causal within the window, the output (N, Hq, D)
    and the log-sum-exp (Hq, N), kv head ``h // (Hq / Hkv)`` for query head h."""

    def __init__(self) -> None:
        self.default = self
        self._schema = torch.ops.aten._flash_attention_forward.default._schema
        self.calls: list[dict[str, object]] = []

    def __call__(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        names = [argument.name for argument in self._schema.arguments]
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        self.calls.append({k: _comparable(v) for k, v in call.items() if v is not None})
        q, k, v, cu = call["query"], call["key"], call["value"], call["cum_seq_q"]
        left, right = call["window_size_left"], call["window_size_right"]
        assert call["dropout_p"] == 0.0 and (not call["is_causal"] or right in (0, -1))
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0])
        for start, stop in zip(cu.tolist(), cu.tolist()[1:], strict=False):
            i = torch.arange(stop - start)
            diff = i[:, None] - i[None, :]  # (L, L) query position minus key position
            allowed = diff >= (0 if call["is_causal"] or right == 0 else -(10**9))
            if left >= 0:
                allowed &= diff <= left
            qd = q[start:stop].transpose(0, 1).float()  # (Hq, L, D)
            kd = k[start:stop].transpose(0, 1).float().repeat_interleave(group, dim=0)
            vd = v[start:stop].transpose(0, 1).float().repeat_interleave(group, dim=0)
            logits = (qd @ kd.transpose(1, 2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
            lse[:, start:stop] = torch.logsumexp(logits, dim=-1)
            out[start:stop] = (torch.softmax(logits, dim=-1) @ vd).transpose(0, 1).to(q.dtype)
        unused = torch.empty(0)
        return out, lse, torch.zeros(2, dtype=torch.uint64), unused, unused


def _comparable(value: object) -> object:
    return ("tensor", value.data_ptr(), tuple(value.shape)) if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("window", [None, 3])
def test_direct_flash_call_is_the_one_varlen_attn_makes(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """The real thing: torch's own `varlen_attn` (its custom op's body, run on the CPU) and pgdiag's direct call
    hand FlashAttention's op the same arguments, GQA heads as they are (torch 2.13's ``enable_gqa``) and the
    window as ``window_size=(window - 1, 0)``; so the kernel, and its output, are the same. And pgdiag returns
    the op's output."""
    import torch.nn.attention.varlen as varlen_module

    if "enable_gqa" not in inspect.signature(varlen_module.varlen_attn).parameters:
        pytest.skip("this torch's varlen_attn has no enable_gqa (torch 2.11: the GPU test compares the bits)")
    op = FlashOpStandIn()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", op)
    assert attention._flash_forward_op() is op
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 8, generator=gen)  # (N, Hq, D)
    k = torch.randn(9, 2, 8, generator=gen)  # (N, Hkv, D)
    v = torch.randn(9, 2, 8, generator=gen)
    docs = attention.PackedDocs.from_cu_seqlens(torch.tensor([0, 4, 9], dtype=torch.int32), 9, q.device)
    window_size = (-1 if window is None else window - 1, 0)
    expected = varlen_module.varlen_attn(
        q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len,
        window_size=window_size, enable_gqa=True,
    )  # fmt: skip
    got = attention._varlen(q, k, v, docs, window)
    assert len(op.calls) == 2 and op.calls[1] == op.calls[0], op.calls
    assert op.calls[1]["is_causal"] is (window is None) and op.calls[1]["window_size_left"] == window_size[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    reference = attention._sdpa_per_document(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), docs, window
    )
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_direct_flash_call_with_sinks_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention sinks on the direct path: the op's log-sum-exp (Hq, N) rescales the output as HF's eager
    gpt-oss attention (the sink appended to each softmax) computes it."""
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", FlashOpStandIn())
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(7, 4, 8, generator=gen)  # (N, Hq, D)
    k = torch.randn(7, 2, 8, generator=gen)
    v = torch.randn(7, 2, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)  # (Hq,)
    docs = attention.PackedDocs.from_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32), 7, q.device)
    for window in (None, 2):
        got = attention.packed_attention(q, k, v, docs, window=window, backend="varlen", sinks=sinks)
        expected = attention._eager_sinks(q, k, v, docs, window, sinks)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_op_is_used_only_with_its_window_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch's op takes the window sizes (so it is called directly); an op without them, or ROCm's, is not."""
    assert attention._flash_forward_op() is torch.ops.aten._flash_attention_forward.default
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert attention._flash_forward_op() is None
