"""`--key-style pipelinerl` against hand computations from PipelineRL's `rl_step` (docs/key-styles.md).

PipelineRL: doc(x) = (1/S) Σ_i Σ_t x / N_i; the loss is Σ_t w_t [ℓ + kl_coef·k̂] with w = 1/batch_size (or
1/(mean input length of the group) with group normalization); k̂ uses lp_ref − lp_new clamped to ±10; the
new/old clamp indicator is the band (any A).
"""

from __future__ import annotations

import math

import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles.steps import compute_step_style

E = math.exp


def run(batch, **overrides):
    return values_of(compute_step_style(batch, settings_for("pipelinerl", batch, **overrides)))


def test_worked_example_section_11() -> None:
    batch = worked_example()
    result = compute_step_style(batch, settings_for("pipelinerl", batch))
    got = values_of(result)
    losses = [-1.0, -1.2, -E(-0.3), E(0.25), 0.8, E(0.05), 1.0, -0.6, -0.5 * E(-0.05), -0.5 * E(0.1)]
    losses += [0.4, 0.5, 0.5 * E(0.15)]
    assert got["rl/loss"] == pytest.approx(math.fsum(losses) / 4, rel=1e-12)  # Σ ℓ / batch_size (= S)
    assert got["rl/loss"] == pytest.approx(0.261799, abs=5e-7)
    assert any("kl_coef" in n for n in result.notices)  # no reference: the KL term is left out
    assert got["rl/ratio_new_old"] == pytest.approx(1.030517, abs=5e-7)  # mean of per-sample means
    assert got["rl/clamp_log_ratio_new_old_indicator"] == pytest.approx((2 / 3 + 2 / 4 + 1 / 3 + 1 / 3) / 4)
    ratios = [
        1,
        E(0.3),
        E(-0.3),
        E(0.25),
        E(-0.3),
        E(0.05),
        1,
        E(0.2),
        E(-0.05),
        E(0.1),
        E(-0.25),
        1,
        E(0.15),
    ]
    ratio_sum, ratio_sq_sum = math.fsum(ratios), math.fsum(r * r for r in ratios)
    assert got["rl/ratio_new_old_sum"] == pytest.approx(ratio_sum, rel=1e-12)
    assert got["rl/ess"] == pytest.approx(ratio_sum**2 / ratio_sq_sum / 13, rel=1e-12)
    assert got["rl/ess"] == pytest.approx(0.967279, abs=5e-7)
    assert got["rl/num_output_tokens_sum"] == 13
    abs_means = [0.6 / 3, 0.6 / 4, 0.35 / 3, 0.4 / 3]
    assert got["rl/mean_abs_log_ratio_new_old"] == pytest.approx(math.fsum(abs_means) / 4, rel=1e-9)
    assert got["rl/advantage"] == pytest.approx((1 - 1 + 0.5 - 0.5) / 4, abs=1e-15)
    assert got["rl/max_advantage"] == 1.0 and got["rl/min_advantage"] == -1.0


def test_reference_kl_clamped_at_10_enters_the_loss() -> None:
    # lp_ref − lp_new = 0.5, 12, −15 → c = 0.5, 10, −10; r = 1 and A = 1 so ℓ = −1 per token
    batch = make_batch(
        new=[[-1.0, -13.0, -1.0]], old=[[-1.0, -13.0, -1.0]], ref=[[-0.5, -1.0, -16.0]], adv=[[1.0] * 3]
    )
    k = [E(0.5) - 1.5, E(10.0) - 11.0, E(-10.0) + 9.0]
    got = run(batch)
    assert got["rl/kl"] == pytest.approx(math.fsum(k) / 3, rel=1e-12)
    assert got["rl/max_kl"] == pytest.approx(k[1], rel=1e-12)
    assert got["rl/min_kl"] == pytest.approx(k[0], rel=1e-12)
    assert got["rl/loss"] == pytest.approx(
        math.fsum(-1.0 + 0.1 * x for x in k) / 1, rel=1e-12
    )  # batch_size 1
    assert got["rl/ratio_ref_new"] == pytest.approx((E(0.5) + E(12.0) + E(-15.0)) / 3, rel=1e-12)  # unclamped
    assert got["rl/clamp_log_ratio_ref_new_indicator"] == pytest.approx(2 / 3)
    assert run(batch, kl_coef=0.0)["rl/loss"] == pytest.approx(-3.0)


def _two_group_batch():
    # r = 1 so ℓ = −A; input lengths 5 + response: s0 7, s1 6 (group 0, mean 6.5), s2 8 (group 1); s3 empty
    return make_batch(
        new=[[-1.0, -1.0], [-1.0], [-1.0] * 3, []],
        old=[[-1.0, -1.0], [-1.0], [-1.0] * 3, []],
        adv=[[1.0, 1.0], [-2.0], [0.5] * 3, []],
        group=[0, 0, 1, 1],
        response_len=[2, 1, 3, 3],
    )


def test_batch_size_and_group_normalization() -> None:
    batch = _two_group_batch()
    assert run(batch)["rl/loss"] == pytest.approx((-2 + 2 - 1.5) / 4)  # batch_size = S = 4
    assert run(batch, batch_size=8)["rl/loss"] == pytest.approx((-2 + 2 - 1.5) / 8)
    grouped = run(batch, group_normalize=True)
    assert grouped["rl/loss"] == pytest.approx((-2 + 2) / 6.5 + -1.5 / ((8 + 8) / 2), rel=1e-12)


def test_doc_reduction_divides_by_all_samples() -> None:
    got = run(_two_group_batch(), entropy=None)
    assert got["rl/advantage"] == pytest.approx((2 / 2 + -2 / 1 + 1.5 / 3 + 0) / 4)


def test_step_without_labels_logs_no_rl_stats() -> None:
    result = compute_step_style(
        make_batch(new=[[]], old=[[]], adv=[[]]), settings_for("pipelinerl", worked_example())
    )
    assert not [v for v in result.values if v.key.startswith("rl/")]
    assert values_of(result)["count/tokens"] == 0


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"dual_clip": 3.0}, "E507"),
        ({"level": "sequence"}, "E507"),
        ({"beta": 0.1}, "E507"),
        ({"divisor": 10.0}, "E507"),
        ({"tis": True}, "E507"),
        ({"aggregation": "sample_mean"}, "E507"),
        ({"batch_size": 0}, "E503"),
    ],
    ids=str,
)
def test_flags_pipelinerl_does_not_have_are_rejected(overrides: dict, code: str) -> None:
    batch = worked_example()
    with pytest.raises(UsageError) as excinfo:
        compute_step_style(batch, settings_for("pipelinerl", batch, **overrides))
    assert excinfo.value.code == code  # E503 out of range, E506 needs a setting, E507 not the style's
