"""Parity of the native decoder with HF transformers on tiny random models of every supported architecture.

Reference: transformers' own forward (eager/sdpa, fp32) run on each document separately, then
`log_softmax` of its logits in fp64. Ours: one packed batch of several documents through `hidden_states`, then
`log_softmax(hidden @ lm_head_weight.T)` in fp64 (the kernel is tested on its own in tests/kernels). Bound:
1e-4 nats on every vocabulary entry of every position (fp32 trunks differ only by summation order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model

from pgdiag.kernels import lm_head_logprobs
from pgdiag.model import load_model

LENGTHS = [13, 7, 1, 10]  # packed documents, one of length 1

CASES = {
    "llama-gqa-llama3-untied": (
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500.0,
        },
    ),
    "llama-tied-bias": (
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-linear-rope": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-yarn": (
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "qwen2-bias": ("Qwen2ForCausalLM", {"num_key_value_heads": 1}),
    "qwen2-sliding-upper-layers": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    "qwen3-qknorm-headdim": ("Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 5}),
}


def hf_logprobs(hf: torch.nn.Module, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(N, V) fp64 log-softmax of HF logits, each document run on its own."""
    out, start = [], 0
    with torch.no_grad():
        for n in lengths:
            logits = hf(ids[start : start + n][None]).logits[0]  # (n, V)
            out.append(logits.double().log_softmax(-1))
            start += n
    return torch.cat(out)


def our_logprobs(model, ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    hidden = model.hidden_states(ids, pos, cu)  # (N, H)
    return (hidden.double() @ model.lm_head_weight.double().T).log_softmax(-1)  # (N, V)


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_logprobs_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    hf = save_hf_model(tmp_path, arch, **overrides)
    model = load_model(tmp_path, dtype="fp32", head_dtype="fp32")
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    ours = our_logprobs(model, ids, pos, cu)
    ref = hf_logprobs(hf, ids, LENGTHS)
    assert ours.shape == (sum(LENGTHS), 251)
    assert (ours - ref).abs().max().item() < 1e-4
    # the per-token logprob of the next token, the quantity pgdiag reports
    targets = torch.roll(ids, -1)
    assert (ours.gather(1, targets[:, None]) - ref.gather(1, targets[:, None])).abs().max().item() < 1e-4


def test_sliding_window_changes_the_result(tmp_path: Path) -> None:
    """Guards the window test above against a window that never binds: full attention gives other numbers."""
    save_hf_model(tmp_path / "w", "MistralForCausalLM", sliding_window=5)
    save_hf_model(tmp_path / "full", "MistralForCausalLM", sliding_window=None)
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    windowed = our_logprobs(load_model(tmp_path / "w", dtype="fp32"), ids, pos, cu)
    full = our_logprobs(load_model(tmp_path / "full", dtype="fp32"), ids, pos, cu)
    assert torch.equal(windowed[:5], full[:5])  # first 5 positions of doc 0 see the same keys
    assert (windowed[5:13] - full[5:13]).abs().max().item() > 1e-3


def test_packed_equals_unpacked(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    model = load_model(tmp_path, dtype="fp32")
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    packed = model.hidden_states(ids, pos, cu)
    start = 0
    for n in LENGTHS:
        alone = model.hidden_states(ids[start : start + n], pos[start : start + n], torch.tensor([0, n]))
        assert (packed[start : start + n] - alone).abs().max().item() < 1e-5  # matmul blocking differs with N
        start += n


def test_sharded_index_loads_like_single_file(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "single", "LlamaForCausalLM", seed=3)
    save_hf_model(tmp_path / "sharded", "LlamaForCausalLM", seed=3, shard_kb=20)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    single = load_model(tmp_path / "single", dtype="fp32")
    sharded = load_model(tmp_path / "sharded", dtype="fp32")
    assert torch.equal(single.hidden_states(ids, pos, cu), sharded.hidden_states(ids, pos, cu))
    assert torch.equal(single.lm_head_weight, sharded.lm_head_weight)


def test_bf16_export_matches_transformers_in_fp32(tmp_path: Path) -> None:
    """A bf16 export computed in fp32 (--dtype fp32) equals HF run in fp32 on the same bf16 weights."""
    hf = save_hf_model(tmp_path / "src", "Qwen2ForCausalLM")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_model(tmp_path / "bf16", dtype="fp32")
    assert model.load_warnings == ()
    # reload rather than hf.to(fp32): .to() also rounds HF's rotary inv_freq buffer through bf16
    hf_fp32 = type(hf).from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    diff = our_logprobs(model, ids, pos, cu) - hf_logprobs(hf_fp32, ids, LENGTHS)
    assert diff.abs().max().item() < 1e-4


def test_tied_head_shares_the_embedding_when_dtypes_match(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "Qwen3ForCausalLM", tie_word_embeddings=True)
    shared = load_model(tmp_path, dtype="fp32", head_dtype="fp32")
    assert shared.lm_head_weight.data_ptr() == shared.model.embed_tokens.weight.data_ptr()
    separate = load_model(tmp_path, dtype="bf16", head_dtype="fp32")
    assert separate.lm_head_weight.dtype == torch.float32
    assert torch.equal(separate.lm_head_weight, shared.lm_head_weight)  # read from the file, not from bf16


def test_fp32_head_of_a_bf16_checkpoint_keeps_the_stored_values(tmp_path: Path) -> None:
    """head_dtype fp32 on a bf16 export: the head stays bf16 (exact values; the kernel upcasts them), is shared
    with a tied bf16 embedding, and the fp32-head logprobs equal fp64 math on the upcast weights."""
    hf = save_hf_model(tmp_path / "src", "Qwen3ForCausalLM", tie_word_embeddings=True)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_model(tmp_path / "bf16", dtype="bf16", head_dtype="fp32")
    assert model.lm_head_weight.dtype == torch.bfloat16
    assert model.lm_head_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    fp32_body = load_model(tmp_path / "bf16", dtype="fp32", head_dtype="fp32")
    assert fp32_body.lm_head_weight.dtype == torch.bfloat16
    assert torch.equal(fp32_body.lm_head_weight.float(), model.lm_head_weight.float())
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    hidden = fp32_body.hidden_states(ids, pos, cu)  # (T, H) fp32
    targets = torch.randint(0, 251, (hidden.shape[0],), generator=torch.Generator().manual_seed(0))
    out = lm_head_logprobs(hidden, fp32_body.lm_head_weight, targets, head_dtype="fp32", impl="torch")
    want = (hidden.double() @ fp32_body.lm_head_weight.double().T).log_softmax(-1)
    assert out.head_mode == "fp32"
    torch.testing.assert_close(
        out.logprobs.double(), want.gather(1, targets[:, None])[:, 0], rtol=0, atol=2e-6
    )


def test_fp32_export_in_bf16_body_warns_and_stays_close(tmp_path: Path) -> None:
    hf = save_hf_model(tmp_path, "LlamaForCausalLM")
    model = load_model(tmp_path, dtype="bf16", head_dtype="fp32")
    assert [code for code, _ in model.load_warnings] == ["W607"]
    assert model.body_dtype == torch.bfloat16 and model.lm_head_weight.dtype == torch.float32
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    hidden = model.hidden_states(ids, pos, cu)
    assert hidden.dtype == torch.bfloat16
    ours = (hidden.double() @ model.lm_head_weight.double().T).log_softmax(-1)
    ref = hf_logprobs(hf, ids, LENGTHS)
    # bf16 body: per-token error of a few 1e-2 nats on these random weights, far from fp32 but bounded
    assert (ours - ref).abs().mean().item() < 0.1
