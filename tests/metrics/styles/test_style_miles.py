"""`--key-style miles` against hand computations from miles' loss hub (docs/key-styles.md).

miles: SM(x) = (1/S) Σ_i Σ_t x / max(N_i, 1) for every metric; r̂ = exp(clamp(z(d), ±20)) with every
non-finite d → 0; `ppo_kl` = lp_old − lp_new with non-finite values zeroed; `--loss-aggregation` picks the loss
reducer; TIS weights clamp(e^Δ, 0, 2) multiply the per-token loss.
"""

from __future__ import annotations

import math

import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles.steps import compute_step_style

E = math.exp


def run(batch, **overrides):
    return values_of(compute_step_style(batch, settings_for("miles", batch, **overrides)))


def test_worked_example_section_11() -> None:
    batch = worked_example()
    got = run(batch)
    # per-sample means of lp_old − lp_new: 0, 0, −0.25/3, +0.1/3 (sample mean, not token mean)
    assert got["train/ppo_kl"] == pytest.approx((0 + 0 - 0.25 / 3 + 0.1 / 3) / 4, rel=1e-9)
    assert got["train/ppo_kl"] == pytest.approx(-0.0125, abs=5e-9)
    assert got["train/pg_loss"] == pytest.approx(0.001114, abs=5e-7)  # default sample_mean
    assert got["train/loss"] == got["train/pg_loss"]
    assert got["train/pg_clipfrac"] == pytest.approx((1 / 3 + 1 / 4 + 1 / 3 + 1 / 3) / 4, rel=1e-12)
    assert run(batch, aggregation="miles:token_mean")["train/pg_loss"] == pytest.approx(0.080553, abs=5e-7)
    ratios = [[1, E(0.3), E(-0.3)], [E(0.25), E(-0.3), E(0.05), 1], [E(0.2), E(-0.05), E(0.1)]]
    ratios += [[E(-0.25), 1, E(0.15)]]
    ess = [math.fsum(r) ** 2 / (len(r) * math.fsum(x * x for x in r)) for r in ratios]
    assert got["train/ess_ratio"] == pytest.approx(math.fsum(ess) / 4, rel=1e-12)
    token_mean = run(batch, aggregation="miles:token_mean")
    weighted = math.fsum(len(r) * e for r, e in zip(ratios, ess, strict=True)) / 13
    assert token_mean["train/ess_ratio"] == pytest.approx(weighted, rel=1e-12)
    assert token_mean["train/ppo_kl"] == got["train/ppo_kl"]  # stays a sample mean under token_mean


def test_safe_clamp_of_log_ratio_nan_and_inf() -> None:
    # d = 25 → 20 (_safe_clamp_log_ratio); d = NaN → 0; d = +inf (lp_old = −inf) → 0, not 20: miles zeroes every
    # non-finite ppo_kl on loss tokens (nan_to_num(…, nan=0, posinf=0, neginf=0)) before compute_policy_loss
    batch = make_batch(new=[[-1.0, math.nan, -1.0]], old=[[-26.0, -1.0, -math.inf]], adv=[[1.0, 1.0, -1.0]])
    result = compute_step_style(batch, settings_for("miles", batch))
    got = values_of(result)
    # ℓ̂: max(−e^20, −1.2) = −1.2; r̂ = 1 → −1; A = −1, r̂ = 1: max(1, 1) = 1
    assert got["train/pg_loss"] == pytest.approx((-1.2 - 1.0 + 1.0) / 3, rel=1e-12)
    # per-sample Kish ESS over r̂ = (e^20, 1, 1)
    assert got["train/ess_ratio"] == pytest.approx((E(20.0) + 2) ** 2 / (3 * (E(40.0) + 2)), rel=1e-12)
    assert got["train/pg_clipfrac"] == pytest.approx(1 / 3)
    # ppo_kl = lp_old − lp_new = −25 (kept, no clamp), NaN → 0, −inf → 0
    assert got["train/ppo_kl"] == pytest.approx(-25 / 3, rel=1e-12)
    assert result.status == "nonfinite"
    assert got["count/policy_logratio_nan"] == 1 and got["count/policy_logratio_inf"] == 1


def _agg_batch():
    # r = 1 so ℓ̂ = −A: s0 (group 0) −1, −2, −3; s1 (group 0) +1; s2 (group 1) empty
    return make_batch(
        new=[[-1.0] * 3, [-2.0], []],
        old=[[-1.0] * 3, [-2.0], []],
        adv=[[1.0, 2.0, 3.0], [-1.0], []],
        group=[0, 0, 1],
        entropy=[[1.0, 2.0, 3.0], [5.0], []],
    )


@pytest.mark.parametrize(
    ("aggregation", "divisor", "expected"),
    [
        ("sample_mean", None, (-6 / 3 + 1 / 1 + 0) / 3),  # the empty sample adds 0 and counts in S
        ("miles:token_mean", None, -5 / 4),
        ("prompt_mean", None, ((-6 + 1) / 4 + 0) / 2),
        ("constant", 10.0, -5 / (10 * 3)),
    ],
)
def test_loss_aggregations(aggregation: str, divisor: float | None, expected: float) -> None:
    got = run(_agg_batch(), aggregation=aggregation, divisor=divisor)
    assert got["train/pg_loss"] == pytest.approx(expected, rel=1e-12)
    assert got["train/entropy_loss"] == pytest.approx((6 / 3 + 5 / 1 + 0) / 3, rel=1e-12)


def test_dual_clip_when_set() -> None:
    batch = make_batch(new=[[-2 + math.log(4.0)]], old=[[-2.0]], adv=[[-1.0]])  # r = 4, A = −1
    assert run(batch)["train/pg_loss"] == pytest.approx(4.0, rel=1e-12)  # --eps-clip-c unset: no dual clip
    assert run(batch, dual_clip=3.0)["train/pg_loss"] == pytest.approx(3.0, rel=1e-12)


def test_rollout_pair_keys_and_tis() -> None:
    # Δ = lp_old − lp_rollout = 0.5 and 25 (clamped to 20 for train_rollout_kl); r = 1, A = 1
    old = [[-1.0, -1.0]]
    batch = make_batch(new=old, old=old, rollout=[[-1.5, -26.0]], adv=[[1.0, 1.0]], ref=[[-1.5, -0.5]])
    got = run(batch)
    assert "train/ois" not in got  # miles computes ois only with --use-tis or --get-mismatch-metrics
    assert got["train/train_rollout_logprob_abs_diff"] == pytest.approx((0.5 + 25) / 2, rel=1e-12)
    assert got["train/train_rollout_kl"] == pytest.approx((E(0.5) - 1.5 + 10.0) / 2, rel=1e-12)
    assert got["train/kl_loss"] == pytest.approx((0.5 - 0.5) / 2)  # k1 = lp_new − lp_ref
    assert "train/tis" not in got
    # TIS: Δ = 0.5 and 1.0 → weights e^0.5 and min(e, 2) = 2 multiply ℓ̂ = −1
    tis_batch = make_batch(new=old, old=old, rollout=[[-1.5, -2.0]], adv=[[1.0, 1.0]])
    tis = run(tis_batch, tis=True)
    assert tis["train/pg_loss"] == pytest.approx((-E(0.5) - 2.0) / 2, rel=1e-12)
    assert tis["train/tis"] == pytest.approx((E(0.5) + E(1.0)) / 2, rel=1e-12)
    assert tis["train/tis_clipfrac"] == pytest.approx(1 / 2)
    assert tis["train/tis_abs"] == pytest.approx((E(0.5) - 1 + E(1.0) - 1) / 2, rel=1e-12)
    assert tis["train/ois"] == 1.0  # new = old


def test_mismatch_metrics_is_the_tis_branch_with_a_tis_weighted_loss() -> None:
    # miles: `if args.get_mismatch_metrics or args.use_tis`: pg_loss · clamp(e^Δ, 0, 2), ois and tis* logged
    old = [[-1.0, -1.0]]
    batch = make_batch(new=[[-0.9, -1.0]], old=old, rollout=[[-1.5, -2.0]], adv=[[1.0, 1.0]])
    plain, mismatch = run(batch), run(batch, mismatch_metrics=True)
    assert plain["train/pg_loss"] == pytest.approx((-E(0.1) - 1.0) / 2, rel=1e-12)  # r = e^0.1 and 1
    assert mismatch["train/pg_loss"] == pytest.approx((-E(0.1) * E(0.5) - 1.0 * 2.0) / 2, rel=1e-12)
    assert mismatch["train/ois"] == pytest.approx((E(0.1) + 1.0) / 2, rel=1e-12)
    assert mismatch["train/tis"] == pytest.approx((E(0.5) + E(1.0)) / 2, rel=1e-12)
    assert mismatch == run(batch, tis=True)
    assert "train/ois" not in plain and "train/tis" not in plain
    with pytest.raises(UsageError) as excinfo:  # the TIS weights need the rollout stream
        run(worked_example(), mismatch_metrics=True)
    assert excinfo.value.code == "E506" and "--mismatch-metrics" in excinfo.value.message


def test_ois_has_no_clamp_and_maps_non_finite_log_ratios_to_zero() -> None:
    # d = lp_new − lp_old = 25, NaN, +inf; miles: ppo_kl = nan_to_num(lp_old − lp_new, 0), ois = exp(−ppo_kl)
    # without _safe_clamp_log_ratio, so e^25 (not e^20) and 1 for both non-finite tokens
    batch = make_batch(
        new=[[-1.0, math.nan, -1.0]],
        old=[[-26.0, -1.0, -math.inf]],
        rollout=[[-26.0, -1.0, -1.0]],
        adv=[[1.0, 1.0, -1.0]],
    )
    got = run(batch, tis=True)
    assert got["train/ois"] == pytest.approx((E(25.0) + 1.0 + 1.0) / 3, rel=1e-12)


def test_default_aggregation_is_miles_sample_mean_and_token_mean_is_honoured() -> None:
    batch = worked_example()
    default = values_of(compute_step_style(batch, settings_for("miles", batch)))  # no --aggregation
    explicit = values_of(compute_step_style(batch, settings_for("miles", batch, aggregation="sample_mean")))
    assert default["train/pg_loss"] == explicit["train/pg_loss"] == pytest.approx(0.001114, abs=1e-6)
    token = values_of(compute_step_style(batch, settings_for("miles", batch, aggregation="token_mean")))
    assert token["train/pg_loss"] == pytest.approx(0.080553, abs=1e-6)


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"beta": 0.1}, "E507"),
        ({"level": "sequence"}, "E507"),
        ({"empty_seqs": "skip"}, "E507"),
        ({"pad_width": 4}, "E507"),
        ({"rollout_is": "token"}, "E507"),
        ({"aggregation": "constant"}, "E506"),
        ({"aggregation": "seq-mean-token-mean"}, "E507"),
        ({"tis": True}, "E506"),
        ({"dual_clip": 0.5}, "E503"),
    ],
    ids=str,
)
def test_flags_miles_does_not_have_are_rejected(overrides: dict, code: str) -> None:
    batch = worked_example()  # no rollout stream, so --tis has nothing to weight
    with pytest.raises(UsageError) as excinfo:
        compute_step_style(batch, settings_for("miles", batch, **overrides))
    assert excinfo.value.code == code  # E503 out of range, E506 needs a setting, E507 not the style's
