"""`whatif --losses A,B`: gradient parity of two loss definitions on a hand-computed step.

One step, s0 two tokens with A = +1, s1 one token with A = −1 (one group). Vanilla f = −A = (−1, −1, 1).
token_mean: c = 1/3 each; sample_mean: c = 1/(S·n_i) = (1/4, 1/4, 1/2).
"""

from __future__ import annotations

import math

import pytest

from pgdiag.analysis.settings import WhatifSettings, parse_losses
from pgdiag.analysis.whatif import whatif_batch
from pgdiag.errors import UsageError
from pgdiag.report.report import Report, summary_frame
from tests.metrics.metrics_batch_factory import make_batch

LN4 = math.log(4.0)


def parity(losses: str) -> dict[str, float]:
    batch = make_batch(
        rollout=[[-2 * LN4, -1.0], [-1.0]],
        old=[[-LN4, -1.0], [-1.0]],
        advantages=[1.0, -1.0],
        groups=["g", "g"],
    )
    settings = WhatifSettings(rules=(), losses=losses)
    rows = whatif_batch(batch, settings, behavior="rollout", target="old")
    report = Report(kind="whatif", summary=summary_frame(rows))
    frame = report.summary.filter(report.summary["breakdown"] == "losses")
    return dict(zip(frame["metric"].to_list(), frame["value"].to_list(), strict=True))


def test_aggregation_only_difference():
    got = parity("vanilla@token_mean,vanilla@sample_mean")
    # g_A = (−1/3, −1/3, 1/3), g_B = (−1/4, −1/4, 1/2): ‖g_A − g_B‖ / ‖g_A‖ = √(1/24) / √(1/3) = √(1/8)
    assert got["losses/rel_l2"] == pytest.approx(math.sqrt(1 / 8))
    assert got["losses/rel_l2_aggregation"] == pytest.approx(math.sqrt(1 / 8))
    assert got["losses/rel_l2_factor"] == pytest.approx(0.0)
    assert got["losses/grad_norm_ratio"] == pytest.approx(math.sqrt(9 / 8))


def test_per_token_factor_only_difference():
    # token TIS at 2: the first token's ratio 4 is truncated to 2, f_B = (−2, −1, 1)
    got = parity("vanilla@token_mean,token_tis:2@token_mean")
    assert got["losses/rel_l2"] == pytest.approx(math.sqrt(1 / 3))  # (1/3) / √(1/3)
    assert got["losses/rel_l2_aggregation"] == pytest.approx(0.0)
    assert got["losses/rel_l2_factor"] == pytest.approx(math.sqrt(1 / 3))


def test_definitions_parse_with_commas_inside_parameters():
    a, b = parse_losses("cispo:0.2,0.28@seq_mean_token_sum,vanilla@token_mean")
    assert a.label == "cispo:0.2,0.28@seq_mean_token_sum" and b.rule is None
    for bad in ("vanilla@token_mean", "vanilla@nope,vanilla@token_mean", "x@token_mean,vanilla@token_mean"):
        with pytest.raises(UsageError):
            parse_losses(bad)
