"""`whatif` as a fold: the accumulators kept between pieces (`Kish`, `LogKish`) against the one-read formula, and
`WhatifFold` fed one step at a time against the same fold fed the whole batch, on a batch built to stress the
pooling: heavy-tailed log ratios (weights from e^-20 to e^20 and one unclamped e^25 for prime-rl's rules), a
prompt group whose samples fall in two steps (prompt_mean's group tokens and the zero-advantage groups are
counted over the run, not per piece), an all-zero-advantage group, empty samples, and the rules whose scope is a
step (batch-normalised IS, M2PO over micro-batches)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pgdiag.analysis.replay import kish_ess
from pgdiag.analysis.settings import WhatifSettings, default_grid, parse_rule
from pgdiag.analysis.whatif import whatif_batch
from pgdiag.analysis.whatif_fold import Kish, LogKish, WhatifFold
from tests.metrics.metrics_batch_factory import make_batch

EXTRA = ("token_tis_bn:2", "seq_tis_bn:2", "m2po:0.04,scope=mb:2", "m2po:0.04", "token_veto:0.1", "ipo:0.1")


def _splits(x: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    return np.split(x, cuts)


@pytest.mark.parametrize("seed", range(5))
def test_kish_over_pieces_is_kish_of_all(seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = np.exp(rng.normal(0, 30, 200))  # 1e-40 .. 1e40: Σw² of the raw weights would lose the small ones
    w[rng.integers(0, 200, 20)] = 0.0
    cuts = sorted(rng.choice(np.arange(1, 200), 4, replace=False).tolist())
    kish = Kish()
    for part in _splits(w, cuts):
        kish.add(part)
    assert kish.value() == pytest.approx(kish_ess(w), rel=1e-12)
    with np.errstate(divide="ignore"):
        log_w = np.log(w)  # −inf for the zeros
    log_kish = LogKish()
    for part in [*_splits(log_w, cuts), np.zeros(0)]:
        log_kish.add(part)
    assert log_kish.value() == pytest.approx(kish_ess(np.exp(log_w - log_w.max())), rel=1e-12)


def test_kish_is_none_where_the_one_read_is_none() -> None:
    for parts in ([], [np.zeros(0)], [np.zeros(3), np.zeros(2)], [np.ones(2), np.array([np.nan])]):
        kish = Kish()
        for part in parts:
            kish.add(part)
        assert kish.value() is None
    kish = Kish()
    kish.add(np.array([1.0, np.inf]))
    assert kish.value() is None and kish_ess(np.array([1.0, np.inf])) is None
    log_kish = LogKish()
    log_kish.add(np.array([-np.inf, -np.inf]))
    log_kish.add(np.array([-np.inf]))
    assert log_kish.value() is None  # every sequence dropped: kish_ess of zeros
    log_kish.add(np.array([0.5]))
    assert log_kish.value() == pytest.approx(1 / 4)  # one weight among four sequences


def _stress_batches():
    """(whole batch, [one batch per step]) of 3 steps; groups g0 spans steps 0 and 1, g4 has A = 0 throughout."""
    rng = np.random.default_rng(11)
    steps, groups, lengths = [], [], []
    for step, names in enumerate((["g0", "g1", "g1"], ["g0", "g2", "g4", "g4"], ["g3", "g3", "g5"])):
        for name in names:
            steps.append(step)
            groups.append(name)
            # g5 is one empty sample (no tokens: not a zero-advantage group), g4 two of 3 tokens with A = 0
            lengths.append({"g5": 0, "g4": 3}.get(name, int(rng.integers(0, 7))))
    lengths[1] = 6
    samples = []
    for i, n in enumerate(lengths):
        old = -rng.exponential(1.0, n)
        rollout = old - rng.standard_t(2, n) * 2.0  # heavy tails: |Δ| past the ±20 clamp now and then
        if i == 1:
            rollout[0] = old[0] - 25.0  # an unclamped e^25 for prime-rl's rules
        new = old + rng.normal(0, 0.1, n)
        adv = 0.0 if groups[i] == "g4" else float(rng.normal())
        samples.append((old.tolist(), rollout.tolist(), new.tolist(), adv))

    def batch(rows: list[int]):
        return make_batch(
            old=[samples[i][0] for i in rows],
            rollout=[samples[i][1] for i in rows],
            new=[samples[i][2] for i in rows],
            advantages=[samples[i][3] for i in rows],
            groups=[groups[i] for i in rows],
            steps=[steps[i] for i in rows],
            sample_ids=[f"s{i}" for i in rows],
            lengths=[lengths[i] for i in rows],
        )

    whole = batch(list(range(len(lengths))))
    per_step = [batch([i for i, s in enumerate(steps) if s == step]) for step in range(3)]
    return whole, per_step


def test_fold_of_one_step_pieces_gives_the_rows_of_the_whole_batch() -> None:
    whole, per_step = _stress_batches()
    rules = (*default_grid(), *(parse_rule(r) for r in EXTRA))
    settings = WhatifSettings(
        rules=rules, divisor=64.0, losses="cispo:0.2,0.28@token_mean,vanilla@prompt_mean"
    )
    kwargs = {"behavior": "rollout", "target": "old", "new": "new"}
    with np.errstate(invalid="ignore"):
        expected = whatif_batch(whole, settings, **kwargs)
    fold = WhatifFold(settings, **kwargs, pair="test:rollout vs test:old", later="test:old vs test:new")
    with np.errstate(invalid="ignore"):  # SkyRL's binary KL of a probability past 1 − 1e-8 (as one read)
        for piece in per_step:
            fold.add(piece)
    found = fold.finish()
    assert [(r.breakdown, r.bucket, r.metric, r.n) for r in found] == [
        (r.breakdown, r.bucket, r.metric, r.n) for r in expected
    ]
    checked = 0
    for got, want in zip(found, expected, strict=True):
        if want.value is None or (isinstance(want.value, float) and math.isnan(want.value)):
            assert got.value is None or math.isnan(got.value), (got.bucket, got.metric)
            continue
        assert got.value == pytest.approx(want.value, rel=1e-12, abs=1e-14), (got.bucket, got.metric)
        checked += 1
    assert checked > 800  # every row but those None in both
    values = {(r.bucket, r.metric): r.value for r in found}
    assert values[("none", "whatif/zero_advantage_groups")] == 1.0  # g4 (g5 has no token)
    assert values[("none", "whatif/loss/prompt_mean")] is not None
