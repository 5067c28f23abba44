"""Attention backend resolution: FlashAttention varlen only for a 16-bit body on CUDA (it has no fp32 kernel).

Seen on two H200s: `pgdiag logprobs --dtype fp32` resolved `auto` to varlen and died inside FlashAttention.
"""

from __future__ import annotations

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
    """4 query heads over 2 kv heads: passed as they are with ``enable_gqa``, else each kv head repeated twice;
    either way the output equals SDPA's per document."""
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
