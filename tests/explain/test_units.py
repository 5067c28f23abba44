"""The pieces of `pgdiag explain` on hand-computed examples: the sampling grid, k3, position buckets, the matrix
plan and its fit check, the token budget, the stage arithmetic of the attribution."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_factory import valid_rows, write_rollouts_file

from pgdiag.explain.attribution import stage_values
from pgdiag.explain.causes import Chain, Decisions, SideFit, k3, position_bucket, position_label
from pgdiag.explain.grid import Variant, grid_logprobs, temperatures, variants
from pgdiag.explain.matrix import estimate_cost, parameter_count, plan_matrix, roles
from pgdiag.model.config import ModelConfig

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


def test_grid_by_hand() -> None:
    # probabilities 0.5, 0.3, 0.2 at T = 1 (logits = log p)
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)).float()
    cands = (Variant("full", 1.0), Variant("top_p", 0.6), Variant("top_p", 0.9), Variant("top_k", 1.0))
    for target, expected in (
        (1, (math.log(0.5), math.log(0.5 / 0.8), math.log(0.5 / 1.0), 0.0)),  # p=0.6 keeps {0.5, 0.3}
        (0, (math.log(0.2), -math.inf, math.log(0.2), -math.inf)),  # mass before 0.2 is 0.8: kept at 0.9 only
    ):
        lp, entropy, certain = grid_logprobs(logits, torch.tensor([target]), (1.0,), cands)
        assert lp[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
        assert float(entropy[0]) == pytest.approx(
            -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)), abs=1e-6
        )
        assert not bool(certain[0])
    # temperature 0.5 squares and renormalises: 0.25, 0.09, 0.04 over 0.38
    lp, _, _ = grid_logprobs(logits, torch.tensor([2]), (0.5,), (Variant("full", 1.0),))
    assert float(lp[0, 0, 0]) == pytest.approx(math.log(0.09 / 0.38), abs=1e-6)
    assert 1.0 in temperatures() and 0.73 in temperatures([0.73])
    assert [v.label for v in variants(20, [0.77])][:2] == ["full", "top_p=0.98"]
    assert variants(20, [0.77])[-1].label == "top_k=20" and Variant("top_p", 0.77) in variants(None, [0.77])


def test_k3_and_buckets() -> None:
    assert k3(np.array([0.0, math.log(2)])).tolist() == pytest.approx([0.0, 2 - 1 - math.log(2)])
    assert k3(np.array([-np.inf, np.nan]))[0] == pytest.approx(math.expm1(-20) + 20)  # clamped, not inf
    buckets = position_bucket(np.array([0, 1, 2, 3, 4, 7, 8, 1000]))
    assert [position_label(int(b)) for b in buckets] == [
        "0",
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "512-1023",
    ]


def test_matrix_plan_fit_check_and_cost() -> None:
    config = ModelConfig.from_hf_dict(QWEN3_8B)
    assert parameter_count(config) == 8_190_735_360  # Qwen3-8B's published 8.19 B parameters
    configs, skipped = plan_matrix(config, moe_routes=False, tp=1, memory=36 * 2**30, names=None)
    names = [c.name for c in configs]
    assert names == ["bf16", "bf16_head", "fp16", "b1"]  # fp32 needs 30.5 GiB of 36: over 80 %
    assert "fp32 body needs 30.5 GiB per rank of 36.0 GiB" in skipped["ref"]
    assert "kept" in skipped and "replay" in skipped
    assert roles(configs, "ex").reference == "ex_bf16"  # the fallback reference: bf16 body, fp32 head
    full, _ = plan_matrix(config, moe_routes=False, tp=2, memory=36 * 2**30, names=None)
    assert full[0].name == "ref"  # two ranks hold half each


def test_cost_estimate_by_hand() -> None:
    """The cost model (docs/explain.md) on the benchmark's Qwen3-8B shape and budget, computed by hand: every
    configuration pays start-up and loading, the first of each body dtype the compile, the fp32 body runs at
    1/15 of the bf16 peak; the total lands within 5 % of the measured 125.5 s (docs/benchmarks.md, one H200)."""
    config = ModelConfig.from_hf_dict(QWEN3_8B)
    configs, _ = plan_matrix(config, moe_routes=False, tp=1, memory=141 * 2**30, names=None)
    assert [c.name for c in configs] == ["ref", "bf16", "bf16_head", "fp16", "b1"]
    cost = estimate_cost(config, configs, 42_656, "cuda", forwarded=61_445, temperatures=27)
    block = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 2 * 4096 + 2 * 128 + 3 * 4096 * 12288
    assert block == 192_946_432
    flops = (
        2 * 36 * block * 61_445 + 2 * 151_936 * 4096 * 42_656
    )  # blocks on every token, head on loss tokens
    bf16_rate, fp32_rate = 0.4 * 989e12, 0.4 * 989e12 * 1.25 / 15
    load_fp32, load_16 = 8_190_735_360 * 4 / 8e9, 8_190_735_360 * 2 / 8e9
    expected = {
        "ref": 2 + load_fp32 + 6 + flops / fp32_rate,  # first fp32 configuration: compiles
        "bf16": 2 + load_16 + 6 + flops / bf16_rate,  # first bf16 one: compiles
        "bf16_head": 2 + load_16 + flops / bf16_rate,
        "fp16": 2 + load_16 + 6 + flops / bf16_rate,
        "b1": 2 + load_16 + flops / bf16_rate,
        "grid": 2
        + load_fp32
        + flops / fp32_rate
        + 42_656 * 27 * 151_936 / 1e10,  # no compile, the vocab work
    }
    assert cost.seconds_by_config == pytest.approx(expected, rel=1e-12)
    assert expected["ref"] == pytest.approx(39.6, abs=0.1) and expected["grid"] == pytest.approx(
        51.1, abs=0.1
    )
    measured = {"grid": 50.7, "ref": 39.2, "bf16": 11.2, "bf16_head": 6.0, "fp16": 12.0, "b1": 6.4}
    assert cost.seconds == pytest.approx(sum(measured.values()), rel=0.05)
    assert cost.configurations == 6
    assert cost.seconds_per_token == pytest.approx(cost.seconds / (42_656 * 6))
    assert cost.line().startswith(
        "recompute matrix: 42656 tokens x 6 configurations (with the sampling grid)"
    )
    assert "61445 tokens forwarded" in cost.line()
    # two ranks: half the weights to load and half the FLOPs each; the grid stays on one device
    tp2 = estimate_cost(config, configs, 42_656, "cuda", forwarded=61_445, tp=2)
    assert tp2.seconds_by_config["b1"] == pytest.approx(2 + load_16 / 2 + flops / bf16_rate / 2)
    assert tp2.seconds_by_config["grid"] == pytest.approx(expected["grid"])


def test_token_budget_is_stratified_by_step(tmp_path: Path) -> None:
    from pgdiag.data.runs import read_run
    from pgdiag.explain.tokens import select_samples, write_token_run

    rows = []
    for step in range(4):
        for k in range(10):
            row = dict(valid_rows()[0], step=step, sample_id=f"{step}:{k}", group_id=f"g{step}")
            rows.append(row)  # 3 loss tokens each
    run = read_run(write_rollouts_file(tmp_path / "r.parquet", rows))
    selection = select_samples(run, 24, seed=1)
    assert selection.tokens_per_step == {step: (6, 30) for step in range(4)}  # 6 per step: 2 whole samples
    assert selection.n_tokens == 24
    out = write_token_run(run, selection, tmp_path / "tokens")
    assert read_run(out).lazy.collect().height == 8
    assert select_samples(run, 24, seed=1).keys.equals(selection.keys)  # seeded
    assert select_samples(run, 10_000).n_tokens == 120  # a budget above the run takes everything


def test_stage_arithmetic_noise_and_monotone() -> None:
    """k3 per stage: mean over tokens not explained; noise stages subtract their expected k3, never below 0."""
    decisions = Decisions({}, 0, 0, None, {"a": None, "b": None}, None, (), None)
    chain = Chain(decisions, {"a": SideFit(0, 0, 0, 0), "b": SideFit(0, 0, 0, 0)})
    key = ("all", "all")
    stages = {s: [0.0, 4.0, 0.4, 0.8] for s in ("start", "logprobs_mode", "temperature", "sampling_truncation",
                                                  "tokenization", "staleness", "weights", "routing",
                                                  "batch_variance", "precision")}  # fmt: skip
    stages["weights"] = [0.0, 4.0, 0.2, 0.4]  # weights halves k3
    chain.stages[key] = stages
    chain.noise[key] = {"n": 4.0, "batch_variance": 0.04, "precision:x": 1.0}  # expected 0.01 and 0.25
    values = dict((s, (k, a)) for s, k, a in stage_values(chain, key))
    assert values["start"][0] == pytest.approx(0.1) and values["weights"][0] == pytest.approx(0.05)
    assert values["batch_variance"][0] == pytest.approx(0.04)
    assert values["batch_variance"][1] == pytest.approx(0.1 * math.sqrt(0.04 / 0.05))
    assert values["precision"][0] == 0.0  # 0.04 - 0.25 floors at 0
