"""`whatif` rules on a hand-computed batch, and agreement with verl 0.9.1's rollout-correction formulas.

The batch (loss positions only; d = log π_old − log π_rollout per token):
  s0: d = (ln 2, ln 2, ln 2)  A = +1   token ratios 2, product 8, geometric mean 2
  s1: d = (0, ln 4)           A = −1   token ratios 1 and 4, product 4, geometric mean 2
  s2: empty sequence          A = +1
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pgdiag.analysis.settings import CorrectionRule, WhatifSettings, default_grid
from pgdiag.analysis.whatif import apply_rule, kish_ess, whatif_batch
from pgdiag.errors import UsageError
from pgdiag.report.report import Report, summary_frame
from tests.metrics.metrics_batch_factory import make_batch

LN2, LN4 = math.log(2.0), math.log(4.0)


def hand_batch():
    # chosen so that d is exact in binary floating point: −ln 2 − (−2 ln 2) = ln 2
    rollout = [[-2 * LN2, -2 * LN2, -2 * LN2], [-0.5, -2 * LN4], []]
    old = [[-LN2, -LN2, -LN2], [-0.5, -LN4], []]
    return make_batch(rollout=rollout, old=old, advantages=[1.0, -1.0, 1.0], groups=["g0", "g1", "g2"])


def replay(*rules: CorrectionRule) -> Report:
    rows = whatif_batch(hand_batch(), WhatifSettings(rules=rules), behavior="rollout", target="old")
    return Report(kind="whatif", summary=summary_frame(rows))


def cell(report: Report, rule: CorrectionRule | str, metric: str) -> float | None:
    bucket = rule if isinstance(rule, str) else rule.label
    return report.value(f"whatif/{metric}", breakdown="threshold", bucket=bucket)


def test_token_tis_token_exactly_at_cap_is_not_truncated():
    rule = CorrectionRule("token_tis", 2.0)
    report = replay(rule)
    # ratios 2, 2, 2 (exactly at C: kept whole), 1, 4 (truncated to 2)
    assert cell(report, rule, "tokens_affected") == pytest.approx(1 / 5)
    assert cell(report, rule, "seqs_affected") == pytest.approx(1 / 2)  # s2 is empty: not counted
    assert cell(report, rule, "tokens_kept") == pytest.approx(1.0)
    # weights 2, 2, 2, 1, 2: (Σw)² / (n Σw²) = 81 / (5 · 17)
    assert cell(report, rule, "ess_token_after") == pytest.approx(81 / 85)
    # before: ratios 2, 2, 2, 1, 4: 121 / (5 · 29)
    assert cell(report, rule, "ess_token_before") == pytest.approx(121 / 145)
    # sequence weights before: 8 and 4 -> 144 / (2 · 80)
    assert cell(report, rule, "ess_seq_before") == pytest.approx(0.9)
    # token_mean: uncorrected −(1+1+1−1−1)/5 = −0.2; with w: −(2+2+2−1−2)/5 = −0.6
    assert cell(report, "none", "loss/token_mean") == pytest.approx(-0.2)
    assert cell(report, rule, "loss_delta/token_mean") == pytest.approx(-0.4)


def test_product_truncated_while_geometric_mean_is_not():
    seq_tis = CorrectionRule("seq_tis", 5.0)
    geo = CorrectionRule("geo_mask", 2.5, 0.4)
    report = replay(seq_tis, geo)
    # s0: product 8 > 5 -> its 3 tokens truncated; s1: product 4 stays
    assert cell(report, seq_tis, "tokens_affected") == pytest.approx(3 / 5)
    assert cell(report, seq_tis, "seqs_affected") == pytest.approx(1 / 2)
    # sequence weights 5 and 4: 81 / (2 · 41)
    assert cell(report, seq_tis, "ess_seq_after") == pytest.approx(81 / 82)
    # geometric mean of π_rollout/π_old is 1/2 for both sequences: inside [0.4, 2.5], nothing dropped
    assert cell(report, geo, "tokens_affected") == 0.0
    assert cell(report, geo, "seqs_affected") == 0.0
    assert cell(report, geo, "loss_delta/token_mean") == pytest.approx(0.0)


def test_sequence_mis_drops_the_whole_sequence_and_renormalises():
    rule = CorrectionRule("seq_mis", 5.0, 0.2)
    report = replay(rule)
    # Σ(−d): s0 −3 ln 2 (1/8 < 0.2, dropped), s1 −ln 4 (1/4, kept)
    assert cell(report, rule, "tokens_kept") == pytest.approx(2 / 5)
    assert cell(report, rule, "seqs_affected") == pytest.approx(1 / 2)
    # token_mean over the two kept tokens of s1, A = −1, w = 1: loss +1; delta 1 − (−0.2)
    assert cell(report, rule, "loss_delta/token_mean") == pytest.approx(1.2)
    # MIS weights are 0/1: token ESS after = kept fraction
    assert cell(report, rule, "ess_token_after") == pytest.approx(2 / 5)


def test_token_mis_and_icepop_bounds_are_inclusive():
    mis = CorrectionRule("token_mis", 2.0, 0.5)  # on π_rollout/π_old, verl token_k1
    ice = CorrectionRule("icepop", 3.0, 1.0)  # on π_old/π_rollout; the ratio-1 token sits on A
    report = replay(mis, ice)
    # token_mis: π_rollout/π_old = 0.5 (x3, on the bound: kept), 1, 0.25 (dropped)
    assert cell(report, mis, "tokens_kept") == pytest.approx(4 / 5)
    # icepop [1, 3]: ratio 1 kept (on the bound), 2 kept, 4 dropped
    assert cell(report, ice, "tokens_affected") == pytest.approx(1 / 5)
    # icepop keeps the ratio as weight: Σ A w = 2+2+2−1 = 5 -> −1; delta −0.8
    assert cell(report, ice, "loss_delta/token_mean") == pytest.approx(-0.8)


def test_where_the_data_is_lost():
    rule = CorrectionRule("token_tis", 2.0)
    batch = hand_batch()
    rows = whatif_batch(batch, WhatifSettings(rules=(rule,)), behavior="rollout", target="old")
    report = Report(kind="whatif", summary=summary_frame(rows))
    assert report.value("whatif/tokens_affected", breakdown="threshold/step", bucket="token_tis:2|0") == (
        pytest.approx(1 / 5)
    )
    # make_batch puts the prompt at 4 and positions at 0..4: the truncated token has resp_pos 0 -> [0,64)
    assert report.value(
        "whatif/tokens_affected", breakdown="threshold/position", bucket="token_tis:2|[0,64)"
    ) == (pytest.approx(1 / 5))


def test_default_grid_and_bad_rules():
    labels = [r.label for r in default_grid()]
    assert labels[:4] == ["token_tis:1.5", "token_tis:2", "token_tis:3", "token_tis:5"]
    assert "seq_tis:10" in labels and "icepop:0.5,5" in labels and "seq_mis:0.1,10" in labels
    with pytest.raises(UsageError):
        CorrectionRule("icepop", 5.0)
    with pytest.raises(UsageError):
        CorrectionRule("token_mis", 0.5, 2.0)
    with pytest.raises(UsageError):
        CorrectionRule("token_tis", -1.0)
    assert kish_ess(np.zeros(3)) is None


# --- verl 0.9.1, verl/trainer/ppo/rollout_corr_helper.py, quoted on padded (B, T) tensors -----------------------
# compute_rollout_correction_weights:
#   token:    w = exp(clamp(log_ratio, -20, 20)) * response_mask
#   sequence: w = exp(clamp(masked_sum(log_ratio, mask, -1), -20, 20)).expand_as(log_ratio) * response_mask
#   TIS (threshold C): w.clamp(max=C);  "lo_hi" (IcePop): where(lo <= w <= hi, w, 0)
# compute_rollout_rejection_mask (k1 options, "lo_hi"): token_k1 = -clamp(log_ratio, -20, 20)
#   token_k1:    keep = (token_k1 >= log lo) & (token_k1 <= log hi)
#   seq_sum_k1:  keep = masked_sum(token_k1)  in [log lo, log hi], broadcast over the row
#   seq_mean_k1: keep = masked_mean(token_k1) in [log lo, log hi]; masked_mean = sum / (mask.sum() + 1e-8)
SAFETY_BOUND = 20.0


def verl_is_weights(log_ratio, mask, level, upper, lower=None):
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        total = (log_ratio * mask).sum(dim=-1, keepdim=True)
        raw = torch.exp(torch.clamp(total, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def verl_rs_keep(log_ratio, mask, option, lower, upper):
    k1 = -torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    lo, hi = math.log(lower), math.log(upper)
    if option == "token_k1":
        return (k1 >= lo) & (k1 <= hi)
    total = (k1 * mask).sum(dim=-1)
    stat = total if option == "seq_sum_k1" else total / (mask.sum(dim=-1) + 1e-8)
    return ((stat >= lo) & (stat <= hi)).unsqueeze(-1).expand_as(mask)


def test_rules_agree_with_verl_formulas():
    rng = np.random.default_rng(0)
    lengths = [5, 1, 8, 3, 7]
    d_rows = [rng.normal(0.0, 0.6, n) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate(d_rows)
    width = max(lengths)
    log_ratio = torch.zeros(len(lengths), width, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.float64)
    for i, row in enumerate(d_rows):
        log_ratio[i, : len(row)] = torch.from_numpy(row)
        mask[i, : len(row)] = 1.0
    valid = mask.bool()

    cases = [
        (CorrectionRule("token_tis", 1.5), lambda: verl_is_weights(log_ratio, mask, "token", 1.5), None),
        (
            CorrectionRule("icepop", 2.0, 0.7),
            lambda: verl_is_weights(log_ratio, mask, "token", 2.0, 0.7),
            None,
        ),
        (CorrectionRule("seq_tis", 2.0), lambda: verl_is_weights(log_ratio, mask, "sequence", 2.0), None),
        (
            CorrectionRule("token_mis", 1.5, 0.6),
            None,
            lambda: verl_rs_keep(log_ratio, mask, "token_k1", 0.6, 1.5),
        ),
        (
            CorrectionRule("seq_mis", 3.0, 0.4),
            None,
            lambda: verl_rs_keep(log_ratio, mask, "seq_sum_k1", 0.4, 3.0),
        ),
        (
            CorrectionRule("geo_mask", 1.2, 0.8),
            None,
            lambda: verl_rs_keep(log_ratio, mask, "seq_mean_k1", 0.8, 1.2),
        ),
    ]
    for rule, weights, keep in cases:
        effect = apply_rule(rule, flat, offsets)
        if weights is not None:
            np.testing.assert_allclose(
                effect.weight, weights()[valid].numpy(), rtol=1e-12, err_msg=rule.label
            )
            assert effect.keep.all()
        if keep is not None:
            np.testing.assert_array_equal(effect.keep, keep()[valid].numpy(), err_msg=rule.label)
            assert (effect.weight == 1.0).all()
        # at least one token on each side, so the comparison can fail
        flags = effect.affected
        assert flags.any() and not flags.all(), rule.label
