"""whatif's AReaL rules against AReaL's own code (areal-project/AReaL @ cbff54d).

own_code/areal_rejection.json holds the loss masks and importance weights of AReaL's `apply_rejection_sampling`
(token and sequence level, mask and clamp, every metric and aggregation, KPop's binary KL) and the masks of its
`_apply_m2po_masking`, computed by AReaL on one packed float32 micro-batch; own_code/make_areal_rejection.py
regenerates it from an AReaL checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pgdiag.analysis.rules import Replay
from pgdiag.analysis.settings import parse_rule
from pgdiag.analysis.whatif import rule_effect

FIXTURE = json.loads((Path(__file__).parent / "own_code" / "areal_rejection.json").read_text())


def replay() -> Replay:
    """The packed batch as one step: base = behaviour (μ), cur = proximal."""
    lengths = FIXTURE["lengths"]
    return Replay(
        base=np.asarray(FIXTURE["behaviour"], dtype=np.float32).astype(np.float64),
        cur=np.asarray(FIXTURE["proximal"], dtype=np.float32).astype(np.float64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        step=np.zeros(len(lengths), dtype=np.int64),
        pos=np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]),
        advantages=np.ones(sum(lengths)),
    )


def test_fixture_is_areal_cbff54d() -> None:
    assert FIXTURE["areal_commit"] == "cbff54d"
    assert len(FIXTURE["behaviour"]) == sum(FIXTURE["lengths"]) == 42


@pytest.mark.parametrize("rule", sorted(FIXTURE["rejections"]))
def test_rejection_sampling_matches_areal(rule: str) -> None:
    areal = FIXTURE["rejections"][rule]
    areal_kept = np.asarray(areal["loss_mask"]) > 0.5  # (M,)
    areal_weight = np.asarray(areal["weight"], dtype=np.float64)  # (M,), 0 where masked
    effect = rule_effect(parse_rule(rule), replay())
    # pgdiag keeps a masked token out through keep (mask) or weight 0; AReaL through its loss mask
    pgdiag_kept = effect.keep & (effect.weight > 0)
    assert pgdiag_kept.tolist() == areal_kept.tolist()
    np.testing.assert_allclose(effect.weight, areal_weight, rtol=2e-6, atol=1e-7)
    if ",clamp," not in rule:
        assert 0 < areal_kept.sum() < areal_kept.size  # every mask case drops some tokens and keeps others


@pytest.mark.parametrize("rule", sorted(FIXTURE["m2po"]))
def test_m2po_matches_areal(rule: str) -> None:
    areal_kept = np.asarray(FIXTURE["m2po"][rule], dtype=bool)  # (M,)
    effect = rule_effect(parse_rule(rule), replay())
    assert (effect.weight > 0).tolist() == areal_kept.tolist()
    assert effect.keep.all()  # masked tokens stay in the denominator
    assert 0 < (~areal_kept).sum() <= areal_kept.size - 1
