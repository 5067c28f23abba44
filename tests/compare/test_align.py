"""Alignment of two runs: joins, and every injected fault caught with its code, exit code 3 and location."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from batch_factory import make_batch, random_samples

from pgdiag.compare.align import align_batches
from pgdiag.compare.api import compare_runs
from pgdiag.compare.matching import content_hash
from pgdiag.errors import EXIT_INVALID, InvalidInputError


def _pair(seed: int = 0, n: int = 12):
    samples = random_samples(seed, n)
    return samples, copy.deepcopy(samples)


def _fails(a, b, code: str, **kwargs) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        align_batches(a, b, stream_a="rollout", stream_b="rollout", **kwargs)
    assert info.value.code == code, info.value.message
    assert info.value.exit_code == EXIT_INVALID
    return info.value


def test_identical_runs_align_token_for_token() -> None:
    sa, sb = _pair()
    a, b = make_batch(sa, label="a"), make_batch(sb, label="b")
    pair = align_batches(a, b, stream_a="rollout", stream_b="rollout")
    assert pair.join == "id"
    assert pair.n_samples == 12 and pair.n_tokens == a.n_tokens
    assert np.array_equal(pair.lp_a, pair.lp_b)
    assert pair.issues == ()
    assert pair.resp_pos.min() == 0  # every sample starts its response at prompt_len


def test_ids_differ_falls_back_to_seq_hash_and_pairs_duplicates_in_order() -> None:
    sa, sb = _pair()
    for i, s in enumerate(sb):
        s["sample_id"] = f"other-{i:02d}"
    sb.reverse()  # row order differs too
    a, b = make_batch(sa, label="a"), make_batch(sb, label="b")
    pair = align_batches(a, b, stream_a="rollout", stream_b="rollout")
    assert pair.join == "hash"
    assert pair.n_samples == 12
    assert np.array_equal(pair.lp_a, pair.lp_b)
    assert [str(s) for s in pair.sample_id_b] == [f"other-{i:02d}" for i in range(12)]


def test_identical_sequences_in_one_step_pair_by_sample_id() -> None:
    sa, _ = _pair()
    twin = copy.deepcopy(sa[0])
    twin["sample_id"] = "s0b"
    twin["streams"] = {k: v - 0.5 for k, v in twin["streams"].items()}
    sa = [sa[0], twin]
    sb = copy.deepcopy(sa)
    sb[0]["sample_id"], sb[1]["sample_id"] = "x1", "x2"
    sb[0]["streams"], sb[1]["streams"] = sa[0]["streams"], sa[1]["streams"]
    a, b = make_batch(sa, label="a"), make_batch(sb, label="b")
    assert content_hash(a)[0] == content_hash(a)[1]
    pair = align_batches(a, b, stream_a="rollout", stream_b="rollout", join="hash")
    assert [str(s) for s in pair.sample_id_b] == ["x1", "x2"]
    assert np.array_equal(pair.lp_a, pair.lp_b)


def test_shift_by_one_position_is_e302() -> None:
    sa, sb = _pair(n=24)  # the shift test needs 200 adjacent token pairs (`checks.pairs.MIN_STAT_TOKENS`)
    for s in sb:
        lp = s["streams"]["rollout"]
        s["streams"]["rollout"] = np.concatenate([lp[1:], lp[-1:]])  # b's value for token i sits at i - 1
    error = _fails(make_batch(sa, label="a"), make_batch(sb, label="b"), "E302")
    assert "shifted by -1" in error.message
    assert "first: step 0, sample s0" in error.message


def test_zero_filled_logprobs_are_e206() -> None:
    sa, sb = _pair()
    sb[3]["streams"]["rollout"] = np.zeros_like(sb[3]["streams"]["rollout"])
    error = _fails(make_batch(sa, label="a"), make_batch(sb, label="b"), "E206")
    assert "b rollout_logprobs" in error.message
    assert "sample s3" in error.message


def test_missing_sample_is_e306_and_ignorable() -> None:
    sa, sb = _pair()
    del sb[5]
    a, b = make_batch(sa, label="a"), make_batch(sb, label="b")
    error = _fails(a, b, "E306")
    assert "1 of 12 samples of a have no match in b" in error.message
    assert "step 1, sample s5" in error.message
    pair = align_batches(a, b, stream_a="rollout", stream_b="rollout", ignore=("E306",))
    assert pair.n_samples == 11


def test_token_id_differing_at_one_position_is_e301() -> None:
    sa, sb = _pair()
    p = sb[4]["loss"][2]
    sb[4]["input_ids"][p] = sb[4]["input_ids"][p] + 1
    error = _fails(make_batch(sa, label="a"), make_batch(sb, label="b"), "E301")
    old = sa[4]["input_ids"][p]
    assert (
        f"1 matched samples differ in tokens (first at step 0, sample s4, pos {p}: {old} vs {old + 1})"
        in (error.message)
    )


def test_nothing_matched_is_e304() -> None:
    sa, sb = _pair()
    for s in sb:
        s["step"] += 100
    error = _fails(make_batch(sa, label="a"), make_batch(sb, label="b"), "E304")
    assert "steps 0-1 vs 100-101" in error.message


def test_nan_is_e207_or_dropped_and_counted() -> None:
    sa, sb = _pair()
    sb[2]["streams"]["rollout"] = sb[2]["streams"]["rollout"].copy()
    sb[2]["streams"]["rollout"][1] = np.nan
    a, b = make_batch(sa, label="a"), make_batch(sb, label="b")
    error = _fails(a, b, "E207")
    assert f"sample s2, pos {sa[2]['loss'][1]}" in error.message
    pair = align_batches(a, b, stream_a="rollout", stream_b="rollout", ignore=("E207",))
    assert pair.n_invalid == 1 and pair.n_tokens == a.n_tokens - 1
    assert np.isfinite(pair.lp_b).all()


def test_positive_logprob_is_e205() -> None:
    sa, sb = _pair()
    sb[1]["streams"]["rollout"] = sb[1]["streams"]["rollout"].copy()
    sb[1]["streams"]["rollout"][0] = 0.3
    _fails(make_batch(sa, label="a"), make_batch(sb, label="b"), "E205")


def test_masks_differ_error_above_one_percent_warning_below() -> None:
    sa, sb = _pair(n=40)
    dropped = sb[7]["loss"].pop()  # one loss position fewer on side b
    sb[7]["streams"] = {k: v[:-1] for k, v in sb[7]["streams"].items()}
    a, b = make_batch(sa, label="a"), make_batch(sb, label="b")
    pair = align_batches(a, b, stream_a="rollout", stream_b="rollout")
    assert [i.code for i in pair.issues] == ["W303"]
    assert f"sample s7, pos {dropped}" in pair.issues[0].message
    assert pair.n_tokens == a.n_tokens - 1
    for s in sb[:10]:
        s["loss"] = s["loss"][:-2]
        s["streams"] = {k: v[:-2] for k, v in s["streams"].items()}
    _fails(a, make_batch(sb, label="b"), "E303")


def test_compare_runs_identical_gives_exact_zero_and_passes_every_gate() -> None:
    from pgdiag.report.gates import PROFILES, evaluate_gates

    sa, sb = _pair(n=30)
    report = compare_runs(make_batch(sa, label="a"), make_batch(sb, label="b"), stream_a="rollout").report
    rows = report.summary.filter(report.summary["breakdown"] != "dlogp")
    for stat in (
        "bias",
        "sd",
        "rms",
        "abs_mean",
        "abs_max",
        "kl_k1",
        "kl_k3",
        "kl_rev_k3",
        "frac_out_strict",
    ):
        values = rows.filter(rows["metric"] == f"mismatch/{stat}")["value"].to_list()
        assert values and all(v == 0.0 for v in values), stat
    assert report.value("mismatch/tmpe", scope="token") == 1.0
    assert report.checks.height == 0
    for profile in PROFILES:
        result = evaluate_gates(report, profile=profile, default_family="mismatch")
        assert result.exit_code == 0, (profile, [g for g in result.gates if g.status != "pass"])
