"""The landed corrections as whatif rules (pgdiag/analysis/rules.py), on hand-computed batches.

Every planted number is in the test. Comparisons on a threshold follow each framework's operator, read at:
verl 1dda039 (`<=`, `>=` inclusive), NeMo-RL 7ea279a (`>=`/`<=`), TRL 1.16 OPSM (`<=` keeps), prime-rl 559b447
(`>` drops), SkyRL a956457 (`>`/`<` strict band for rollout_is), AReaL cbff54d (`<` strict suffix mean for M2PO).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pgdiag.analysis.rules import Replay, apply_named_rule, verl_chain
from pgdiag.analysis.settings import CorrectionRule, WhatifSettings, parse_rule
from pgdiag.analysis.whatif import whatif_batch
from pgdiag.errors import UsageError
from pgdiag.report.report import Report, summary_frame
from tests.metrics.metrics_batch_factory import make_batch

LN2 = math.log(2.0)


def replay(base, cur, adv, steps=None, reward=None) -> Replay:
    lengths = [len(s) for s in base]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pos = (
        np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]) if lengths else np.zeros(0, np.int32)
    )
    adv_tok = np.concatenate([np.full(n, a, dtype=np.float64) for n, a in zip(lengths, adv, strict=True)])
    return Replay(
        base=np.concatenate([np.asarray(s, np.float64) for s in base]),
        cur=np.concatenate([np.asarray(s, np.float64) for s in cur]),
        offsets=offsets,
        step=np.asarray(steps if steps is not None else [0] * len(base), np.int64),
        pos=pos,
        advantages=adv_tok,
        reward=None if reward is None else np.asarray(reward, np.float64),
    )


def test_verl_token_k1_keeps_values_exactly_on_the_bounds():
    # Δ = ln 2 -> k1 = −ln 2 = log(0.5): on the lower bound, kept (>=); Δ = −ln 2 -> k1 = log 2: kept (<=)
    r = replay([[-2 * LN2, -LN2, -1.0]], [[-LN2, -2 * LN2, -0.5]], [0.0])
    keep = apply_named_rule("token_k1", ("0.5", "2"), r).keep
    assert keep.tolist() == [True, True, True]
    keep = apply_named_rule("token_k1", ("0.6", "2"), r).keep  # log 0.6 > −ln 2: the first token leaves
    assert keep.tolist() == [False, True, True]


def test_verl_k2_k3_and_sequence_aggregations_chain_with_and():
    # Δ = (1, −1, 0): k2 = (0.5, 0.5, 0); sum 1.0, mean 1/3, max 0.5
    r = replay([[0.0, 0.0, 0.0], [0.0]], [[1.0, -1.0, 0.0], [0.0]], [1.0, 1.0])
    assert apply_named_rule("token_k2", ("0.5",), r).keep.tolist() == [True, True, True, True]  # 0.5 <= 0.5
    assert apply_named_rule("seq_sum_k2", ("0.99",), r).keep.tolist() == [False] * 3 + [True]
    assert apply_named_rule("seq_mean_k2", ("0.34",), r).keep.tolist() == [True] * 4
    assert apply_named_rule("seq_max_k2", ("0.4",), r).keep.tolist() == [False] * 3 + [True]
    # k3 = e^Δ − 1 − Δ: e − 2 = 0.71828 at Δ = 1
    assert apply_named_rule("token_k3", ("0.7",), r).keep.tolist() == [False, True, True, True]
    chained = verl_chain([("token_k2", (1.0,)), ("seq_max_k2", (0.4,))], r)
    assert chained.keep.tolist() == [False] * 3 + [True]
    assert parse_rule("token_k1:0.5,2+seq_max_k2:1").label == "token_k1:0.5,2+seq_max_k2:1"


def test_opsm_drops_a_long_negative_advantage_sequence_and_never_a_positive_one():
    # 200 tokens with log μ − log π = 0.06 each: mean 0.06 > δ = 0.05
    long = [[-1.0] * 200]
    drifted = [[-1.06] * 200]
    r = replay(long * 3, drifted * 3, [-1.0, 1.0, 0.0])
    keep = apply_named_rule("opsm", ("0.05",), r).keep.reshape(3, 200)
    assert keep[0].tolist() == [False] * 200  # A < 0 and KL > δ: the whole sequence
    assert keep[1].all() and keep[2].all()  # A > 0, and A = 0 (TRL keeps A >= 0)
    # exactly on δ: kept (<=); the per-token KL is exact in binary (0.5 − 0.25)
    on = replay([[-0.25, -0.25]], [[-0.5, -0.5]], [-1.0])
    assert apply_named_rule("opsm", ("0.25",), on).keep.all()


def test_opsm_matches_trl_get_off_policy_mask():
    from trl import GRPOTrainer

    rng = np.random.default_rng(3)
    base = [rng.normal(-1, 0.3, 7).tolist() for _ in range(6)]
    cur = [(np.asarray(b) + rng.normal(0, 0.2, 7)).tolist() for b in base]
    adv = [-1.0, 1.0, 0.0, -0.5, -2.0, 0.5]
    ours = apply_named_rule("opsm", ("0.05",), replay(base, cur, adv)).keep.reshape(6, 7)
    theirs = GRPOTrainer.get_off_policy_mask(
        advantages=torch.tensor(adv, dtype=torch.float64).unsqueeze(1),
        per_token_logps=torch.tensor(cur, dtype=torch.float64),
        sampling_per_token_logps=torch.tensor(base, dtype=torch.float64),
        mask=torch.ones(6, 7, dtype=torch.float64),
        off_policy_threshold=0.05,
    )
    assert ours[:, 0].tolist() == theirs[:, 0].bool().tolist()
    assert (~ours[:, 0]).any()  # the case is exercised


def test_m2po_sorts_the_whole_step_and_keeps_masked_tokens_in_the_denominator():
    # m2 = (log μ − log π)² = 9, 4, 1, 0 over two sequences of one step; τ = 1:
    # suffix means from the largest: 14/4 = 3.5, 5/3, 1/2 -> the first below 1 is index 2: mask 9 and 4
    r = replay([[0.0, 0.0], [0.0, 0.0]], [[-3.0, -1.0], [-2.0, 0.0]], [1.0, -1.0])
    effect = apply_named_rule("m2po", ("1",), r)
    assert effect.weight.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert effect.keep.all()  # still in the loss denominator
    # per micro-batch of one sequence each: [9, 1] -> means 5, 1 (not < 1) -> n − 1 = 1 masked; [4, 0] -> 2, 0
    split = apply_named_rule("m2po", ("1", "scope=mb:2"), r)
    assert split.weight.tolist() == [0.0, 1.0, 0.0, 1.0]
    # τ exactly equal to the suffix mean 1/2 is not strictly below: mask three (n − 1 at most)
    assert apply_named_rule("m2po", ("0.5",), r).weight.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert parse_rule("m2po:0.04,scope=mb:4").args == ("0.04", "scope=mb:4")


def test_prime_rl_dppo_tv_masks_by_the_sign_of_a_and_keeps_the_kl_gradient():
    # μ = 0.5 everywhere; p = 0.7 (diff +0.2, exactly on δ_hi: kept, `>` drops) and p = 0.75 (dropped for A > 0)
    lm = math.log(0.5)
    r = replay(
        [[lm, lm], [lm, lm], [lm]],
        [[math.log(0.7), math.log(0.75)], [math.log(0.25), math.log(0.75)], [math.log(0.25)]],
        [1.0, -1.0, 0.0],
    )
    effect = apply_named_rule("dppo_tv", ("0.2", "0.2"), r)
    # A = −1: diff −0.25 < −0.2 dropped; diff +0.25 kept; A = 0 takes the low side (where(A > 0, hi, lo)): dropped
    assert effect.keep.tolist() == [True, False, False, True, False]
    d = r.log_ratio
    expected = -r.advantages * np.exp(d) * effect.keep + 2 * 1e-3 * d
    np.testing.assert_allclose(effect.grad, expected)
    assert effect.grad[0] == pytest.approx(-1.4 + 2e-3 * math.log(1.4))


def test_seq_mask_tis_uses_the_geometric_mean_and_untruncated_token_weights():
    # Δ = (ln 2, −ln 2): geometric mean 1 (kept in [0.999, 1.002]); weights 2 and 0.5 untruncated
    r = replay([[-2 * LN2, -LN2], [-1.0]], [[-LN2, -2 * LN2], [-0.99]], [1.0, 1.0])
    effect = apply_named_rule("seq_mask_tis", ("0.999", "1.002"), r)
    np.testing.assert_allclose(effect.weight[:2], [2.0, 0.5])
    assert effect.keep.tolist() == [True, True, False]  # e^0.01 = 1.01005 > 1.002


def test_seq_logprob_error_and_token_veto():
    # mean exp|Δ| of (ln 2, 0) = 1.5: on τ = 1.5 kept (<=); token veto: min ρ = 0.5 < 0.6 drops the sequence
    r = replay([[-2 * LN2, -1.0]], [[-LN2, -1.0]], [1.0])
    assert apply_named_rule("seq_logprob_error", ("1.5",), r).keep.all()
    assert not apply_named_rule("seq_logprob_error", ("1.49",), r).keep.any()
    r2 = replay([[-LN2, -1.0]], [[-2 * LN2, -1.0]], [1.0])
    assert not apply_named_rule("token_veto", ("0.6",), r2).keep.any()
    assert apply_named_rule("token_veto", ("0.5",), r2).keep.all()  # exactly τ: not below


def test_cispo_and_rollout_is_bands():
    # ρ = 2, 1, 0.5: CISPO clips to [0.8, 1.28]; rollout_is zeroes outside the open band (0.8, 1.28)
    r = replay([[-2 * LN2, -1.0, -LN2]], [[-LN2, -1.0, -2 * LN2]], [-1.0])
    cispo = apply_named_rule("cispo", ("0.2", "0.28"), r)
    np.testing.assert_allclose(cispo.weight, [1.28, 1.0, 0.8])
    np.testing.assert_allclose(cispo.grad, [1.28, 1.0, 0.8])  # −A·sg(w)
    rollout_is = apply_named_rule("rollout_is", ("0.5", "1.0"), r)  # band (0.5, 2): both ends excluded
    np.testing.assert_allclose(rollout_is.weight, [0.0, 1.0, 0.0])


def test_rules_signal_kept_and_sign_split():
    batch = make_batch(
        rollout=[[-1.0, -1.0], [-1.0, -1.0]],
        old=[[-1.5, -1.5], [-1.0, -1.0]],
        advantages=[-2.0, 1.0],
        groups=["g", "g"],
    )
    rule = parse_rule("opsm:0.1")  # seq 0: A < 0, KL 0.5 > 0.1 -> dropped; it holds 4 of the 6 units of |A|
    rows = whatif_batch(batch, WhatifSettings(rules=(rule,)), behavior="rollout", target="old")
    report = Report(kind="whatif", summary=summary_frame(rows))
    value = lambda m: report.value(m, breakdown="threshold", bucket="opsm:0.1")
    assert value("whatif/signal_kept") == pytest.approx(2 / 6)
    assert value("whatif/signal_kept_pos") == pytest.approx(1.0)
    assert value("whatif/signal_kept_neg") == pytest.approx(0.0)
    assert value("whatif/grad_coef_ratio") == pytest.approx(2 / 6)


def test_proximal_theta_rules_are_na_without_a_new_stream():
    batch = make_batch(rollout=[[-1.0]], old=[[-1.2]], advantages=[1.0], groups=["g"])
    rows = whatif_batch(
        batch, WhatifSettings(rules=(parse_rule("cispo:0.2,0.28"),)), behavior="rollout", target="old"
    )
    report = Report(kind="whatif", summary=summary_frame(rows))
    assert report.value("whatif/tokens_kept", breakdown="threshold", bucket="cispo:0.2,0.28") is None
    with_new = make_batch(rollout=[[-1.0]], old=[[-1.2]], new=[[-1.2 + LN2]], advantages=[1.0], groups=["g"])
    rows = whatif_batch(
        with_new,
        WhatifSettings(rules=(parse_rule("cispo:0.2,0.28"),)),
        behavior="rollout",
        target="old",
        new="new",
    )
    report = Report(kind="whatif", summary=summary_frame(rows))
    assert report.value(
        "whatif/grad_coef_ratio", breakdown="threshold", bucket="cispo:0.2,0.28"
    ) == pytest.approx(1.28)


@pytest.mark.parametrize(
    "spec", ["opsm", "opsm:x", "nope:1", "roll:bad,ratio,0,1", "token_k1:2", "m2po:1,scope=xx"]
)
def test_malformed_rules_are_e503(spec):
    with pytest.raises(UsageError):
        rule = parse_rule(spec)
        if rule.kind == "m2po":
            from pgdiag.analysis.rules import m2po_scope

            m2po_scope(rule.args)


def test_classic_rules_still_parse_through_rule():
    assert parse_rule("icepop:0.5,5") == CorrectionRule("icepop", 5.0, 0.5)
    assert parse_rule("token_tis:2") == CorrectionRule("token_tis", 2.0)


def test_areal_unified_rejection_levels_and_actions():
    # Δ = (ln 2, −ln 2, 0) in one sequence: geometric mean 1, token ratios 2, 0.5, 1
    r = replay([[-2 * LN2, -LN2, -1.0]], [[-LN2, -2 * LN2, -1.0]], [1.0])
    token_mask = apply_named_rule("areal_rs", ("token", "mask", "ratio", "mean", "2", "0.5"), r)
    assert token_mask.keep.tolist() == [True, True, True]  # 2 and 0.5 exactly on the bounds: kept
    np.testing.assert_allclose(token_mask.weight, [2.0, 0.5, 1.0])
    seq = apply_named_rule("areal_rs", ("sequence", "mask", "ratio", "mean", "1.5", "0.9"), r)
    np.testing.assert_allclose(seq.weight, [1.0, 1.0, 1.0])  # the geometric mean on every token
    assert seq.keep.all()
    # token clamp on a KL metric clamps every weight to [0, upper] (AReaL clamps the weight, not the metric)
    clamp = apply_named_rule("areal_rs", ("token", "clamp", "kl_k2", "mean", "1.5"), r)
    np.testing.assert_allclose(clamp.weight, [1.5, 0.5, 1.0])
    # sequence max of k2 = ½(ln 2)² = 0.2402 > 0.2: the whole sequence out of bounds
    assert not apply_named_rule("areal_rs", ("sequence", "mask", "kl_k2", "max", "0.2"), r).keep.any()


def test_prime_rl_ref_kl_one_sided_mask_and_reference_advantage():
    # μ = 0.5; p = 0.3 (p − μ = −0.2, exactly on the bound: kept, `<` drops) and p = 0.25 (dropped)
    lm = math.log(0.5)
    base, cur, ref = [lm, lm], [math.log(0.3), math.log(0.25)], [math.log(0.4), math.log(0.4)]
    r = replay([base], [cur], [7.0])  # the scalar advantage is not read
    r = Replay(r.base, r.cur, r.offsets, r.step, r.pos, r.advantages, ref=np.asarray(ref))
    effect = apply_named_rule("ref_kl", (), r)
    assert effect.keep.tolist() == [True, False]
    rho, d = 0.3 / 0.5, math.log(0.3 / 0.5)
    assert effect.grad[0] == pytest.approx(-(math.log(0.4) - math.log(0.3)) * rho + 2e-3 * d)
    assert effect.grad[1] == pytest.approx(2e-3 * math.log(0.25 / 0.5))  # only the KL term is left
    batch = make_batch(rollout=[[-1.0]], old=[[-1.2]], advantages=[1.0], groups=["g"])
    rows = whatif_batch(
        batch, WhatifSettings(rules=(parse_rule("ref_kl"),)), behavior="rollout", target="old"
    )
    report = Report(kind="whatif", summary=summary_frame(rows))
    assert report.value("whatif/tokens_kept", breakdown="threshold", bucket="ref_kl") is None  # no ref: n/a
