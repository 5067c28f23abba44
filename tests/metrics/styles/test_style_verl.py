"""`--key-style verl` against hand computations from verl 0.9.1's definitions (docs/key-styles.md).

verl: masked_mean mm(x) = Σ x / (Σ m + 1e-8); log-ratio clamped to ±20 before exp; dual clip c = 3 always on;
`pg_clipfrac_lower` = dual-clip activation rate; `agg_loss` with global batch info (N tokens, S rows) for the
loss and without it (S+ rows) for `actor/entropy`; gspo uses s = exp(min(δ̄, 10)) and per-token A.
"""

from __future__ import annotations

import math

import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles.steps import compute_step_style

E, LN = math.exp, math.log


def run(batch, **overrides):
    return values_of(compute_step_style(batch, settings_for("verl", batch, **overrides)))


def test_worked_example_section_11() -> None:
    got = run(worked_example())
    assert got["actor/pg_clipfrac"] == pytest.approx(4 / (13 + 1e-8), rel=1e-12)
    assert got["actor/pg_clipfrac"] == pytest.approx(0.307692, abs=5e-7)
    assert got["actor/ppo_kl"] == pytest.approx(-0.15 / (13 + 1e-8), rel=1e-9)
    assert got["actor/ppo_kl"] == pytest.approx(-0.011538, abs=5e-7)
    assert got["actor/pg_loss"] == pytest.approx(0.080553, abs=5e-7)  # no r > 3: dual clip inactive
    assert got["actor/pg_clipfrac_lower"] == 0.0
    assert got["critic/advantages/mean"] == pytest.approx((3 - 4 + 1.5 - 1.5) / 13, rel=1e-12)


def test_pg_clipfrac_lower_is_the_dual_clip_rate_not_the_low_side() -> None:
    # A = −1 on r = 4, 5 (> c = 3: dual clip binds) and r = 0.5 (low-side PPO clip)
    batch = make_batch(
        new=[[-2 + LN(4), -1 + LN(5), -1 + LN(0.5)]], old=[[-2.0, -1.0, -1.0]], adv=[[-1.0] * 3]
    )
    got = run(batch)
    # ℓ: min(3, max(4, 1.2)) = 3; min(3, max(5, 1.2)) = 3; min(3, max(0.5, 0.8)) = 0.8
    assert got["actor/pg_loss"] == pytest.approx((3 + 3 + 0.8) / 3, rel=1e-12)
    assert got["actor/pg_clipfrac_lower"] == pytest.approx(2 / (3 + 1e-8), rel=1e-12)
    assert got["actor/pg_clipfrac"] == pytest.approx(1 / (3 + 1e-8), rel=1e-12)
    trl = values_of(compute_step_style(batch, settings_for("trl", batch)))
    assert trl["clip_ratio/low_mean"] == pytest.approx(1 / 3)  # TRL's low side: only r = 0.5
    assert trl["loss"] == pytest.approx((4 + 5 + 0.8) / 3, rel=1e-12)  # no dual clip in TRL
    wider = run(batch, dual_clip=4.5)  # only r = 5 exceeds c = 4.5
    assert wider["actor/pg_clipfrac_lower"] == pytest.approx(1 / (3 + 1e-8), rel=1e-12)
    assert wider["actor/pg_loss"] == pytest.approx((4 + 4.5 + 0.8) / 3, rel=1e-12)


def test_log_ratio_clamp_at_20_and_inf_old_logprob() -> None:
    # d = 25 (A = +1) is clamped to 20; d = −0.1 (A = −1) is not
    batch = make_batch(new=[[-1.0, -1.1]], old=[[-26.0, -1.0]], adv=[[1.0, -1.0]])
    got = run(batch)
    assert got["actor/ppo_kl"] == pytest.approx((-20 + 0.1) / (2 + 1e-8), rel=1e-12)
    assert got["actor/pg_loss"] == pytest.approx((-1.2 + E(-0.1)) / 2, rel=1e-12)
    assert got["actor/pg_clipfrac"] == pytest.approx(1 / (2 + 1e-8), rel=1e-12)
    inf_old = run(make_batch(new=[[-1.0, -1.1]], old=[[-math.inf, -1.0]], adv=[[1.0, -1.0]]))
    assert inf_old["actor/ppo_kl"] == pytest.approx(got["actor/ppo_kl"], rel=1e-12)  # +inf clamped to 20
    assert inf_old["count/policy_logratio_inf"] == 1


def test_masked_mean_guard_one_token_and_empty_step() -> None:
    one = run(make_batch(new=[[-1.0]], old=[[-1.5]], adv=[[1.0]]))
    assert one["actor/pg_clipfrac"] == pytest.approx(1 / (1 + 1e-8), rel=1e-14)
    assert one["actor/pg_clipfrac"] != 1.0
    assert one["actor/ppo_kl"] == pytest.approx(-0.5 / (1 + 1e-8), rel=1e-14)
    empty = run(make_batch(new=[[]], old=[[]], adv=[[]], rollout=[[]]))
    assert empty["actor/pg_clipfrac"] == 0.0 and empty["actor/ppo_kl"] == 0.0
    assert empty["actor/pg_loss"] is None  # token-mean: Σ / batch_num_tokens = 0 / 0
    assert empty["critic/advantages/mean"] is None
    assert empty["rollout_corr/kl"] is None  # compute_offpolicy_metrics needs a valid token


def _agg_batch():
    # r = 1 everywhere so ℓ = −A: sample sums −6 (3 tokens) and +1 (1 token), plus one empty sample
    return make_batch(
        new=[[-1.0, -1.0, -1.0], [-2.0], []],
        old=[[-1.0, -1.0, -1.0], [-2.0], []],
        adv=[[1.0, 2.0, 3.0], [-1.0], []],
        entropy=[[1.0, 1.0, 1.0], [4.0], []],
    )


@pytest.mark.parametrize(
    ("aggregation", "empty_seqs", "expected"),
    [
        ("token-mean", "count", -5 / 4),
        ("token-sum", "count", -5.0),
        ("seq-mean-token-mean", "count", (-6 / (3 + 1e-8) + 1 / (1 + 1e-8)) / 3),
        ("seq-mean-token-mean", "skip", (-6 / (3 + 1e-8) + 1 / (1 + 1e-8)) / 2),
        ("verl:seq-mean-token-sum", "count", (-6 + 1) / 3),
        ("seq_mean_token_sum", "skip", (-6 + 1) / 2),
        ("seq-mean-token-sum-norm", "count", (-6 + 1) / 3 / 10),
    ],
)
def test_agg_loss_modes_with_an_empty_sample(aggregation: str, empty_seqs: str, expected: float) -> None:
    divisor = 10.0 if aggregation.endswith("norm") else None
    got = run(_agg_batch(), aggregation=aggregation, empty_seqs=empty_seqs, divisor=divisor)
    assert got["actor/pg_loss"] == pytest.approx(expected, rel=1e-12)


def test_entropy_is_aggregated_without_global_batch_info() -> None:
    got = run(_agg_batch(), aggregation="seq-mean-token-mean")
    # GB = S+ = 2 for the entropy even though the loss uses S = 3
    assert got["actor/entropy"] == pytest.approx((3 / (3 + 1e-8) + 4 / (1 + 1e-8)) / 2, rel=1e-12)
    assert run(_agg_batch())["actor/entropy"] == pytest.approx(7 / 4)


def test_gspo_sequence_ratio_capped_at_e10_per_token_advantage() -> None:
    # s0: d = (0.1, 0.2) → s = e^0.15 in band, A = (1, 2) per token; s1: d = 25 → s = e^min(25, 10)
    batch = make_batch(new=[[-0.9, -0.8], [-5.0]], old=[[-1.0, -1.0], [-30.0]], adv=[[1.0, 2.0], [1.0]])
    got = run(batch, level="sequence")
    s0 = E(0.15)
    assert got["actor/pg_loss"] == pytest.approx((-s0 - 2 * s0 - 1.2) / 3, rel=1e-12)
    assert got["actor/pg_clipfrac"] == pytest.approx(1 / (3 + 1e-8), rel=1e-12)
    assert got["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.2 + 25) / (3 + 1e-8), rel=1e-9)  # unclamped
    assert got["actor/pg_clipfrac_lower"] == 0.0
    seq_mean = run(batch, level="sequence", aggregation="gspo_seq_mean")
    expected = ((-s0 - 2 * s0) / (2 + 1e-8) + -1.2 / (1 + 1e-8)) / 2
    assert seq_mean["actor/pg_loss"] == pytest.approx(expected, rel=1e-12)


def test_low_var_kl_loss_clamps() -> None:
    # y = lp_ref − lp_new = 0.5, 15, −25 → k3 = e^0.5 − 1.5; e^15 − 16 → 10; y → −20: e^−20 + 19 → 10
    batch = make_batch(
        new=[[-1.0, -20.0, -1.0]], old=[[-1.0, -20.0, -1.0]], ref=[[-0.5, -5.0, -26.0]], adv=[[1.0] * 3]
    )
    got = run(batch)
    assert got["actor/kl_loss"] == pytest.approx((E(0.5) - 1.5 + 10 + 10) / 3, rel=1e-12)


def test_rollout_correction_metrics_and_token_is() -> None:
    # a = rollout, b = old: s0 Δ = (−0.1, 0.2), s1 Δ = (1.0,), s2 empty
    rollout = [[-1.0, -2.0], [-1.5], []]
    old = [[-1.1, -1.8], [-0.5], []]
    batch = make_batch(new=old, old=old, rollout=rollout, adv=[[1.0, 1.0], [1.0], []])
    got = run(batch, rollout_is="token")
    deltas = [-0.1, 0.2, 1.0]
    n = 3 + 1e-8
    assert got["rollout_corr/kl"] == pytest.approx(-math.fsum(deltas) / n, rel=1e-9)
    assert got["rollout_corr/k3_kl"] == pytest.approx(math.fsum(E(x) - x - 1 for x in deltas) / n, rel=1e-9)
    mu_b = [(-1.1 - 1.8) / (2 + 1e-8), -0.5 / (1 + 1e-8), 0.0]  # the empty row gives μ = 0 (ppl 1)
    mu_a = [(-1.0 - 2.0) / (2 + 1e-8), -1.5 / (1 + 1e-8), 0.0]
    assert got["rollout_corr/training_ppl"] == pytest.approx(math.fsum(E(-m) for m in mu_b) / 3, rel=1e-12)
    assert got["rollout_corr/rollout_log_ppl"] == pytest.approx(-math.fsum(mu_a) / 3, rel=1e-12)
    diffs = [a - b for a, b in zip(mu_a, mu_b, strict=True)]
    assert got["rollout_corr/log_ppl_diff"] == pytest.approx(math.fsum(diffs) / 3, rel=1e-9)
    assert got["rollout_corr/log_ppl_diff_min"] == pytest.approx(min(diffs), rel=1e-9)
    assert got["rollout_corr/ppl_ratio"] == pytest.approx(math.fsum(E(x) for x in diffs) / 3, rel=1e-12)
    assert got["rollout_corr/chi2_token"] == pytest.approx(
        math.fsum(E(2 * x) for x in deltas) / n - 1, rel=1e-9
    )
    assert got["rollout_corr/chi2_seq"] == pytest.approx((E(0.2) + E(2.0) + 1.0) / 3 - 1, rel=1e-9)
    w = [E(-0.1), E(0.2), 2.0]  # e^1 truncated at the threshold 2
    assert got["rollout_corr/rollout_is_mean"] == pytest.approx(math.fsum(w) / n, rel=1e-9)
    assert got["rollout_corr/rollout_is_max"] == 2.0
    assert got["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / n, rel=1e-9)
    assert got["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
    mean = math.fsum(w) / n
    assert got["rollout_corr/rollout_is_std"] == pytest.approx(
        math.sqrt(math.fsum(x * x for x in w) / n - mean**2)
    )
    ess = 1 / (math.fsum((x / (mean + 1e-8)) ** 2 for x in w) / n)
    assert got["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-9)
    probs = [abs(E(b) - E(a)) for a, b in zip([-1.0, -2.0, -1.5], [-1.1, -1.8, -0.5], strict=True)]
    assert got["training/rollout_probs_diff_mean"] == pytest.approx(math.fsum(probs) / 3, rel=1e-12)
    assert got["training/rollout_probs_diff_max"] == pytest.approx(max(probs), rel=1e-12)
    m = math.fsum(probs) / 3
    assert got["training/rollout_probs_diff_std"] == pytest.approx(
        math.sqrt(math.fsum((p - m) ** 2 for p in probs) / 2)
    )
    assert "rollout_corr/rollout_is_mean" not in run(batch)  # IS metrics only with --rollout-is token


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"beta": 0.1}, "E507"),
        ({"tis": True}, "E507"),
        ({"pad_width": 8}, "E507"),
        ({"loss_name": "x"}, "E507"),
        ({"group_normalize": True}, "E507"),
        ({"vllm_is": False}, "E507"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "E506"),
        ({"rollout_is": "sequence"}, "E507"),
        ({"aggregation": "dapo"}, "E507"),
        ({"dual_clip": 1.0}, "E503"),
    ],
    ids=str,
)
def test_flags_verl_does_not_have_are_rejected(overrides: dict, code: str) -> None:
    batch = worked_example()
    with pytest.raises(UsageError) as excinfo:
        compute_step_style(batch, settings_for("verl", batch, **overrides))
    assert excinfo.value.code == code  # E503 out of range, E506 needs a setting, E507 not the style's
