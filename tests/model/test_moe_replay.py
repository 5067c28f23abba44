"""Routing replay in the model: replaying the router's own choice is the recompute result bit for bit; replaying
routes with a known fraction of changed experts shows that fraction as disagreement and a log-prob mismatch that
grows with it."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model
from moe_tiny import MOE_CASES
from test_model_parity import our_logprobs

from pgdiag.model import load_model
from pgdiag.recompute.routing import routing_counts

LENGTHS = [60, 41, 1, 80]
FRACTIONS = (0.0, 0.1, 0.3, 0.6)


def changed_routes(routes: torch.Tensor, fraction: float, num_experts: int) -> torch.Tensor:
    """`routes` (N, L, k) with, in every layer, the first round(fraction * N) tokens of one fixed random order
    sending their last expert elsewhere (to an expert outside the token's set). Sets are nested across fractions."""
    n, layers, _ = routes.shape
    out = routes.clone()
    g = torch.Generator().manual_seed(7)
    for layer in range(layers):
        order = torch.randperm(n, generator=g)[: round(fraction * n)]
        for t in order.tolist():
            free = [e for e in range(num_experts) if e not in out[t, layer].tolist()]
            out[t, layer, -1] = free[t % len(free)]
    return out


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("qwen2moe")
    arch, overrides = MOE_CASES["qwen2-moe-shared"]
    save_hf_model(path, arch, **overrides)
    return load_model(path, dtype="fp32")


def test_replaying_own_routes_is_the_recompute(moe_model) -> None:
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    own = moe_model.forward_packed(ids, pos, cu)
    replayed = moe_model.forward_packed(ids, pos, cu, replay_experts=own.router_topk)
    assert torch.equal(replayed.hidden, own.hidden)
    assert torch.equal(replayed.router_topk, own.router_topk)
    # -1 (not recorded) falls back to the router's own choice
    unrecorded = torch.full_like(own.router_topk, -1)
    assert torch.equal(moe_model.forward_packed(ids, pos, cu, replay_experts=unrecorded).hidden, own.hidden)
    partly = (own.router_topk + 1) % moe_model.config.moe.num_experts  # other experts everywhere ...
    partly[:, :, 0] = -1  # ... but no token fully recorded: every token keeps its own routes
    assert torch.equal(moe_model.forward_packed(ids, pos, cu, replay_experts=partly).hidden, own.hidden)


def test_changed_routes_give_their_fraction_and_a_growing_mismatch(moe_model) -> None:
    ids, pos, cu = packed_inputs(LENGTHS, 251)
    n = ids.shape[0]
    own = moe_model.forward_packed(ids, pos, cu)
    reference = our_logprobs(moe_model, ids, pos, cu)
    targets = torch.roll(ids, -1)[:, None]
    mismatch = []
    for fraction in FRACTIONS:
        recorded = changed_routes(own.router_topk, fraction, moe_model.config.moe.num_experts)
        # --routing recompute: the router's choice against the record differs on exactly the changed tokens
        tokens, disagree = routing_counts(recorded, own.router_topk)
        assert tokens.tolist() == [n, n]
        assert disagree.tolist() == [round(fraction * n)] * 2
        # --routing replay: the first MoE layer sees the same input, so its router disagrees on the same tokens
        replayed = moe_model.forward_packed(ids, pos, cu, replay_experts=recorded)
        assert routing_counts(recorded, replayed.router_topk)[1][0] == round(fraction * n)
        hidden_lp = (replayed.hidden.double() @ moe_model.lm_head_weight.double().T).log_softmax(-1)
        mismatch.append((hidden_lp.gather(1, targets) - reference.gather(1, targets)).abs().mean().item())
    assert mismatch[0] == 0.0
    assert all(a < b for a, b in pairwise(mismatch)), mismatch


def test_replay_shape_is_checked(moe_model) -> None:
    ids, pos, cu = packed_inputs([5], 251)
    with pytest.raises(ValueError, match="replay_experts must be"):
        moe_model.forward_packed(ids, pos, cu, replay_experts=torch.zeros(5, 1, 3, dtype=torch.int64))
