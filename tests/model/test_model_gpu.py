"""GPU checks of the model (skipped without CUDA): the varlen attention backend equals per-document SDPA, and
fp32 on the GPU matches HF transformers like on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model

from pgdiag.model import load_model
from pgdiag.model.attention import varlen_available

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LENGTHS = [300, 17, 1, 520, 64]


@needs_cuda
@pytest.mark.skipif(not varlen_available(), reason="torch.nn.attention.varlen not in this torch")
@pytest.mark.parametrize("window", [None, 40])
def test_varlen_equals_sdpa_per_document(tmp_path: Path, window: int | None) -> None:
    save_hf_model(tmp_path, "MistralForCausalLM", sliding_window=window, num_key_value_heads=1, head_dim=64,
                  hidden_size=128, num_attention_heads=4)  # fmt: skip
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    ids, pos = ids.cuda(), pos.cuda()
    varlen = load_model(tmp_path, dtype="bf16", device="cuda", attention="varlen")
    sdpa = load_model(tmp_path, dtype="bf16", device="cuda", attention="sdpa")
    a = varlen.hidden_states(ids, pos, cu).float()
    b = sdpa.hidden_states(ids, pos, cu).float()
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 1e-2  # bf16 operands, different kernels and summation orders


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
