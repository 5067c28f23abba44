"""whatif's verl rules against verl's own functions (verl 0.9.1, `verl/trainer/ppo/rollout_corr_helper.py`).

The fixture own_code/verl_rollout_corr.json holds the masks of `compute_rollout_rejection_mask` and the weights
of `compute_rollout_correction_weights`, computed by verl itself on a float32 batch with values planted on the
thresholds; own_code/make_verl_rollout_corr.py regenerates it. The masks must agree token for token (verl
decides a threshold in float32: a token planted on log 0.5 in float32 is kept by verl and was rejected by a float64
comparison), the weights to float32 precision.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pgdiag.analysis.rules import Replay
from pgdiag.analysis.settings import parse_rule
from pgdiag.analysis.whatif import rule_effect

FIXTURE = json.loads((Path(__file__).parent / "own_code" / "verl_rollout_corr.json").read_text())
LOG_RATIO = np.asarray(FIXTURE["log_ratio"], dtype=np.float32)  # (B, T)
MASK = np.asarray(FIXTURE["mask"], dtype=bool)  # (B, T)


def replay() -> Replay:
    """The fixture's batch flattened to loss tokens: old = Δ, rollout = 0, so Δ = old − rollout."""
    lengths = MASK.sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (B + 1,)
    delta = LOG_RATIO[MASK].astype(np.float64)  # (M,), row-major: sample by sample
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    return Replay(
        base=np.zeros_like(delta),
        cur=delta,
        offsets=offsets,
        step=np.zeros(len(lengths), dtype=np.int64),
        pos=pos,
        advantages=np.ones_like(delta),
    )


def verl_spec(rollout_rs: str, threshold: str) -> str:
    """verl's (`rollout_rs`, `rollout_rs_threshold`) as a pgdiag rule: `token_k1,seq_max_k2` + `0.5_2.0,0.05`
    is `token_k1:0.5,2.0+seq_max_k2:0.05`."""
    parts = [
        f"{option}:{spec.replace('_', ',')}"
        for option, spec in zip(rollout_rs.split(","), threshold.split(","), strict=True)
    ]
    return "+".join(parts)


def test_fixture_is_verl_091_and_plants_the_edges() -> None:
    assert FIXTURE["verl_version"] == "0.9.1"
    assert MASK.sum(axis=1).tolist() == [12, 7, 1, 9, 12, 0, 4, 10]
    assert LOG_RATIO[3, 2] == 25.0 and LOG_RATIO[4, 5] == -30.0  # the ±20 clamp is exercised


@pytest.mark.parametrize("case", FIXTURE["rejections"], ids=lambda c: c["rollout_rs"])
def test_rejection_masks_match_verl(case: dict) -> None:
    verl_kept = np.asarray(case["kept"], dtype=np.float64)[MASK] > 0.5  # (M,)
    effect = rule_effect(parse_rule(verl_spec(case["rollout_rs"], case["threshold"])), replay())
    assert effect.keep.tolist() == verl_kept.tolist()
    assert 0 < verl_kept.sum() < verl_kept.size  # every case keeps some tokens and rejects some


CLASSIC = {"token_k1": "token_mis", "seq_sum_k1": "seq_mis", "seq_mean_k1": "geo_mask"}


@pytest.mark.parametrize("option", sorted(CLASSIC))
def test_classic_rejection_kinds_match_verl(option: str) -> None:
    """`--token-mis`, `--seq-mis` and `--geo-mask` are verl's token_k1, seq_sum_k1 and seq_mean_k1."""
    case = next(c for c in FIXTURE["rejections"] if c["rollout_rs"] == option)
    verl_kept = np.asarray(case["kept"], dtype=np.float64)[MASK] > 0.5  # (M,)
    spec = f"{CLASSIC[option]}:{case['threshold'].replace('_', ',')}"
    assert rule_effect(parse_rule(spec), replay()).keep.tolist() == verl_kept.tolist()


@pytest.mark.parametrize(
    "case", FIXTURE["weights"], ids=lambda c: f"{c['rollout_is']}-{c['threshold']}-bn{c['batch_normalize']}"
)
def test_is_weights_match_verl(case: dict) -> None:
    verl_weights = np.asarray(case["weights"], dtype=np.float64)[MASK]  # (M,)
    level, threshold = case["rollout_is"], case["threshold"]
    if "_" in threshold:
        lo, hi = threshold.split("_")
        spec = f"icepop:{lo},{hi}"
    else:
        kind = "token_tis" if level == "token" else "seq_tis"
        spec = f"{kind}_bn:{threshold}" if case["batch_normalize"] else f"{kind}:{threshold}"
    effect = rule_effect(parse_rule(spec), replay())
    np.testing.assert_allclose(effect.weight, verl_weights, rtol=2e-6, atol=0)
