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
