"""whatif's prime-rl rules against prime-rl's own losses (PrimeIntellect-ai/prime-rl @ 559b447).

own_code/prime_rl_loss.json holds, per sample, the gradient that autograd takes through prime-rl's
`default_loss_fn` (DPPO-TV + Kimi-K2.5 KL), `ipo_loss_fn` and `ref_kl_loss_fn` with respect to the trainer
log-probs; own_code/make_prime_rl_loss.py regenerates it from a prime-rl checkout. pgdiag's `RuleEffect.grad`
(g_t = ∂ℓ_t/∂log π_θ, with prime-rl's undetached ratio) must equal it to float32 precision, and the keep mask it
implies must agree on every token with a nonzero advantage.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pgdiag.analysis.rules import Replay
from pgdiag.analysis.settings import parse_rule
from pgdiag.analysis.whatif import rule_effect

FIXTURE = json.loads((Path(__file__).parent / "own_code" / "prime_rl_loss.json").read_text())


def replay() -> Replay:
    """The fixture's samples as one batch: base = inference (μ), cur = trainer (π), ref = the reference."""
    samples = FIXTURE["samples"]
    lengths = [len(s["trainer"]) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def flat(key: str) -> np.ndarray:
        return np.concatenate([np.asarray(s[key], dtype=np.float32) for s in samples]).astype(np.float64)

    return Replay(
        base=flat("inference"),
        cur=flat("trainer"),
        offsets=offsets,
        step=np.zeros(len(samples), dtype=np.int64),
        pos=np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]),
        advantages=np.repeat(np.asarray(FIXTURE["advantages"], dtype=np.float64), lengths),
        ref=flat("ref"),
    )


def test_fixture_is_prime_rl_559b447_with_both_signs_and_zero() -> None:
    assert FIXTURE["prime_rl_commit"] == "559b447"
    advantages = FIXTURE["advantages"]
    assert min(advantages) < 0 < max(advantages) and 0.0 in advantages


@pytest.mark.parametrize("rule", sorted(FIXTURE["grads"]))
def test_gradient_coefficients_match_prime_rl(rule: str) -> None:
    prime_grad = np.concatenate([np.asarray(g, dtype=np.float64) for g in FIXTURE["grads"][rule]])  # (M,)
    r = replay()
    effect = rule_effect(parse_rule(rule), r)
    assert effect.grad is not None
    np.testing.assert_allclose(effect.grad, prime_grad, rtol=1e-5, atol=1e-7)
    if rule != "ref_kl":  # the trust region dropped some tokens and kept others
        moved = r.adv() != 0
        assert 0 < (~effect.keep & moved).sum() < moved.sum()
