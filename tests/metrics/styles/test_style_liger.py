"""`--key-style liger` against hand computations from Liger-Kernel 0.8.5's `ppo_loss_fn` (docs/key-styles.md).

Liger: β = 0.04 by default (k3 of π_ref/π_new, 0 without a reference because Liger then uses lp_new), one
advantage per sample, token means guarded by max(N, 1), `dr_grpo` needs max_completion_length, `luspo`
divides Σ_i N_i Σ_t ℓ_it by B·T′ (T′ = padded width; 1 at sequence level).
"""

from __future__ import annotations

import math

import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles.steps import compute_step_style

E = math.exp


def run(batch, **overrides):
    return values_of(compute_step_style(batch, settings_for("liger", batch, **overrides)))


def test_worked_example_without_reference_kl_is_zero() -> None:
    batch = worked_example()
    result = compute_step_style(batch, settings_for("liger", batch))
    got = values_of(result)
    assert got["loss"] == pytest.approx(0.080553, abs=5e-7)  # dapo; β·k3 = 0 without a reference
    assert got["kl"] == 0.0
    assert got["clip_ratio"] == pytest.approx(4 / 13)
    assert any("β = 0.04" in n for n in result.notices)
    assert run(batch, aggregation="grpo")["loss"] == pytest.approx(0.001114, abs=5e-7)


def test_default_beta_adds_k3_with_a_reference() -> None:
    # x = lp_ref − lp_new = 0.5 and −1.0; r = 1, Ā = 1: policy term −1 per token
    batch = make_batch(new=[[-1.0, -1.0]], old=[[-1.0, -1.0]], ref=[[-0.5, -2.0]], adv=[[1.0, 1.0]])
    k3 = [E(0.5) - 0.5 - 1, E(-1.0) + 1.0 - 1]
    got = run(batch)
    assert got["kl"] == pytest.approx(math.fsum(k3) / 2, rel=1e-12)
    assert got["loss"] == pytest.approx(math.fsum(-1.0 + 0.04 * k for k in k3) / 2, rel=1e-12)
    assert "kl" not in run(batch, beta=0.0)


def _loss_type_batch(response_len: list[int] | None = None):
    # r = 1 so ℓ = −Ā: sample sums −3 (3 tokens) and +2 (1 token), plus one empty row; B = 3, N = 4
    return make_batch(
        new=[[-1.0] * 3, [-2.0], []],
        old=[[-1.0] * 3, [-2.0], []],
        adv=[[1.0] * 3, [-2.0], []],
        response_len=response_len,
    )


@pytest.mark.parametrize(
    ("aggregation", "divisor", "expected"),
    [
        ("grpo", None, (-3 / 3 + 2 / 1 + 0) / 3),
        ("bnpo", None, -1 / 4),
        ("dapo", None, -1 / 4),
        ("liger:dr_grpo", 100.0, -1 / (3 * 100)),
    ],
)
def test_loss_types(aggregation: str, divisor: float | None, expected: float) -> None:
    got = run(_loss_type_batch(), aggregation=aggregation, divisor=divisor, beta=0.0)
    assert got["loss"] == pytest.approx(expected, rel=1e-12)


def test_luspo_divides_by_padded_width() -> None:
    # Σ_i N_i Σ_t ℓ_it = 3·(−3) + 1·2 = −7; B = 3
    default_width = run(_loss_type_batch(response_len=[5, 2, 4]), aggregation="liger:luspo", beta=0.0)
    assert default_width["loss"] == pytest.approx(-7 / (3 * 5), rel=1e-12)  # T′ = longest response, 5
    given = run(_loss_type_batch(), aggregation="liger:luspo", beta=0.0, pad_width=10)
    assert given["loss"] == pytest.approx(-7 / (3 * 10), rel=1e-12)
    batch = _loss_type_batch()
    result = compute_step_style(batch, settings_for("liger", batch, aggregation="liger:luspo", beta=0.0))
    assert any("padding" in n for n in result.notices)  # Liger's own sum also covers padding positions


def test_sequence_level_ratio_broadcast() -> None:
    # s0: R = e^0.3, Ā = 1 → clipped, l = −1.2 on 2 tokens; s1: R = e^−0.1, Ā = −1 → l = e^−0.1; s2 empty
    batch = make_batch(
        new=[[-0.7, -0.7], [-1.1], []], old=[[-1.0, -1.0], [-1.0], []], adv=[[1.0, 1.0], [-1.0], []]
    )
    got = run(batch, level="sequence", beta=0.0)
    assert got["clip_ratio"] == pytest.approx(2 / 3)  # R_i broadcast to the 2 tokens of s0, over N = 3
    assert got["loss"] == pytest.approx((2 * -1.2 + E(-0.1)) / 3, rel=1e-12)
    luspo = run(batch, level="sequence", beta=0.0, aggregation="liger:luspo")
    assert luspo["loss"] == pytest.approx((2 * -1.2 + 1 * E(-0.1)) / 3, rel=1e-12)  # (1/B) Σ N_i l_i


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"vllm_is": False}, "E507"),
        ({"dual_clip": 3.0}, "E507"),
        ({"batch_size": 2}, "E507"),
        ({"rollout_is": "token"}, "E507"),
        ({"tis": True}, "E507"),
        ({"aggregation": "liger:dr_grpo"}, "E506"),
        ({"aggregation": "token-sum"}, "E507"),
    ],
    ids=str,
)
def test_flags_liger_does_not_have_are_rejected(overrides: dict, code: str) -> None:
    batch = worked_example()
    with pytest.raises(UsageError) as excinfo:
        compute_step_style(batch, settings_for("liger", batch, **overrides))
    assert excinfo.value.code == code  # E503 out of range, E506 needs a setting, E507 not the style's
