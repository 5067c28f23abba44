"""Native engine: the 4-sample worked example, the on-policy identities and the edge cases."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from metrics_batch_factory import make_batch, worked_example

from pgdiag.metrics.catalog import METRIC_CATALOG, catalog_markdown
from pgdiag.metrics.engine import compute_native, compute_step_native, split_steps
from pgdiag.metrics.identity import check_identity
from pgdiag.metrics.loss import aliases_markdown
from pgdiag.metrics.settings import MetricSettings

POLICY = MetricSettings.from_options(new="new", old="old")


def values(batch, settings=POLICY) -> dict[str, float | None]:
    return {v.key: v.value for v in compute_step_native(batch, settings).values}


# ---- worked example ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example() -> dict[str, float | None]:
    return values(worked_example(), MetricSettings.from_options(new="new", old="old", divisor=4.0))


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("loss/token_mean", 0.080553),
        ("loss/sample_mean", 0.001114),
        ("loss/prompt_mean", 0.073046),
        ("loss/constant", 0.065450),
        ("loss/seq_mean_token_sum", 0.261799),
        ("loss/gspo_seq_mean", -0.014961),
        ("loss/gspo_length_prop", 0.205117),
        ("loss/pg", 0.080553),
        ("policy/ratio_mean", 1.029633),
        ("policy/clip_frac_band", 0.461538),
        ("policy/clip_frac_binding", 0.307692),
        ("policy/clip_frac_low", 0.153846),
        ("policy/clip_frac_high", 0.153846),
        ("policy/kl_k1", -0.011538),
        ("policy/kl_k3", 0.018095),
        ("policy/ess_token", 0.967279),
        ("policy/logratio_absmax", 0.3),
        ("policy/zero_grad_frac", 0.307692),
        ("grad/token_mean_scale", 0.552710),
        ("grad/token_mean_length_corr", 1.0),
        ("grad/sample_mean_length_corr", 0.0),
        ("grad/prompt_mean_length_corr", 0.816497),
        ("grad/constant_length_corr", 1.0),
        ("advantage/group_token_sum_absmax", 1.0),
        ("advantage/group_seq_sum_absmax", 0.0),
        ("count/tokens", 13),
        ("count/samples", 4),
        ("count/groups", 2),
    ],
)
def test_worked_example_table(example, key, expected):
    assert example[key] == pytest.approx(expected, abs=1e-6)


def test_worked_example_hand_sums(example):
    # Σ m ℓ = 1.047195 (token_sum), Σ r = 13.385230, Σ(r − 1 − d) = 0.235230, unclipped Σ|A|r = 7.185232
    assert example["loss/token_sum"] == pytest.approx(1.047195, abs=1e-6)
    assert example["policy/ratio_mean"] * 13 == pytest.approx(13.385230, abs=1e-6)
    assert example["policy/kl_k3"] * 13 == pytest.approx(0.235230, abs=1e-6)
    assert example["grad/token_sum_scale"] == pytest.approx(7.185232, abs=1e-6)
    # GSPO: R = (1, 1, 1.086904, 0.967216), all in band
    assert example["policy/seq_ratio_max"] == pytest.approx(1.086904, abs=1e-6)
    assert example["policy/seq_ratio_min"] == pytest.approx(0.967216, abs=1e-6)
    assert example["policy/seq_clip_frac_band"] == 0.0
    # weight sums: 1 for token_mean, S+/S for sample_mean, N/(L·S) for constant, N for token_sum
    assert example["grad/token_mean_weight_sum"] == pytest.approx(1.0, abs=1e-12)
    assert example["grad/sample_mean_weight_sum"] == pytest.approx(1.0, abs=1e-12)
    assert example["grad/constant_weight_sum"] == pytest.approx(13 / 16, abs=1e-12)
    assert example["grad/token_sum_weight_sum"] == 13.0
    assert example["grad/token_mean_length_elasticity"] == pytest.approx(1.0, abs=1e-12)
    assert example["grad/sample_mean_length_elasticity"] == 0.0


def test_worked_example_sample_reduction():
    got = values(
        worked_example(), MetricSettings.from_options(new="new", old="old", metric_reduction="sample")
    )
    assert got["policy/ratio_mean"] == pytest.approx(1.030517, abs=1e-6)
    assert got["policy/clip_frac_binding"] == pytest.approx(0.3125, abs=1e-6)
    # miles train/ppo_kl is the sample mean of −d: (0 + 0 − 0.25/3 + 0.1/3) / 4
    assert got["policy/kl_k1"] == pytest.approx(-0.0125, abs=1e-9)
    # the loss does not depend on the metric reduction
    assert got["loss/token_mean"] == pytest.approx(0.080553, abs=1e-6)


def test_worked_example_document_reduction_is_fast_llm_band():
    # one document per sample: Fast-LLM grpo_clipped_ratio_fraction = (2/3 + 2/4 + 1/3 + 1/3) / 4
    got = values(
        worked_example(), MetricSettings.from_options(new="new", old="old", metric_reduction="document")
    )
    assert got["policy/clip_frac_band"] == pytest.approx(0.458333, abs=1e-6)


def test_masked_token_would_move_kl_k1():
    # s3's masked token has d = −6.5: with it kl_k1 = (6.5 − 0.15) / 14
    got = values(worked_example(include_masked=True))
    assert got["policy/kl_k1"] == pytest.approx(0.453571, abs=1e-6)
    assert got["count/tokens"] == 14


# ---- on-policy identities ----------------------------------------------------------------------------------------


def test_on_policy_identity_is_exact():
    lp = [[-0.3, -2.0, -1.1], [-0.7], [-4.0, -0.01]]
    batch = make_batch(new=lp, old=lp, advantages=[0.5, -1.5, 2.0], groups=["a", "a", "b"])
    got = values(batch, MetricSettings.from_options(new="new", old="old", divisor=3.0, dual_clip=3.0))
    for key in ("policy/ratio_mean", "policy/ratio_min", "policy/ratio_max", "policy/seq_ratio_mean"):
        assert got[key] == 1.0, key
    for key in [k for k in got if k.startswith("policy/clip_frac") or k.startswith("policy/kl_")]:
        assert got[key] == 0.0, key
    assert got["policy/dual_clip_frac"] == 0.0
    for key in ("policy/ess_token", "policy/ess_per_seq", "policy/ess_seq", "policy/ess_seq_geo"):
        assert got[key] == 1.0, key
    assert got["policy/logratio_absmax"] == 0.0
    # ℓ_t = −A_t: loss/<mode> = −Σ w A, grad/<mode>_scale = Σ w |A| (lengths 3, 1, 2; S = 3; P = 2)
    a = np.array([0.5] * 3 + [-1.5] + [2.0] * 2)
    n = 6
    assert got["loss/token_mean"] == pytest.approx(-a.sum() / n, abs=1e-15)
    assert got["loss/token_sum"] == pytest.approx(-a.sum(), abs=1e-15)
    assert got["loss/sample_mean"] == pytest.approx(-(0.5 - 1.5 + 2.0) / 3, abs=1e-15)
    assert got["loss/prompt_mean"] == pytest.approx(-((1.5 - 1.5) / 4 + 4.0 / 2) / 2, abs=1e-15)
    assert got["loss/constant"] == pytest.approx(-a.sum() / (3.0 * 3), abs=1e-15)
    assert got["grad/token_mean_scale"] == pytest.approx(np.abs(a).sum() / n, abs=1e-15)
    assert got["grad/sample_mean_scale"] == pytest.approx((0.5 + 1.5 + 2.0) / 3, abs=1e-15)


def test_sample_mean_equals_token_mean_with_equal_lengths():
    rng = np.random.default_rng(3)
    old = rng.normal(-1.0, 0.5, (5, 4)).tolist()
    new = (np.array(old) + rng.normal(0.0, 0.3, (5, 4))).tolist()
    adv = rng.normal(0.0, 1.0, 5).tolist()
    got = values(
        make_batch(new=new, old=old, advantages=adv),
        MetricSettings.from_options(new="new", old="old", divisor=4.0),
    )
    assert got["loss/sample_mean"] == pytest.approx(got["loss/token_mean"], rel=1e-14)
    # constant with L = every length is the sample mean
    assert got["loss/constant"] == pytest.approx(got["loss/sample_mean"], rel=1e-14)
    assert got["grad/sample_mean_length_corr"] is None  # every N_i equal


# ---- edge cases ---------------------------------------------------------------------------------------------


def test_fully_masked_and_single_token_samples():
    # sample 1 has no loss position at all, sample 2 one token, sample 3 only a NaN (invalid) token
    batch = make_batch(
        new=[[-1.0, -0.5], [], [-0.2], [math.nan]],
        old=[[-1.2, -0.5], [], [-0.4], [-1.0]],
        advantages=[1.0, 1.0, -1.0, 1.0],
    )
    result = compute_step_native(batch, POLICY)
    got = {v.key: v.value for v in result.values}
    assert got["count/samples"] == 4
    assert got["count/samples_empty"] == 2
    assert got["count/tokens"] == 3
    assert got["count/tokens_invalid"] == 1
    assert result.status == "nonfinite"
    # S = 4 counts the empty samples: sample_mean = (ℓ̄_1 + ℓ̄_3) / 4
    r1 = math.exp(0.2)
    loss_1 = (max(-r1, -1.2) + -1.0) / 2
    loss_3 = max(math.exp(0.2), min(max(math.exp(0.2), 0.8), 1.2))  # A = −1: max(r, clip(r))
    assert got["loss/sample_mean"] == pytest.approx((loss_1 + loss_3) / 4, abs=1e-15)
    skipped = values(batch, MetricSettings.from_options(new="new", old="old", empty_seqs="skip"))
    assert skipped["loss/sample_mean"] == pytest.approx((loss_1 + loss_3) / 2, abs=1e-15)
    assert got["policy/seq_ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2, abs=1e-15)


def test_zero_advantage_has_no_gradient_and_no_binding():
    batch = make_batch(new=[[-0.1, -0.1]], old=[[-1.0, -0.1]], advantages=[0.0])
    got = values(batch)
    assert got["policy/clip_frac_band"] == 0.5  # r = e^0.9 is out of band whatever A is
    assert got["policy/clip_frac_binding"] == 0.0
    assert got["policy/zero_grad_frac"] == 1.0
    assert got["loss/token_mean"] == 0.0
    assert got["grad/token_mean_scale"] == 0.0
    assert got["policy/band_nonbinding_grad_share"] is None  # no gradient at all: 0 / 0
    assert got["advantage/frac_zero"] == 1.0


def test_dual_clip_for_negative_advantage_and_large_ratio():
    # r = e^1.5 = 4.48 > C = 3 with A = −1: ℓ = min(max(r, clip(r)), 3) = 3, Dual = 1, gradient 0
    batch = make_batch(new=[[-0.5, -1.0]], old=[[-2.0, -1.0]], advantages=[-1.0])
    plain = values(batch)
    dual = values(batch, MetricSettings.from_options(new="new", old="old", dual_clip=3.0))
    assert plain["loss/token_sum"] == pytest.approx(math.exp(1.5) + 1.0, abs=1e-12)
    assert dual["loss/token_sum"] == pytest.approx(3.0 + 1.0, abs=1e-12)
    assert dual["policy/dual_clip_frac"] == 0.5
    assert "policy/dual_clip_frac" not in plain
    assert plain["policy/clip_frac_binding"] == 0.0  # A < 0 and r > 1 + ε: band, not binding
    assert dual["policy/zero_grad_frac"] == 0.5
    assert plain["grad/token_sum_scale"] == pytest.approx(math.exp(1.5) + 1.0, abs=1e-12)
    assert dual["grad/token_sum_scale"] == pytest.approx(1.0, abs=1e-12)


def test_huge_log_ratio_is_counted_not_clamped():
    batch = make_batch(new=[[-1.0, -0.5]], old=[[-31.0, -0.5]], advantages=[1.0])
    got = values(batch)
    assert got["count/policy_abs_logratio_gt_20"] == 1
    assert got["policy/logratio_absmax"] == 30.0
    assert got["policy/ratio_max"] == pytest.approx(math.exp(30.0), rel=1e-15)
    assert got["policy/ratio_mean"] == pytest.approx((math.exp(30.0) + 1.0) / 2, rel=1e-15)
    assert got["policy/kl_k1"] == -15.0


def test_ratio_overflow_is_inf_and_counted():
    batch = make_batch(new=[[-0.5, -0.5]], old=[[-800.0, -0.5]], advantages=[1.0])
    result = compute_step_native(batch, POLICY)
    got = {v.key: v.value for v in result.values}
    assert got["count/policy_ratio_overflow"] == 1
    assert got["policy/ratio_mean"] == math.inf
    assert got["policy/kl_k3"] == math.inf
    assert got["policy/kl_rev_k3"] == math.inf
    assert got["policy/ess_token"] is None  # inf / inf
    assert result.status == "ok"  # finite inputs: extreme, not invalid
    assert all(v.value is None or not math.isnan(v.value) for v in result.values)


def test_minus_inf_old_logprob_is_excluded_and_counted():
    batch = make_batch(new=[[-1.0, -0.5]], old=[[-math.inf, -0.7]], advantages=[1.0])
    result = compute_step_native(batch, POLICY)
    got = {v.key: v.value for v in result.values}
    assert result.status == "nonfinite"
    assert got["count/tokens_invalid"] == 1
    assert got["count/policy_logratio_inf"] == 1
    assert got["count/policy_abs_logratio_gt_20"] == 1
    assert got["policy/logratio_mean"] == pytest.approx(0.2, abs=1e-15)


def test_zero_std_group_and_singletons():
    batch = make_batch(
        new=[[-1.0]] * 5,
        old=[[-1.0]] * 5,
        advantages=[0.0, 0.0, 1.0, -1.0, 0.3],
        groups=["a", "a", "b", "b", "c"],
        reward=[1.0, 1.0, 1.0, 0.0, 0.5],
    )
    got = values(batch, MetricSettings.from_options(new="new", old="old"))
    assert got["advantage/group_zero_std_frac"] == 0.5  # a is constant, b is not, c is a singleton
    assert got["count/groups_singleton"] == 1
    tolerant = values(batch, MetricSettings.from_options(new="new", old="old", zero_std_atol=0.6))
    assert tolerant["advantage/group_zero_std_frac"] == 1.0  # b has population std 0.5
    no_reward = make_batch(
        new=[[-1.0]] * 4, old=[[-1.0]] * 4, advantages=[0.0, 0.0, 1.0, -1.0], groups="aabb"
    )
    assert values(no_reward)["advantage/group_zero_std_frac"] == 0.5  # falls back to Ā_i


def test_empty_step_gives_nulls_not_nan():
    batch = make_batch(new=[[], []], old=[[], []], advantages=[1.0, -1.0], rollout=[[], []], entropy=[[], []])
    settings = MetricSettings.from_options(
        new="new", old="old", stream_a="rollout", stream_b="old", entropy="rc", divisor=2.0
    )
    result = compute_step_native(batch, settings)
    assert result.status == "empty"
    got = {v.key: v for v in result.values}
    for key, value in got.items():
        if key.startswith("count/"):
            assert value.value is not None and not math.isnan(value.value), key
        elif key != "advantage/group_zero_std_frac":
            assert value.value is None, key
    assert got["count/samples"].value == 2 and got["count/samples_empty"].value == 2


def test_one_token_step():
    batch = make_batch(new=[[-0.5]], old=[[-1.0]], advantages=[2.0], rollout=[[-1.1]])
    settings = MetricSettings.from_options(
        new="new", old="old", stream_a="rollout", stream_b="old", divisor=1.0
    )
    got = values(batch, settings)
    r = math.exp(0.5)
    assert got["policy/ratio_mean"] == pytest.approx(r, rel=1e-15)
    assert got["policy/ratio_std"] == 0.0
    assert got["policy/logratio_p50"] == 0.5
    assert got["policy/ess_token"] == 1.0
    assert got["loss/token_mean"] == pytest.approx(-2.0 * 1.2, abs=1e-15)  # binding high
    assert got["grad/token_mean_scale"] == 0.0
    assert got["mismatch/bias"] == pytest.approx(0.1, abs=1e-15)
    assert got["mismatch/pearson_r"] is None  # one point has no correlation
    assert got["mismatch/fit_slope"] is None
    assert got["grad/token_mean_length_corr"] is None


# ---- mismatch family ----------------------------------------------------------------------------------------


def test_mismatch_family_hand_values():
    rollout = [[-1.0, -2.0], [-0.5]]
    old = [[-1.1, -1.9], [-0.5]]
    settings = MetricSettings.from_options(stream_a="rollout", stream_b="old")
    result = compute_step_native(make_batch(old=old, rollout=rollout), settings)
    got = {v.key: v.value for v in result.values}
    delta = np.array([-0.1, 0.1, 0.0])
    assert got["mismatch/bias"] == pytest.approx(0.0, abs=1e-15)
    assert got["mismatch/rms"] == pytest.approx(math.sqrt(0.02 / 3), abs=1e-15)
    assert got["mismatch/sd"] == pytest.approx(math.sqrt(0.02 / 3), abs=1e-15)
    assert got["mismatch/abs_max"] == pytest.approx(0.1, abs=1e-15)
    assert got["mismatch/kl_k3"] == pytest.approx(np.mean(np.exp(delta) - 1 - delta), abs=1e-15)
    assert got["mismatch/kl_rev_k3"] == pytest.approx(
        np.mean(1 - np.exp(delta) + np.exp(delta) * delta), abs=1e-15
    )
    assert got["mismatch/tmpe"] == pytest.approx(np.mean(np.exp(np.abs(delta))), abs=1e-15)
    assert got["mismatch/chi2_token"] == pytest.approx(np.mean(np.exp(2 * delta)) - 1, abs=1e-15)
    # e^0.1 = 1.105 is above 1.1, e^−0.1 = 0.905 is inside [0.9, 1.1]
    assert got["mismatch/frac_out_10pct"] == pytest.approx(1 / 3, abs=1e-15)
    assert got["mismatch/frac_out_1pct"] == pytest.approx(2 / 3, abs=1e-15)
    assert got["mismatch/frac_out_2x"] == 0.0
    assert got["mismatch/seq_frac_out_strict"] == 0.0  # both sequence means are 0
    assert got["mismatch/chi2_seq"] == pytest.approx(0.0, abs=1e-15)
    assert got["mismatch/ess_seq"] == pytest.approx(1.0, abs=1e-15)
    assert got["mismatch/tau_fit"] is None and got["mismatch/tau_fit_rms"] is None
    assert got["count/mismatch_tokens"] == 3
    assert any("needs_recompute" in n for n in result.notices)
    assert "policy/ratio_mean" not in got  # no new stream: no policy family


# ---- steps and the pooled row -------------------------------------------------------------------------------


def test_docs_per_step_cuts_documents_and_marks_partial():
    batch = make_batch(
        new=[[-1.0], [-0.5], [-0.5], [-2.0], [-1.0]],
        old=[[-1.0], [-0.7], [-0.5], [-2.5], [-1.0]],
        advantages=[1.0, -1.0, 1.0, 1.0, -1.0],
        sample_ids=["d0", "d1", "d1", "d2", "d3"],  # rows 1 and 2 are two segments of one document
        groups=["a", "a", "b", "b", "c"],
        steps=[7, 7, 7, 7, 7],
    )
    settings = MetricSettings.from_options(new="new", old="old", docs_per_step=3)
    parts = split_steps(batch, settings)
    assert [(label, b.n_samples, status) for label, b, status in parts] == [
        ("0", 4, "ok"),
        ("1", 1, "partial"),
    ]
    rows = compute_native(batch, settings)
    assert [label for label, _ in rows] == ["0", "1", "all"]
    assert rows[1][1].status == "partial"
    first = rows[0][1].by_key()
    assert first["count/docs"].value == 3
    all_row = rows[2][1].by_key()
    assert all_row["count/groups_split"].value == 0
    # loss in the all row is the unweighted mean of the step losses
    mean = (first["loss/token_mean"].value + rows[1][1].by_key()["loss/token_mean"].value) / 2
    assert all_row["loss/token_mean"].value == pytest.approx(mean, abs=1e-15)
    # pooled non-loss keys use every token
    assert all_row["count/tokens"].value == 5


def test_groups_split_across_docs_per_step():
    batch = make_batch(new=[[-1.0]] * 4, old=[[-1.0]] * 4, advantages=[1.0, -1.0, 1.0, -1.0], groups="aabb")
    rows = compute_native(batch, MetricSettings.from_options(new="new", old="old", docs_per_step=3))
    assert rows[0][1].by_key()["count/groups_split"].value == 1  # b straddles the cut after 3 documents
    assert rows[1][1].by_key()["count/groups_split"].value == 1
    assert rows[2][1].by_key()["count/groups_split"].value == 1


def test_step_column_steps_and_pooled_groups():
    batch = make_batch(
        new=[[-1.0], [-0.5], [-1.0], [-0.2]],
        old=[[-1.0], [-0.7], [-1.5], [-0.2]],
        advantages=[1.0, -1.0, 1.0, -1.0],
        steps=[2, 2, 1, 1],
        groups=["g", "g", "g", "g"],  # the same group id in two steps: two prompts
    )
    rows = compute_native(batch, POLICY)
    assert [label for label, _ in rows] == ["1", "2", "all"]
    assert rows[2][1].by_key()["count/groups"].value == 2
    assert rows[2][1].by_key()["count/groups_split"].value == 0


# ---- catalog --------------------------------------------------------------------------------------------------


def test_every_emitted_key_is_in_the_catalog_and_every_catalog_key_can_be_emitted():
    batch = make_batch(
        new=[[-1.0, -1.7, -0.8], [-0.05, -1.8]],
        old=[[-1.0, -2.0, -0.5], [-0.3, -1.5]],
        rollout=[[-1.1, -2.0, -0.4], [-0.3, -1.6]],
        ref=[[-1.0, -1.9, -0.6], [-0.2, -1.5]],
        entropy=[[0.5, 1.0, 2.0], [0.1, 0.2]],
        advantages=[1.0, -1.0],
    )
    settings = MetricSettings.from_options(
        new="new",
        old="old",
        stream_a="rollout",
        stream_b="old",
        ref="ref",
        entropy="rc",
        divisor=4.0,
        grad_divisor=2.0,
        dual_clip=3.0,
        kept="rc",
    )
    # a kept-set recompute "rc": its kept mass and full-vocabulary log-probs (metrics.kept)
    batch = replace(
        batch,
        kept_mass={"rc": np.array([0.9, 1.0, 0.5, 0.8, 0.95])},
        full_vocab={"rc": np.array([-1.1, -2.0, -1.2, -0.5, -1.6])},
        kept_kl={"rc": np.array([0.01, np.nan, 0.002, 0.0, 0.03])},
    )
    emitted = {v.key for v in compute_step_native(batch, settings).values}
    assert emitted == {spec.key for spec in METRIC_CATALOG}


# ---- identity check -------------------------------------------------------------------------------------


def test_identity_check_passes_on_policy_and_names_what_breaks():
    lp = [[-0.3, -2.0, -1.1], [-0.7]]
    same = compute_step_native(make_batch(new=lp, old=lp, advantages=[1.0, -1.0]), POLICY)
    ok = check_identity(same)
    assert ok.passed and ok.logratio_absmax == 0.0 and ok.tokens == 4 and ok.deviations == ()
    drifted = compute_step_native(
        make_batch(new=[[-0.3, -2.0, -1.1], [-0.7 + 1e-7]], old=lp, advantages=[1, -1]), POLICY
    )
    failed = check_identity(drifted)
    assert not failed.passed
    assert failed.logratio_absmax == pytest.approx(1e-7, rel=1e-6)
    assert "policy/kl_k1" in failed.deviations and "policy/ratio_mean" in failed.deviations
    assert check_identity(drifted, tolerance=1e-6).passed
    invalid = compute_step_native(
        make_batch(new=[[-0.3, math.nan]], old=[[-0.3, -0.1]], advantages=[1.0]), POLICY
    )
    assert not check_identity(invalid, tolerance=1.0).passed  # an invalid token fails whatever the tolerance


def test_docs_metrics_page_embeds_the_catalog_and_alias_tables():
    page = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert catalog_markdown() in page
    assert aliases_markdown() in page


def test_batch_without_samples_gives_one_empty_all_row():
    batch = make_batch(new=[], old=[], advantages=[], lengths=[])
    rows = compute_native(batch, POLICY)
    assert [label for label, _ in rows] == ["all"]
    assert rows[0][1].status == "empty"
    assert all(v.value is None or not math.isnan(v.value) for v in rows[0][1].values)


def test_unsorted_step_column_gives_the_same_steps_as_sorted():
    kwargs = dict(
        new=[[-1.0], [-0.5, -0.2], [-1.0], [-0.2]],
        old=[[-1.2], [-0.7, -0.1], [-1.5], [-0.2]],
        advantages=[1.0, -1.0, 1.0, -1.0],
        groups=["a", "b", "a", "b"],
    )
    shuffled = compute_native(make_batch(steps=[1, 0, 1, 0], **kwargs), POLICY)
    labels = [label for label, _ in shuffled]
    assert labels == ["0", "1", "all"]
    step0 = compute_step_native(make_batch(**{k: [v[1], v[3]] for k, v in kwargs.items()}), POLICY)
    assert shuffled[0][1].by_key()["loss/token_mean"].value == step0.by_key()["loss/token_mean"].value


def test_document_reduction_joins_segments_of_one_document():
    # rows 0 and 1 are two segments of document "a" (same step and sample_id); row 2 is document "b"
    batch = make_batch(
        new=[[-0.9, -0.8], [-0.7], [-1.1]],
        old=[[-1.0, -1.0], [-1.0], [-1.0]],
        sample_ids=["a", "a", "b"],
    )

    def logratio_mean(reduction):
        settings = MetricSettings.from_options(new="new", old="old", metric_reduction=reduction)
        return values(batch, settings)["policy/logratio_mean"]

    assert logratio_mean("token") == pytest.approx((0.1 + 0.2 + 0.3 - 0.1) / 4, abs=1e-15)
    assert logratio_mean("sample") == pytest.approx((0.15 + 0.3 - 0.1) / 3, abs=1e-15)
    assert logratio_mean("document") == pytest.approx((0.2 - 0.1) / 2, abs=1e-15)
    assert values(batch)["count/docs"] == 2
