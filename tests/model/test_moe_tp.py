"""MoE tensor parallelism on CPU with gloo: experts split over TP = 2 and 3 give the logprobs of TP = 1 (1e-5),
and an expert count the group does not divide is a clear E605.

Qwen3-MoE with a dense layer (mlp_only_layers) mixes both kinds of blocks; Qwen2-MoE adds the shared expert,
whose partial sum joins the experts' one all-reduce; gpt-oss adds per-head sinks, expert biases (added by the
expert's owner only) and the router bias.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import save_hf_model
from moe_tiny import MOE_CASES
from test_model_tp import LENGTHS, SIZES, gathered_logprobs, local_logits, spawn_tp

from pgdiag.errors import UsageError
from pgdiag.model import read_model_config, tp_layout

CASES = ("qwen3-moe", "qwen2-moe-shared", "gpt-oss")


def _save(path: Path, case: str, experts: int) -> None:
    arch, overrides = MOE_CASES[case]
    count = "num_experts" if arch.startswith("Qwen") else "num_local_experts"
    save_hf_model(path, arch, **{**overrides, **SIZES, count: experts, "head_dim": 8})


def test_moe_tp2_and_tp3_equal_tp1(tmp_path: Path) -> None:
    paths = []
    for case in CASES:
        _save(tmp_path / case, case, experts=6)
        paths.append(str(tmp_path / case))
    reference = [gathered_logprobs([local_logits(Path(p), None)]) for p in paths]
    for world in (2, 3):
        out = tmp_path / f"tp{world}.pt"
        spawn_tp(world, paths, str(out))
        per_rank = [torch.load(f"{out}.{r}") for r in range(world)]
        for i, ref in enumerate(reference):
            got = gathered_logprobs([per_rank[r][i] for r in range(world)])
            assert got.shape == ref.shape == (sum(LENGTHS), 251)
            assert (got - ref).abs().max().item() < 1e-5, (CASES[i], world)


def test_experts_not_divisible_by_the_group_is_e605(tmp_path: Path) -> None:
    _save(tmp_path, "qwen3-moe", experts=4)
    config = read_model_config(tmp_path)
    assert tp_layout(config, 2, 1).expert_start == 2 and tp_layout(config, 2, 1).local_num_experts == 2
    with pytest.raises(UsageError, match="does not divide the expert count = 4") as err:
        tp_layout(config, 3, 0)
    assert err.value.code == "E605"
