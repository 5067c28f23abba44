"""MoE parity with HF transformers (fp32, 1e-4 nats on every vocabulary entry), packed = unpacked, loop = grouped,
MXFP4 expert weights dequantized as transformers does, and the config-level features binding (sinks, clamp,
dense layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_tiny import build_hf_model, packed_inputs, save_hf_model
from moe_tiny import MOE_CASES
from safetensors.torch import load_file, save_file
from test_model_parity import LENGTHS, hf_logprobs, our_logprobs

from pgdiag.errors import UsageError
from pgdiag.model import load_model, read_model_config
from pgdiag.model.hf_experts import dequantize_mxfp4
from pgdiag.model.moe import different_sets, expert_outputs, resolve_expert_impl, route, silu_glu


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_fp32_logprobs_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = MOE_CASES[case]
    hf = save_hf_model(tmp_path, arch, **overrides)
    model = load_model(tmp_path, dtype="fp32", head_dtype="fp32")
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    ours = our_logprobs(model, ids, pos, cu)
    ref = hf_logprobs(hf, ids, LENGTHS)
    assert (ours - ref).abs().max().item() < 1e-4
    # the routing is not degenerate: most experts of every sparse layer get tokens
    topk = model.forward_packed(ids, pos, cu).router_topk  # (N, L_sparse, k)
    config = model.config.moe
    assert topk.shape == (sum(LENGTHS), len(config.sparse_layer_indices), config.top_k)
    for layer in range(topk.shape[1]):
        assert torch.unique(topk[:, layer]).numel() >= config.num_experts * 3 // 4


def test_sparse_layers_follow_mlp_only_layers_and_step(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "a", MOE_CASES["qwen3-moe"][0], **MOE_CASES["qwen3-moe"][1])
    save_hf_model(
        tmp_path / "b", *MOE_CASES["qwen3-moe-sparse-step"][:1], **MOE_CASES["qwen3-moe-sparse-step"][1]
    )
    assert read_model_config(tmp_path / "a").moe.sparse_layers == (True, False)
    assert read_model_config(tmp_path / "b").moe.sparse_layers == (False, True, False, True)


@pytest.mark.parametrize("case", ["qwen3-moe", "qwen2-moe-shared", "mixtral-sliding", "gpt-oss"])
def test_active_params_count_what_a_token_multiplies(tmp_path: Path, case: str) -> None:
    """non_embedding_params = HF's parameter count minus the embedding; active = that minus the unchosen experts."""
    arch, overrides = MOE_CASES[case]
    hf = save_hf_model(tmp_path, arch, **overrides)
    config = read_model_config(tmp_path)
    total = sum(p.numel() for p in hf.parameters()) - hf.model.embed_tokens.weight.numel()
    assert config.non_embedding_params() == total
    moe = config.moe
    i, h = moe.expert_intermediate_size, config.hidden_size
    per_expert = 3 * h * i + (2 * i + h if moe.expert_bias else 0)
    unchosen = (moe.num_experts - moe.top_k) * per_expert * len(moe.sparse_layer_indices)
    assert config.active_params() == total - unchosen


def test_packed_equals_unpacked(tmp_path: Path) -> None:
    arch, overrides = MOE_CASES["gpt-oss"]
    save_hf_model(tmp_path, arch, **overrides)
    model = load_model(tmp_path, dtype="fp32")
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    packed = model.forward_packed(ids, pos, cu)
    start = 0
    for n in LENGTHS:
        alone = model.forward_packed(ids[start : start + n], pos[start : start + n], torch.tensor([0, n]))
        assert (packed.hidden[start : start + n] - alone.hidden).abs().max().item() < 1e-5
        assert torch.equal(packed.router_topk[start : start + n], alone.router_topk)
        start += n


def test_sinks_and_clamp_bind(tmp_path: Path) -> None:
    """Guards the gpt-oss parity: without the sinks, or with a looser clamp, the numbers change."""
    arch, overrides = MOE_CASES["gpt-oss"]
    save_hf_model(tmp_path / "a", arch, **overrides)
    save_hf_model(tmp_path / "b", arch, **{**overrides, "swiglu_limit": 7.0})
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    model = load_model(tmp_path / "a", dtype="fp32")
    base = model.hidden_states(ids, pos, cu)
    loose = load_model(tmp_path / "b", dtype="fp32").hidden_states(ids, pos, cu)
    assert (base - loose).abs().max().item() > 1e-2
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # a sink that never takes any weight = plain attention
    assert (model.hidden_states(ids, pos, cu) - base).abs().max().item() > 1e-2


def test_grouped_equals_loop_on_cpu(tmp_path: Path) -> None:
    """The grouped GEMM path (torch's grouped matmul, CPU fallback here) equals the per-expert loop."""
    if resolve_expert_impl("auto", torch.device("cpu"), torch.float32) != "loop":
        pytest.fail("auto must pick the loop on the CPU")
    g = torch.Generator().manual_seed(0)
    n, h, i, e, k = 37, 32, 16, 6, 2
    x = torch.randn(n, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    biases = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    logits = torch.randn(n, e, generator=g)
    from pgdiag.model.config import MoeConfig

    moe = MoeConfig(
        e, k, i, "softmax_topk", True, False, False, "silu", 0.0, 0.0, 0, (True,), "mixtral", False
    )
    weights, experts = route(logits, moe)
    for start, n_local in ((0, e), (2, 2)):  # all experts, and a TP rank owning experts 2 and 3
        ref = expert_outputs(x, experts, weights, gate_up[start : start + n_local], down[start : start + n_local],
                             glu=silu_glu, expert_start=start, gate_up_bias=biases[0][start : start + n_local],
                             down_bias=biases[1][start : start + n_local], impl="loop")  # fmt: skip
        got = expert_outputs(x, experts, weights, gate_up[start : start + n_local], down[start : start + n_local],
                             glu=silu_glu, expert_start=start, gate_up_bias=biases[0][start : start + n_local],
                             down_bias=biases[1][start : start + n_local], impl="grouped")  # fmt: skip
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the loop against a dense per-token reference: sum_j w_j * expert_j(x)
    want = torch.zeros(n, h, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            ex = int(experts[t, j])
            hh = gate_up[ex].double() @ x[t].double() + biases[0][ex].double()
            inner = torch.nn.functional.silu(hh[:i]) * hh[i:]
            want[t] += weights[t, j].double() * (down[ex].double() @ inner + biases[1][ex].double())
    got = expert_outputs(x, experts, weights, gate_up, down, glu=silu_glu, gate_up_bias=biases[0],
                         down_bias=biases[1], impl="loop")  # fmt: skip
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_different_sets_ignores_order() -> None:
    a = torch.tensor([[1, 2], [3, 4], [5, 6]])
    b = torch.tensor([[2, 1], [3, 5], [5, 6]])
    assert different_sets(a, b).tolist() == [False, True, False]


def test_dequantize_mxfp4_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (3, 64, 8), transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def test_gpt_oss_mxfp4_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """An MXFP4 gpt-oss export (blocks + scales) against HF run on the same weights dequantized by transformers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    arch, overrides = MOE_CASES["gpt-oss"]
    overrides = {**overrides, "intermediate_size": 32}  # MXFP4 groups of 32 along both H and I
    hf = build_hf_model(arch, **overrides)
    g = torch.Generator().manual_seed(1)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for layer in range(hf.config.num_hidden_layers):
            experts = hf.model.layers[layer].mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(experts, proj)  # (E, in, out)
                e, cols, rows = param.shape
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(122, 126, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                prefix = f"model.layers.{layer}.mlp.experts.{proj}"
                packed[f"{prefix}_blocks"], packed[f"{prefix}_scales"] = blocks, scales
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors = {n: t for n, t in tensors.items() if not n.endswith(("gate_up_proj", "down_proj"))}
    save_file({**tensors, **packed}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path, dtype="fp32")
    assert model.config.moe.mxfp4
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    assert (our_logprobs(model, ids, pos, cu) - hf_logprobs(hf, ids, LENGTHS)).abs().max().item() < 1e-4


def test_unsupported_quantization_is_refused(tmp_path: Path) -> None:
    arch, overrides = MOE_CASES["mixtral-sliding"]
    save_hf_model(tmp_path, arch, **overrides)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="quantization_config") as err:
        load_model(tmp_path)
    assert err.value.code == "E606"
