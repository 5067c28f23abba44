"""`--key-style trl` against hand computations from TRL 1.16's GRPOTrainer (docs/key-styles.md).

TRL: one advantage per sample (Ā_i), ratio never clamped, no dual clip, token means guarded by max(Σ m, 1),
loss denominators by loss_type, vLLM IS (sequence_mask, clip_max 3) multiplying the policy term per sample.
"""

from __future__ import annotations

import math

import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles.steps import compute_step_style

E = math.exp


def run(batch, **overrides):
    return values_of(compute_step_style(batch, settings_for("trl", batch, **overrides)))


def test_worked_example_section_11() -> None:
    batch = worked_example()
    dapo = run(batch)
    assert dapo["loss"] == pytest.approx(0.080553, abs=5e-7)
    # grpo: mean over the 4 samples of each sample's token mean of ℓ
    s1 = (-1.0 - 1.2 - E(-0.3)) / 3
    s2 = (E(0.25) + 0.8 + E(0.05) + 1.0) / 4
    s3 = (-0.6 - 0.5 * E(-0.05) - 0.5 * E(0.1)) / 3
    s4 = (0.4 + 0.5 + 0.5 * E(0.15)) / 3
    grpo = run(batch, aggregation="grpo")
    assert grpo["loss"] == pytest.approx((s1 + s2 + s3 + s4) / 4, rel=1e-12)
    assert grpo["loss"] == pytest.approx(0.001114, abs=5e-7)
    assert dapo["clip_ratio/low_mean"] == pytest.approx(2 / 13)
    assert dapo["clip_ratio/high_mean"] == pytest.approx(2 / 13)
    assert dapo["clip_ratio/region_mean"] == pytest.approx(4 / 13)
    # per-sample low fractions 0, 1/4, 0, 1/3; high fractions 1/3, 0, 1/3, 0
    assert dapo["clip_ratio/low_min"] == 0.0
    assert dapo["clip_ratio/high_max"] == pytest.approx(1 / 3)
    assert "kl" not in dapo  # β = 0 by default


def test_one_advantage_per_sample_is_the_token_mean() -> None:
    # A varies over the sample (1, −1, 3): TRL sees Ā = 1 on every token (docs/key-styles.md)
    batch = make_batch(new=[[-1.0, -0.7, -1.3]], old=[[-1.0, -1.0, -1.0]], adv=[[1.0, -1.0, 3.0]])
    got = run(batch)
    assert got["loss"] == pytest.approx((-1.0 - 1.2 - E(-0.3)) / 3, rel=1e-12)
    assert got["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert got["clip_ratio/low_mean"] == 0.0  # the token with A = −1 is not low-clipped: Ā = 1 > 0
    assert got["count/adv_nonconstant_samples"] == 1


def test_no_clamp_and_no_dual_clip() -> None:
    # d = 25 with A = −1: ℓ = e^25 (TRL neither clamps d nor applies dual clip)
    got = run(make_batch(new=[[-1.0]], old=[[-26.0]], adv=[[-1.0]]))
    assert got["loss"] == pytest.approx(E(25.0), rel=1e-12)
    inf_old = run(make_batch(new=[[-1.0]], old=[[-math.inf]], adv=[[1.0]]))
    assert inf_old["loss"] == pytest.approx(-1.2)  # r = inf with A > 0: the clipped branch −1.2 wins


def _loss_type_batch():
    # r = 1 so ℓ = −Ā: sample sums −3 (3 tokens) and +2 (1 token), plus one empty row; B = 3, N = 4
    return make_batch(new=[[-1.0] * 3, [-2.0], []], old=[[-1.0] * 3, [-2.0], []], adv=[[1.0] * 3, [-2.0], []])


@pytest.mark.parametrize(
    ("aggregation", "divisor", "expected"),
    [
        ("grpo", None, (-3 / 3 + 2 / 1 + 0) / 3),
        ("bnpo", None, -1 / 4),
        ("dapo", None, -1 / 4),
        ("dr_grpo", None, -1 / (3 * 512)),
        ("trl:dr_grpo", 100.0, -1 / (3 * 100)),
        ("trl:luspo", None, -1 / 3),
    ],
)
def test_loss_types_count_empty_rows_in_b(aggregation: str, divisor: float | None, expected: float) -> None:
    got = run(_loss_type_batch(), aggregation=aggregation, divisor=divisor)
    assert got["loss"] == pytest.approx(expected, rel=1e-12)


def test_per_sample_clip_extremes_skip_empty_rows() -> None:
    batch = make_batch(new=[[-1.5], []], old=[[-1.0 + math.log(1.0)], []], adv=[[-1.0], []])
    got = run(batch)  # r = e^−0.5 < 0.8 with Ā < 0: the only non-empty row is fully low-clipped
    assert got["clip_ratio/low_min"] == 1.0
    assert got["clip_ratio/low_mean"] == 1.0
    assert got["clip_ratio/high_max"] == 0.0


def test_sequence_level_ratio_and_row_averaged_clip_metrics() -> None:
    # s0: R = e^0.3, Ā = 1 → high clip, ℓ = −1.2 per token; s1: R = e^−0.1, Ā = −1 → ℓ = e^−0.1; s2 empty
    batch = make_batch(
        new=[[-0.7, -0.7], [-1.1], []], old=[[-1.0, -1.0], [-1.0], []], adv=[[1.0, 1.0], [-1.0], []]
    )
    got = run(batch, level="sequence", aggregation="grpo")
    assert got["loss"] == pytest.approx((-1.2 + E(-0.1) + 0.0) / 3, rel=1e-12)
    assert got["clip_ratio/high_mean"] == pytest.approx(1 / 3)  # mean over all B = 3 rows
    assert got["clip_ratio/region_mean"] == pytest.approx(1 / 3)
    assert got["clip_ratio/low_mean"] == 0.0
    dapo = run(batch, level="sequence")
    assert dapo["loss"] == pytest.approx((2 * -1.2 + E(-0.1)) / 3, rel=1e-12)


def test_beta_adds_unclamped_k3_reference_kl() -> None:
    # x = lp_ref − lp_new = 0.5 and −1.0; r = 1, Ā = 1 so the policy term is −1 per token
    batch = make_batch(new=[[-1.0, -1.0]], old=[[-1.0, -1.0]], ref=[[-0.5, -2.0]], adv=[[1.0, 1.0]])
    k3 = [E(0.5) - 0.5 - 1, E(-1.0) + 1.0 - 1]
    got = run(batch, beta=0.1)
    assert got["kl"] == pytest.approx(math.fsum(k3) / 2, rel=1e-12)
    assert got["loss"] == pytest.approx(math.fsum(-1.0 + 0.1 * k for k in k3) / 2, rel=1e-12)
    with pytest.raises(UsageError, match="reference"):
        run(make_batch(new=[[-1.0]], old=[[-1.0]], adv=[[1.0]]), beta=0.1)


def test_vllm_importance_sampling_sequence_mask() -> None:
    # Δ = lp_old − lp_rollout per sample: (0.1, 0.2) → ISR e^0.3; (1.5) → e^1.5 > 3 → 0; (NaN, 0.05) → e^0.05
    old = [[-1.0, -1.0], [-1.0], [-1.0, -1.0]]
    rollout = [[-1.1, -1.2], [-2.5], [math.nan, -1.05]]
    batch = make_batch(new=old, old=old, rollout=rollout, adv=[[1.0, 1.0], [1.0], [-1.0, -1.0]])
    got = run(batch)
    isr = [E(0.3), 0.0, E(0.05)]
    # r = 1 so ℓ = −Ā · ISR_i: −e^0.3 (×2 tokens), 0, +e^0.05 (×2)
    assert got["loss"] == pytest.approx((-2 * isr[0] + 2 * isr[2]) / 5, rel=1e-12)
    assert got["sampling/importance_sampling_ratio/min"] == 0.0
    assert got["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.fsum(isr) / 3, rel=1e-12)
    assert got["sampling/importance_sampling_ratio/max"] == pytest.approx(E(0.3), rel=1e-12)
    diffs = [0.1, 0.2, 1.5, 0.05]  # the NaN difference is left out
    assert got["sampling/sampling_logp_difference/mean"] == pytest.approx(math.fsum(diffs) / 4, rel=1e-9)
    assert got["sampling/sampling_logp_difference/max"] == pytest.approx(1.5, rel=1e-12)
    off = run(batch, vllm_is=False)
    assert off["loss"] == pytest.approx((-2 - 1 + 2) / 5, rel=1e-12)
    assert "sampling/importance_sampling_ratio/mean" not in off


def test_entropy_guard_and_empty_step() -> None:
    got = run(make_batch(new=[[-1.0, -1.0]], old=[[-1.0, -1.0]], adv=[[1.0, 1.0]], entropy=[[0.5, 1.5]]))
    assert got["entropy"] == pytest.approx(1.0)
    empty = run(make_batch(new=[[]], old=[[]], adv=[[]], entropy=[[]]))
    assert empty["entropy"] == 0.0  # 0 / max(0, 1)
    assert empty["loss"] == 0.0  # dapo: 0 / max(0, 1)
    assert empty["clip_ratio/low_min"] is None  # every row empty: nanmin of nothing


def test_frac_reward_zero_std_uses_unbiased_group_std() -> None:
    # groups: {1, 1} zero std; {0, 1} not; {0.5} singleton: unbiased std is NaN, not zero
    batch = make_batch(
        new=[[-1.0]] * 5,
        old=[[-1.0]] * 5,
        adv=[[0.0]] * 5,
        reward=[1.0, 1.0, 0.0, 1.0, 0.5],
        group=[0, 0, 1, 1, 2],
    )
    assert run(batch)["frac_reward_zero_std"] == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"dual_clip": 3.0}, "E507"),
        ({"tis": True}, "E507"),
        ({"pad_width": 8}, "E507"),
        ({"rollout_is": "token"}, "E507"),
        ({"kl_coef": 0.1}, "E507"),
        ({"empty_seqs": "skip"}, "E507"),
        ({"aggregation": "sapo"}, "E507"),
        ({"aggregation": "seq-mean-token-mean"}, "E507"),
    ],
    ids=str,
)
def test_flags_trl_does_not_have_are_rejected(overrides: dict, code: str) -> None:
    batch = worked_example()
    with pytest.raises(UsageError) as excinfo:
        compute_step_style(batch, settings_for("trl", batch, **overrides))
    assert excinfo.value.code == code  # E503 out of range, E506 needs a setting, E507 not the style's
