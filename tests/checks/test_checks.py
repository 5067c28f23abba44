"""Semantic checks on crafted stream pairs, cross-run checks, and the sample runs passing cleanly."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from rollout_factory import valid_rows, write_rollouts_file
from sample_paths import SAMPLE_DATA

from pgdiag.checks.metadata import metadata_checks
from pgdiag.checks.run import check_run, pair_checks
from pgdiag.checks.signatures import first_token_stats, signature_stats
from pgdiag.data.batch import TokenBatch
from pgdiag.data.runs import read_run
from pgdiag.errors import EXIT_INVALID, EXIT_OK

REPO = Path(__file__).resolve().parents[2]


def make_batch(streams: dict[str, np.ndarray], n_samples: int, steps: np.ndarray | None = None) -> TokenBatch:
    """S samples of equal length, all positions 5.. of each sample are loss positions."""
    m = next(iter(streams.values())).shape[0]
    length = m // n_samples
    offsets = np.arange(n_samples + 1, dtype=np.int64) * length
    return TokenBatch(
        label="t",
        step=np.zeros(n_samples, dtype=np.int64) if steps is None else steps,
        sample_id=np.array([f"s{i}" for i in range(n_samples)], dtype=object),
        segment_idx=np.zeros(n_samples, dtype=np.int32),
        group=np.zeros(n_samples, dtype=np.int64),
        group_names=np.array(["g"], dtype=object),
        prompt_len=np.full(n_samples, 5, dtype=np.int32),
        seq_len=np.full(n_samples, 5 + length, dtype=np.int32),
        offsets=offsets,
        pos=np.tile(np.arange(5, 5 + length, dtype=np.int32), n_samples),
        token_id=np.ones(m, dtype=np.int32),
        streams=streams,
    )


def _long_tailed(rng: np.random.Generator, n: int) -> np.ndarray:
    return -np.where(rng.random(n) < 0.3, rng.exponential(3.0, n), rng.exponential(0.05, n))


def _codes(issues) -> list[str]:
    return sorted(i.code for i in issues)


@pytest.mark.parametrize("k", [+1, -1])
def test_shift_detected(k: int) -> None:
    rng = np.random.default_rng(0)
    n_samples, length = 50, 40
    a = _long_tailed(rng, n_samples * length)
    b = a.reshape(n_samples, length).copy()
    if k == +1:  # b holds the value of token i at position i + 1
        b[:, 1:] = b[:, :-1].copy()
        b[:, 0] = -rng.exponential(1.0, n_samples)
    else:
        b[:, :-1] = b[:, 1:].copy()
        b[:, -1] = -rng.exponential(1.0, n_samples)
    issues = pair_checks(make_batch({"rollout": a, "old": b.ravel()}, n_samples), "rollout", "old")
    shift = [i for i in issues if i.code == "E302"]
    assert len(shift) == 1 and shift[0].severity == "error"
    assert f"old_logprobs looks shifted by {k:+d} vs rollout_logprobs" in shift[0].message
    assert "median |Δ| 0 at" in shift[0].message


def test_shift_not_reported_for_aligned_or_unrelated_streams() -> None:
    rng = np.random.default_rng(1)
    a = _long_tailed(rng, 2000)
    aligned = np.minimum(a + rng.normal(0, 0.01, a.size), -1e-6)
    assert "E302" not in _codes(pair_checks(make_batch({"rollout": a, "old": aligned}, 50), "rollout", "old"))
    unrelated = _long_tailed(rng, 2000)
    assert "E302" not in _codes(
        pair_checks(make_batch({"rollout": a, "old": unrelated}, 50), "rollout", "old")
    )


def test_shift_skips_pairs_across_samples_and_gaps() -> None:
    # samples of length 1: no position i+1 of the same sample exists, so a shift cannot be claimed
    rng = np.random.default_rng(2)
    a = _long_tailed(rng, 400)
    b = np.roll(a, 1)
    assert "E302" not in _codes(pair_checks(make_batch({"rollout": a, "old": b}, 400), "rollout", "old"))


def test_zero_fill_against_paired_stream() -> None:
    a = np.full(300, -0.5)
    b = np.full(300, -0.5)
    a[[3, 7]] = 0.0
    b[[3, 7]] = -4.0
    issues = [
        i for i in pair_checks(make_batch({"rollout": a, "old": b}, 10), "rollout", "old") if i.code == "E206"
    ]
    assert len(issues) == 1 and issues[0].count == 2
    assert "rollout_logprobs 0.0 where old_logprobs < -1 on 2 tokens" in issues[0].message
    assert issues[0].sample_id == "s0" and issues[0].pos == 8


def test_tempered_side_slope() -> None:
    rng = np.random.default_rng(3)
    a = _long_tailed(rng, 2000)
    issues = pair_checks(make_batch({"rollout": a, "old": a / 0.7}, 50), "rollout", "old")
    slope = [i for i in issues if i.code == "W401"]
    assert len(slope) == 1 and "slope 1.43" in slope[0].message and "implied T ≈ 0.7" in slope[0].message


def test_processed_logprobs() -> None:
    rng = np.random.default_rng(4)
    raw = _long_tailed(rng, 2000) - 0.2
    processed = raw - np.log(0.9)  # renormalised over a kept mass of 0.9
    issues = pair_checks(make_batch({"rollout": processed, "old": raw}, 50), "rollout", "old")
    w403 = [i for i in issues if i.code == "W403"]
    assert (
        len(w403) == 1
        and "100 % of tokens" in w403[0].message
        and "implied kept mass 0.9)" in w403[0].message
    )
    assert "W401" not in _codes(issues)


def test_first_token_dominates() -> None:
    rng = np.random.default_rng(5)
    n_samples, length = 120, 20
    a = _long_tailed(rng, n_samples * length)
    delta = rng.normal(0, 0.01, (n_samples, length))
    delta[:, 0] = rng.choice([-1.0, 1.0], n_samples) * 0.5
    b = a + delta.ravel()
    batch = make_batch({"rollout": a, "old": b}, n_samples)
    stats = signature_stats(a, b, batch)
    ratio, _ = first_token_stats(stats)
    n_first = stats.n_seqs
    expected = 0.5 / np.abs(delta).mean()
    assert n_first == n_samples and ratio == pytest.approx(expected)
    issues = pair_checks(batch, "rollout", "old")
    assert [i.code for i in issues] == ["W406"] and f"{expected:.3g}×" in issues[0].message


def test_stale_weights_step() -> None:
    rng = np.random.default_rng(6)
    n_steps, per_step, length = 7, 10, 30
    a = _long_tailed(rng, n_steps * per_step * length)
    scale = np.repeat(np.where(np.arange(n_steps) == 6, 0.1, 0.01), per_step * length)
    b = a + rng.normal(0, 1, a.size) * scale
    steps = np.repeat(np.arange(n_steps), per_step)
    issues = pair_checks(make_batch({"rollout": a, "old": b}, n_steps * per_step, steps), "rollout", "old")
    stale = [i for i in issues if i.code == "W407"]
    assert len(stale) == 1 and stale[0].step == 6 and "step 6: mean |Δ| 0.0" in stale[0].message


def test_extreme_tokens_counted() -> None:
    a = np.full(100, -1.0)
    b = a.copy()
    b[[10, 55]] = -30.0
    issues = pair_checks(make_batch({"rollout": a, "old": b}, 4), "rollout", "old")
    w410 = [i for i in issues if i.code == "W410"]
    assert len(w410) == 1 and w410[0].count == 2 and "2 tokens with |Δ| > 20" in w410[0].message
    assert w410[0].sample_id == "s0" and w410[0].pos == 15


def test_metadata_checks() -> None:
    meta = {
        "streams": {"rollout": {"tempered": "unknown", "logprobs_mode": "processed", "head_dtype": "bf16"}},
        "sampling": {"top_p": 0.9},
        "source": {"retokenized": True},
    }
    issues = metadata_checks(
        meta, ["rollout", "rc"], {"rc": {"head_dtype": "fp32", "temperature_source": "default"}}
    )
    assert _codes(issues) == ["W403", "W405", "W409", "W409", "W411"]
    assert any(i.message == "rollout_logprobs: tempered unknown" for i in issues)
    assert any("rollout head bf16 vs rc head fp32" in i.message for i in issues)
    tempered = {
        "streams": {"rollout": {"tempered": True, "logprobs_mode": "raw"}, "old": {"tempered": False}},
        "sampling": {"temperature": 0.6},
        "source": {"framework": "trl"},
    }
    issues = metadata_checks(tempered, ["rollout", "old", "rc"], {"rc": {"temperature": 1.0}})
    assert _codes(issues) == ["W402", "W402"]
    assert any(i.message == "rollout sampled at T=0.6 but rc used T=1" for i in issues)
    assert _codes(metadata_checks(tempered, ["rollout"], {})) == ["W408"]
    clean = {"streams": {"rollout": {"tempered": False, "logprobs_mode": "raw"}}, "sampling": {"top_p": 1.0}}
    assert metadata_checks(clean, ["rollout"], {}) == []


def test_check_run_pair_option_and_ignore(tmp_path: Path) -> None:
    rows = valid_rows()
    rows[1]["old_logprobs"] = [None, None, 0.0, -0.5]
    rows[1]["rollout_logprobs"] = [None, None, -3.0, -0.75]
    run = read_run(write_rollouts_file(tmp_path / "r.parquet", rows))
    result = check_run(run, streams=["old", "rollout"])
    assert "old_logprobs 0.0 where rollout_logprobs < -1 on 1 tokens" in " ".join(result.issues["message"])
    assert result.exit_code == EXIT_INVALID
    assert check_run(run, streams=["old", "rollout"], ignore=["E206", "W216"]).exit_code == EXIT_OK


def test_cross_run_checks(tmp_path: Path) -> None:
    base = read_run(write_rollouts_file(tmp_path / "a.parquet", valid_rows()))
    other_steps = [{**r, "step": r["step"] + 100} for r in valid_rows()]
    result = check_run(base, read_run(write_rollouts_file(tmp_path / "b.parquet", other_steps)))
    e304 = result.issues.filter(pl.col("code") == "E304").to_dicts()
    assert (
        len(e304) == 1
        and "0 of 4 samples matched" in e304[0]["message"]
        and "steps 0-1 vs 100-101" in e304[0]["message"]
    )
    retokenized = copy.deepcopy(valid_rows())
    retokenized[3]["input_ids"] = [11, 12, 21, 23]
    result = check_run(base, read_run(write_rollouts_file(tmp_path / "c.parquet", retokenized)))
    e301 = result.issues.filter(pl.col("code") == "E301").to_dicts()
    assert len(e301) == 1 and e301[0]["count"] == 1 and "step 1, sample 1:1" in e301[0]["message"]
    masked = copy.deepcopy(valid_rows())
    masked[0]["loss_mask"] = [False, False, True, False, False, True]
    masked[0]["rollout_logprobs"][4] = masked[0]["old_logprobs"][4] = masked[0]["advantages"][4] = None
    result = check_run(base, read_run(write_rollouts_file(tmp_path / "d.parquet", masked)))
    e303 = result.issues.filter(pl.col("code") == "E303").to_dicts()
    assert (
        len(e303) == 1
        and e303[0]["count"] == 1
        and "loss masks differ on 10 % of positions" in e303[0]["message"]
    )


def test_sample_runs_pass_cleanly() -> None:
    synthetic_a = read_run(SAMPLE_DATA / "synthetic_a")
    synthetic_b = read_run(SAMPLE_DATA / "synthetic_b")
    assert synthetic_a.streams == ("rollout", "old", "new") and synthetic_a.label == "synthetic_a"
    for result in (check_run(synthetic_a), check_run(synthetic_b), check_run(synthetic_a, synthetic_b)):
        assert result.issues.height == 0 and result.exit_code == EXIT_OK


def test_synthetic_runs_have_the_documented_statistics() -> None:
    from pgdiag.data.load import read_token_batch

    a = read_token_batch(
        read_run(SAMPLE_DATA / "synthetic_a"), streams=["rollout", "old", "new"], env=True
    ).batch
    b = read_token_batch(read_run(SAMPLE_DATA / "synthetic_b"), streams=["rollout", "old"]).batch
    assert a.n_samples == 128 and a.n_tokens == 15201
    np.testing.assert_array_equal(a.token_id, b.token_id)
    np.testing.assert_array_equal(a.streams["rollout"], b.streams["rollout"])
    mismatch = np.abs(a.streams["old"] - a.streams["rollout"])
    assert 0.005 < mismatch.mean() < 0.012 and np.quantile(mismatch, 0.99) < 0.05
    assert a.streams["rollout"].min() < -10.0 and np.median(a.streams["rollout"]) > -0.2
    outside = np.abs(a.streams["new"] - a.streams["old"]) > np.log(1.2)
    assert 0.002 < outside.mean() < 0.05
    assert 0 < np.abs(a.streams["old"] - b.streams["old"]).max() < 0.1
    tool = a.env == "tool"
    gaps = [np.any(np.diff(a.pos[a.offsets[i] : a.offsets[i + 1]]) > 1) for i in np.flatnonzero(tool)]
    assert np.mean(gaps) > 0.5  # masked tool spans inside responses


def test_check_frame_before_writing() -> None:
    from rollout_factory import rollouts_frame

    from pgdiag.checks.run import check_frame

    assert check_frame(rollouts_frame(valid_rows())).issues.height == 0
    rows = valid_rows()
    rows[2]["old_logprobs"] = [None, None, -0.5, None, 0.5, -0.25]
    result = check_frame(rollouts_frame(rows), source="import:verl")
    issue = result.issues.row(0, named=True)
    assert issue["code"] == "E205" and issue["message"].startswith("import:verl: old_logprobs: 1 positive")
    assert "step 1, sample 1:0, pos 4" in issue["message"] and result.exit_code == EXIT_INVALID
    wide = rollouts_frame(valid_rows()).with_columns(pl.col("input_ids").cast(pl.List(pl.Int64)))
    wide = wide.with_columns(pl.col("input_ids").list.eval(pl.element() + 2**31))
    assert check_frame(wide).issues["code"].to_list() == ["E103"]
    missing = check_frame(rollouts_frame(valid_rows()).drop("group_id"))
    assert missing.issues["code"].to_list() == ["E102"]


def test_cross_run_validates_the_second_run(tmp_path: Path) -> None:
    base = read_run(write_rollouts_file(tmp_path / "a.parquet", valid_rows()))
    broken = valid_rows()
    broken[0]["old_logprobs"] = [None, None, -0.5, None, -1.0]
    result = check_run(base, read_run(write_rollouts_file(tmp_path / "b.parquet", broken)))
    assert result.issues["code"].to_list() == ["E201"] and "b.parquet" in result.issues["message"][0]


def test_identical_old_and_new(tmp_path: Path) -> None:
    rows = [{**r, "new_logprobs": list(r["old_logprobs"])} for r in valid_rows()]
    result = check_run(read_run(write_rollouts_file(tmp_path / "same.parquet", rows)))
    w408 = result.issues.filter(pl.col("code") == "W408").to_dicts()
    assert len(w408) == 1 and w408[0]["count"] == 10 and result.exit_code == EXIT_OK
