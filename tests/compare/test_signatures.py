"""Logprob-only diagnoses: one-sided temperature, outsized first token, processed log-probs, stale steps."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from batch_factory import make_batch, random_samples

from pgdiag.compare.api import compare_runs


def _codes(report) -> list[str]:
    return report.checks["code"].to_list()


def test_temperature_on_one_side_is_flagged_from_logprobs_alone() -> None:
    # side a sampled at T = 0.7 from logits z; side b evaluates the same tokens under softmax(z)
    samples = random_samples(5, 60, temperature_a=0.7)
    batch = make_batch(samples, label="run")
    report = compare_runs(batch, stream_a="rollout", stream_b="old").report
    assert "W401" in _codes(report)
    message = report.checks.filter(report.checks["code"] == "W401")["message"][0]
    assert "one side looks tempered" in message
    hint = report.value("mismatch/tau_hint", scope="token")
    assert hint is not None and 0.6 < hint < 0.85  # the OLS slope: a hint, not the exact fit
    assert report.value("mismatch/fit_slope", scope="token") == hint
    assert report.value("mismatch/tau_fit", scope="token") is None  # exact fit needs logits (--model)


def test_untempered_pair_raises_no_temperature_warning() -> None:
    samples = random_samples(5, 60)
    for s in samples:
        s["streams"]["old"] = s["streams"]["rollout"] + np.random.default_rng(0).normal(
            0, 1e-3, len(s["loss"])
        )
        s["streams"]["old"] = np.minimum(s["streams"]["old"], 0.0)
    report = compare_runs(make_batch(samples, label="run"), stream_a="rollout", stream_b="old").report
    assert "W401" not in _codes(report)
    assert abs(report.value("mismatch/tau_hint", scope="token") - 1.0) < 0.01


def test_first_token_carrying_the_error_is_w406() -> None:
    samples = random_samples(6, 120)
    b = copy.deepcopy(samples)
    for s in b:
        lp = s["streams"]["rollout"].copy()
        lp[0] -= 0.5  # only the first response token differs
        lp[1:] -= 0.01
        s["streams"]["rollout"] = lp
    report = compare_runs(make_batch(samples, label="a"), make_batch(b, label="b"), stream_a="rollout").report
    ratio = report.value("mismatch/first_token_ratio", scope="token")
    mean_first, mean_rest = 0.5, 0.01
    n_tok = report.value("count/mismatch_tokens", scope="token")
    expected = mean_first / ((120 * mean_first + (n_tok - 120) * mean_rest) / n_tok)
    assert ratio == expected or abs(ratio - expected) < 1e-9
    assert "W406" in _codes(report)
    first_bucket = report.value("mismatch/abs_mean", scope="token", breakdown="position", bucket="0")
    assert abs(first_bucket - 0.5) < 1e-12


def test_processed_logprobs_are_w403() -> None:
    samples = random_samples(7, 40)
    b = copy.deepcopy(samples)
    for s in b:
        s["streams"]["rollout"] = s["streams"]["rollout"] - 0.1  # trainer renormalises over the full vocab
    report = compare_runs(make_batch(samples, label="a"), make_batch(b, label="b"), stream_a="rollout").report
    message = report.checks.filter(report.checks["code"] == "W403")["message"][0]
    assert "on 100 % of tokens" in message and "implied kept mass 0.905" in message


def test_a_step_whose_error_jumps_is_w407() -> None:
    samples = random_samples(8, 70, steps=7)
    b = copy.deepcopy(samples)
    rng = np.random.default_rng(1)
    for s in b:
        scale = 0.05 if s["step"] == 6 else 0.005
        s["streams"]["rollout"] = s["streams"]["rollout"] - np.abs(rng.normal(0, scale, len(s["loss"])))
    report = compare_runs(make_batch(samples, label="a"), make_batch(b, label="b"), stream_a="rollout").report
    stale = report.checks.filter(report.checks["code"] == "W407")
    assert stale["step"].to_list() == [6]


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_step_sums_are_the_token_order_bincount_bit_for_bit(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W407's per-step Σ|Δ| (`step_sums`): slices summed by `np.add.accumulate` behind a carry when the samples
    come in step order, else the bincount; both must equal ``np.bincount(token_step, weights)`` bit for bit,
    with empty samples, steps without tokens, unsorted steps and values spanning 16 orders of magnitude."""
    from pgdiag.checks import signatures
    from pgdiag.checks.pairs import Locations

    monkeypatch.setattr(signatures, "SUM_CHUNK", chunk)
    rng = np.random.default_rng(11)
    for trial in range(60):
        n_samples = int(rng.integers(0, 30))
        counts = rng.integers(0, 6, n_samples)
        offsets = np.zeros(n_samples + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        steps = rng.integers(0, 5, n_samples)
        steps = np.sort(steps) if trial % 3 else steps
        where = Locations(offsets, np.zeros(int(offsets[-1]), np.int32), steps, np.zeros(n_samples, object))
        unique, code = np.unique(steps, return_inverse=True)
        code = code.reshape(-1)
        values = np.abs(rng.normal(0.0, 1.0, int(offsets[-1]))) * 10.0 ** rng.integers(
            -8, 8, int(offsets[-1])
        )
        expected = np.bincount(code[where.token_sample()], weights=values, minlength=unique.size)
        got = signatures.step_sums(values, code, where, unique.size)
        assert got.tobytes() == expected.tobytes(), trial
