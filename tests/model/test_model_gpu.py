"""GPU checks of the model (skipped without CUDA): the varlen attention backend equals per-document SDPA, and
fp32 on the GPU matches HF transformers like on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model

from pgdiag.model import load_model
from pgdiag.model.attention import PackedDocs, packed_attention, varlen_available

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LENGTHS = [300, 17, 1, 520, 64]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_cuda
@pytest.mark.skipif(not varlen_available(), reason="torch.nn.attention.varlen not in this torch")
@pytest.mark.parametrize("window", [None, 40])
def test_varlen_and_sdpa_are_bf16_close_to_fp32(tmp_path: Path, window: int | None) -> None:
    """Both bf16 backends against the fp32 SDPA path (which matches HF within 1e-4): varlen no worse than
    per-document SDPA. These random 0.2-std weights amplify bf16 rounding (measured on an H100: 4-5% relative
    for both backends), so the bound is relative to SDPA's own error; a masking bug would be O(1)."""
    save_hf_model(tmp_path, "MistralForCausalLM", sliding_window=window, num_key_value_heads=1, head_dim=64,
                  hidden_size=128, num_attention_heads=4)  # fmt: skip
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    ids, pos = ids.cuda(), pos.cuda()
    ref = load_model(tmp_path, dtype="fp32", device="cuda", attention="sdpa").hidden_states(ids, pos, cu)
    errors = {}
    for backend in ("varlen", "sdpa"):
        model = load_model(tmp_path, dtype="bf16", device="cuda", attention=backend)
        errors[backend] = rel_err(model.hidden_states(ids, pos, cu), ref)
    print(f"window={window} relative error vs fp32: {errors}")
    assert errors["sdpa"] < 0.1 and errors["varlen"] < 0.1
    assert errors["varlen"] < 1.25 * errors["sdpa"]


@needs_cuda
@pytest.mark.skipif(not varlen_available(), reason="torch.nn.attention.varlen not in this torch")
@pytest.mark.parametrize("window", [None, 40])
def test_varlen_attention_equals_fp32_per_document(window: int | None) -> None:
    """The attention op alone on random q/k/v (GQA 8 -> 2 heads): bf16 varlen vs fp32 per-document SDPA."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(LENGTHS)
    q = torch.randn(n, 8, 64, device="cuda", generator=g)
    k = torch.randn(n, 2, 64, device="cuda", generator=g)
    v = torch.randn(n, 2, 64, device="cuda", generator=g)
    _, _, cu = packed_inputs(LENGTHS, 251)
    docs = PackedDocs.from_cu_seqlens(cu, n, torch.device("cuda"))
    ref = packed_attention(q, k, v, docs, window=window, backend="sdpa")
    bf = [t.bfloat16() for t in (q, k, v)]
    got = packed_attention(*bf, docs, window=window, backend="varlen")
    err = rel_err(got, ref)
    print(f"window={window} varlen vs fp32 relative error {err:.2e}")
    assert err < 1e-2


@needs_cuda
def test_fp32_matches_transformers_on_gpu(tmp_path: Path) -> None:
    hf = save_hf_model(tmp_path, "Qwen3ForCausalLM", head_dim=16).cuda()
    model = load_model(tmp_path, dtype="fp32", head_dtype="fp32", device="cuda", attention="sdpa")
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    hidden = model.hidden_states(ids.cuda(), pos.cuda(), cu)
    ours = (hidden.double() @ model.lm_head_weight.double().T).log_softmax(-1)
    start = 0
    with torch.no_grad():
        for n in LENGTHS:
            ref = hf(ids[start : start + n][None].cuda()).logits[0].double().log_softmax(-1)
            assert (ours[start : start + n] - ref).abs().max().item() < 1e-4
            start += n


@needs_cuda
def test_fused_pointwise_equals_eager(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "Qwen3ForCausalLM", head_dim=64, hidden_size=128)
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    ids, pos = ids.cuda(), pos.cuda()
    eager = load_model(tmp_path, dtype="bf16", device="cuda")
    fused = load_model(tmp_path, dtype="bf16", device="cuda", fuse_pointwise=True)
    a = eager.hidden_states(ids, pos, cu).float()
    b = fused.hidden_states(ids, pos, cu).float()
    assert ((a - b).norm() / a.norm()).item() < 1e-3  # the same roundings; only FMA contraction may differ
