"""`--key-style fast-llm` against hand computations from Fast-LLM's definitions (docs/key-styles.md).

Fast-LLM reduces per document: doc(x) = (1/D) Σ_t x / max(N_d, 1), D counting fully masked documents; the
clip fraction is the band (any A); the ratio is never clamped; the loss is Σ ℓ / N (grpo; null with N = 0) or
(1/D) Σ_d N_d l_d over documents (gspo). Every expected number below is written out from those definitions.
"""

from __future__ import annotations

import math

import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles.steps import compute_step_style

E = math.exp


def run(batch, **overrides):
    return values_of(compute_step_style(batch, settings_for("fast-llm", batch, **overrides)))


def test_worked_example_section_11() -> None:
    got = run(worked_example())
    # per-token ℓ = max(−A r, −A clip(r)), summed over the 13 loss tokens
    losses = [-1.0, -1.2, -E(-0.3), E(0.25), 0.8, E(0.05), 1.0, -0.6, -0.5 * E(-0.05), -0.5 * E(0.1)]
    losses += [0.4, 0.5, 0.5 * E(0.15)]
    assert got["grpo"] == pytest.approx(math.fsum(losses) / 13, rel=1e-12)
    assert got["grpo"] == pytest.approx(0.080553, abs=5e-7)
    # band fraction per document: s1 2/3, s2 2/4, s3 1/3, s4 1/3 (the A-independent band)
    assert got["grpo_clipped_ratio_fraction"] == pytest.approx((2 / 3 + 2 / 4 + 1 / 3 + 1 / 3) / 4, rel=1e-12)
    assert got["grpo_clipped_ratio_fraction"] == pytest.approx(0.458333, abs=5e-7)
    ratios = [[1, E(0.3), E(-0.3)], [E(0.25), E(-0.3), E(0.05), 1], [E(0.2), E(-0.05), E(0.1)]]
    ratios += [[E(-0.25), 1, E(0.15)]]
    flat = [r for row in ratios for r in row]
    assert got["grpo_ratio_new_old_sum"] == pytest.approx(math.fsum(flat), rel=1e-12)
    assert got["grpo_ratio_new_old_squared_sum"] == pytest.approx(math.fsum(r * r for r in flat), rel=1e-12)
    assert got["grpo_ratio_new_old"] == pytest.approx(math.fsum(math.fsum(r) / len(r) for r in ratios) / 4)
    assert got["grpo_num_tokens"] == 13
    assert got["grpo_old_logprobs"] == pytest.approx((-3.5 / 3 - 5.7 / 4 - 2.3 / 3 - 3.4 / 3) / 4, rel=1e-12)
    assert got["grpo_max_advantage"] == 1.0 and got["grpo_min_advantage"] == -1.0
    assert got["count/tokens"] == 13 and got["count/samples"] == 4


def test_band_counts_zero_advantage_and_both_sides() -> None:
    # one document, A = 0 everywhere: r = e^0.5 (> 1.2) and e^-0.5 (< 0.8) are in the band count, loss is 0
    batch = make_batch(new=[[-0.5, -1.5, -1.0]], old=[[-1.0, -1.0, -1.0]], adv=[[0.0, 0.0, 0.0]])
    got = run(batch)
    assert got["grpo_clipped_ratio_fraction"] == pytest.approx(2 / 3, rel=1e-12)
    assert got["grpo"] == 0.0
    kl = [E(0.5) - 1 - 0.5, E(-0.5) - 1 + 0.5, 0.0]
    assert got["grpo_kl_new_old"] == pytest.approx(math.fsum(kl) / 3, rel=1e-12)


def test_fully_masked_document_counts_in_d_and_empty_step_guards() -> None:
    batch = make_batch(new=[[-0.7], []], old=[[-1.0], []], adv=[[1.0], []])
    got = run(batch)
    # D = 2: the empty document adds 0 but counts
    assert got["grpo_clipped_ratio_fraction"] == pytest.approx((1.0 + 0.0) / 2)
    assert got["grpo_ratio_new_old"] == pytest.approx(E(0.3) / 2, rel=1e-12)
    assert got["grpo"] == pytest.approx(-1.2 / 1)  # Σ ℓ / N with N = 1
    empty = run(make_batch(new=[[]], old=[[]], adv=[[]]))
    # Σ ℓ / N with N = 0: NaN in Fast-LLM (reduce_losses divides by 0), null here
    assert empty["grpo"] is None
    assert empty["grpo_num_tokens"] == 0
    assert empty["grpo_max_advantage"] == -math.inf and empty["grpo_min_advantage"] == math.inf


def test_segments_of_one_document_share_its_token_count() -> None:
    # rows 0 and 1 share sample_id "a" (one document of 3 tokens); row 2 is document "b"
    batch = make_batch(
        new=[[-1.0, -1.0], [-2.0], [-0.5]],
        old=[[-1.0, -1.5], [-1.0], [-0.5]],
        adv=[[1.0, 1.0], [1.0], [1.0]],
        sample_id=["a", "a", "b"],
    )
    got = run(batch)
    # doc "a": ratios 1, e^0.5, e^-1 over N_d = 3; doc "b": ratio 1; D = 2
    assert got["grpo_ratio_new_old"] == pytest.approx(((1 + E(0.5) + E(-1.0)) / 3 + 1.0) / 2, rel=1e-12)
    assert got["grpo_clipped_ratio_fraction"] == pytest.approx((2 / 3 + 0) / 2, rel=1e-12)


def test_no_clamp_on_large_log_ratio_and_inf_old_logprob() -> None:
    batch = make_batch(new=[[-1.0, -2.0]], old=[[-26.0, -2.0]], adv=[[1.0, 1.0]])
    got = run(batch)
    assert got["grpo_ratio_new_old_sum"] == pytest.approx(E(25.0) + 1.0, rel=1e-12)  # e^25, not e^20
    assert got["grpo_kl_new_old"] == pytest.approx((E(25.0) - 1 - 25) / 2, rel=1e-12)
    assert got["grpo"] == pytest.approx((-1.2 - 1.0) / 2)
    inf_old = run(make_batch(new=[[-1.0, -2.0]], old=[[-math.inf, -2.0]], adv=[[1.0, 1.0]]))
    assert inf_old["grpo_ratio_new_old_sum"] == math.inf
    assert inf_old["grpo_kl_new_old"] is None  # inf − 1 − inf is NaN in Fast-LLM too
    assert inf_old["grpo_clipped_ratio_fraction"] == pytest.approx(0.5)
    assert inf_old["grpo"] == pytest.approx((-1.2 - 1.0) / 2)


def test_gspo_sequence_level_is_length_proportional() -> None:
    # s0: d = (0.3, 0.3), A = 1 → R = e^0.3 > 1.2, l = −1.2; s1: d = (−0.1,), A = −1 → R = e^−0.1, l = R
    batch = make_batch(
        new=[[-0.7, -0.7], [-1.1], []], old=[[-1.0, -1.0], [-1.0], []], adv=[[1.0, 1.0], [-1.0], []]
    )
    got = run(batch, level="sequence", aggregation="fast-llm:gspo")
    assert got["grpo"] == pytest.approx((2 * -1.2 + 1 * E(-0.1)) / 3, rel=1e-12)  # D = 3 with the empty one
    assert got["grpo_ratio_new_old"] == pytest.approx((E(0.3) + E(-0.1)) / 3, rel=1e-12)
    assert got["grpo_ratio_new_old_sum"] == pytest.approx(E(0.3) + E(-0.1), rel=1e-12)
    assert got["grpo_clipped_ratio_fraction"] == pytest.approx(1 / 3, rel=1e-12)
    assert got["grpo_kl_new_old"] == pytest.approx((E(0.3) - 1.3 + E(-0.1) - 0.9) / 3, rel=1e-12)
    assert got["grpo_num_segments"] == 2


def test_gspo_segment_is_the_document_over_all_rows_of_a_sample() -> None:
    # document "a" is split over two rows (d = 0.3, 0.1 | −0.2, A = 1); document "b" is one row (d = −0.1, A = −1).
    # Fast-LLM sums the weighted log-ratio per document index, so R_a = e^((0.3 + 0.1 − 0.2)/3), not one
    # ratio per row (row a0 alone would give e^0.2 > 1.2, in the band and clipped).
    batch = make_batch(
        new=[[-0.7, -0.9], [-1.2], [-1.1]],
        old=[[-1.0, -1.0], [-1.0], [-1.0]],
        adv=[[1.0, 1.0], [1.0], [-1.0]],
        sample_id=["a", "a", "b"],
    )
    got = run(batch, level="sequence", aggregation="fast-llm:gspo")
    mean_a = (0.3 + 0.1 - 0.2) / 3
    r_a, r_b = E(mean_a), E(-0.1)  # both inside [0.8, 1.2]: l_a = −R_a (A = 1), l_b = R_b (A = −1)
    assert got["grpo"] == pytest.approx((3 * -r_a + 1 * r_b) / 2, rel=1e-12)  # (1/D) Σ_d N_d l_d, D = 2
    assert got["grpo_ratio_new_old"] == pytest.approx((r_a + r_b) / 2, rel=1e-12)
    assert got["grpo_ratio_new_old_sum"] == pytest.approx(r_a + r_b, rel=1e-12)
    assert got["grpo_ratio_new_old_squared_sum"] == pytest.approx(r_a**2 + r_b**2, rel=1e-12)
    assert got["grpo_kl_new_old"] == pytest.approx((r_a - 1 - mean_a + r_b - 1 + 0.1) / 2, rel=1e-12)
    assert got["grpo_clipped_ratio_fraction"] == 0.0
    assert got["grpo_advantage"] == pytest.approx((1.0 - 1.0) / 2)
    assert got["grpo_num_segments"] == 2  # documents with a token, not rows
    assert got["grpo_num_tokens"] == 4


def test_loss_name_entropy_and_reward() -> None:
    batch = make_batch(
        new=[[-1.0, -1.0], [-1.0]],
        old=[[-1.0, -1.0], [-1.0]],
        adv=[[0.5, 0.5], [-0.5]],
        entropy=[[2.0, 4.0], [1.0]],
        reward=[1.0, 0.0],
    )
    got = run(batch, loss_name="gspo_metrics")
    assert got["gspo_metrics_entropy"] == pytest.approx((6.0 / 2 + 1.0) / 2)
    assert got["gspo_metrics_train_samples_reward"] == pytest.approx((1.0 + 0.0) / 2)
    assert got["gspo_metrics_advantage"] == pytest.approx((0.5 - 0.5) / 2)
    # extrema of the reward broadcast to the loss tokens (Fast-LLM `_register_data_metrics`)
    assert got["gspo_metrics_max_train_samples_reward"] == 1.0
    assert got["gspo_metrics_min_train_samples_reward"] == 0.0
    masked = run(make_batch(new=[[-1.0], []], old=[[-1.0], []], adv=[[0.5], []], reward=[0.25, 3.0]))
    assert masked["grpo_max_train_samples_reward"] == masked["grpo_min_train_samples_reward"] == 0.25
    empty = run(make_batch(new=[[]], old=[[]], adv=[[]], reward=[3.0]))  # torch.where(mask, x, ∓inf).max/min
    assert empty["grpo_max_train_samples_reward"] == -math.inf
    assert empty["grpo_min_train_samples_reward"] == math.inf
    assert "grpo" not in got


def test_lm_head_loss_repeats_the_policy_gradient_loss() -> None:
    # Fast-LLM's head logs a lone weight-1 loss as `lm_head_loss` (LanguageModelHead registers the total under
    # LM_HEAD_LOSS_NAME and skips the loss's own name); the style prints both names with one value
    grpo = run(worked_example())
    assert grpo["lm_head_loss"] == grpo["grpo"] == pytest.approx(0.080553, abs=5e-7)
    gspo = run(worked_example(), level="sequence", aggregation="fast-llm:gspo", loss_name="gspo")
    assert gspo["lm_head_loss"] == gspo["gspo"] is not None
    assert run(make_batch(new=[[]], old=[[]], adv=[[]]))["lm_head_loss"] is None


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"dual_clip": 3.0}, "E507"),
        ({"beta": 0.1}, "E507"),
        ({"tis": True}, "E507"),
        ({"divisor": 10.0}, "E507"),
        ({"empty_seqs": "skip"}, "E507"),
        ({"aggregation": "sample_mean"}, "E507"),
        ({"aggregation": "fast-llm:gspo"}, "E507"),
        ({"batch_size": 4}, "E507"),
    ],
    ids=str,
)
def test_flags_fast_llm_does_not_have_are_rejected(overrides: dict, code: str) -> None:
    batch = worked_example()
    with pytest.raises(UsageError) as excinfo:
        compute_step_style(batch, settings_for("fast-llm", batch, **overrides))
    assert excinfo.value.code == code  # E503 out of range, E506 needs a setting, E507 not the style's
