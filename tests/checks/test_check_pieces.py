"""`check_run` reading runs step by step (`chunk_rows` tiny: many pieces) finds what one read of the run finds.

Exact over pieces: the signatures (W407 across steps, W410 count and first examples), W408, the cross-run checks
(E301 count and examples, W303/E303 pooled shares, E304). Merged per code (the reader's and the pair rules'
issues): the summed count, the first piece's location, the message rebuilt with the run's counts and examples
(tests/checks/test_run_verdicts.py covers every counting message and the rules judged over the run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from rollout_factory import write_rollouts_file

from pgdiag.checks.run import check_run
from pgdiag.data.runs import read_run
from pgdiag.data.seqhash import seq_hash
from pgdiag.data.validate import Issue, merge_piece_issues

STEP_SIZES = (4, 9, 1, 6, 5, 8)  # uneven steps


def _rows(seed: int, *, stale_step: int = 4) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    i = 0
    for step, size in enumerate(STEP_SIZES):
        for _ in range(size):
            prompt_len, resp = int(rng.integers(2, 6)), int(rng.integers(5, 40))
            ids = rng.integers(0, 50, prompt_len + resp).tolist()
            lp = -rng.gamma(1.0, 0.7, resp) - 1e-3  # (resp,) rollout log-probs, all < 0
            noise = rng.normal(0.0, 0.3 if step == stale_step else 0.02, resp)
            old = -np.abs(lp + noise) - 1e-6
            if i in (3, 30):  # |Δ| > 20 in two pieces (W410)
                old[2] = lp[2] - 25.0
            rows.append(
                {
                    "run": "r",
                    "step": step,
                    "sample_id": f"s{i:03d}",
                    "group_id": f"g{step}",
                    "input_ids": ids,
                    "seq_hash": seq_hash(ids),
                    "prompt_len": prompt_len,
                    "loss_mask": [False] * prompt_len + [True] * resp,
                    "rollout_logprobs": [None] * prompt_len + lp.tolist(),
                    "old_logprobs": [None] * prompt_len + old.tolist(),
                    "reward": float(rng.normal()),
                }
            )
            i += 1
    return rows


def _write(path: Path, rows: list[dict[str, Any]]):
    write_rollouts_file(path, rows)
    return read_run(path)


def _same(one, many) -> None:
    assert one.issues.equals(many.issues)
    assert one.hints == many.hints
    assert one.exit_code == many.exit_code


def test_one_run_many_pieces_equal_one_read(tmp_path) -> None:
    run = _write(tmp_path / "r.parquet", _rows(1))
    one = check_run(run)
    for chunk_rows in (1, 10, 17):
        _same(one, check_run(run, chunk_rows=chunk_rows))
    codes = one.issues["code"].to_list()
    assert "W407" in codes and "W410" in codes
    w410 = one.issues.filter(pl.col("code") == "W410").row(0, named=True)
    assert w410["count"] == 2 and w410["sample_id"] == "s003"
    assert "step 0, sample s003, pos" in w410["message"] and "step 5, sample s030, pos" in w410["message"]


def test_zero_fill_against_the_other_stream_merges_per_code(tmp_path) -> None:
    rows = _rows(2)
    for k in (1, 25):  # old = 0.0 where rollout < -1, in two pieces: E206 from the pair rule
        resp = [j for j, m in enumerate(rows[k]["loss_mask"]) if m]
        rows[k]["rollout_logprobs"][resp[0]] = -3.0
        rows[k]["old_logprobs"][resp[0]] = 0.0
    run = _write(tmp_path / "r.parquet", rows)
    one = check_run(run).issues.filter(pl.col("code") == "E206")
    many = check_run(run, chunk_rows=1).issues.filter(pl.col("code") == "E206")
    assert one.height == many.height == 1
    first, merged = one.row(0, named=True), many.row(0, named=True)
    assert first["count"] == merged["count"] == 2
    assert (first["step"], first["sample_id"], first["pos"]) == (
        merged["step"],
        merged["sample_id"],
        merged["pos"],
    )
    assert merged["message"] == first["message"]  # the run's count and examples, as one read says them
    assert "< -1 on 2 tokens: zero-filled? (step 0, sample s001, pos" in merged["message"]


def test_two_runs_cross_checks_pool_over_pieces(tmp_path) -> None:
    rows_a = _rows(3)
    rows_b = [dict(r) for r in _rows(3)]
    for k in (2, 20):  # different tokens in two steps: E301 names both, in key order
        ids = list(rows_b[k]["input_ids"])
        ids[-1] = (ids[-1] + 1) % 50
        rows_b[k]["input_ids"], rows_b[k]["seq_hash"] = ids, seq_hash(ids)
    for k in (5, 32):  # one loss position dropped in two steps: W303 over the pooled positions
        mask = list(rows_b[k]["loss_mask"])
        mask[-1] = False
        rows_b[k]["loss_mask"] = mask
        for column in ("rollout_logprobs", "old_logprobs"):
            rows_b[k][column] = [*rows_b[k][column][:-1], None]
    run_a = _write(tmp_path / "a.parquet", rows_a)
    run_b = _write(tmp_path / "b.parquet", rows_b)
    one = check_run(run_a, run_b)
    for chunk_rows in (1, 12):
        _same(one, check_run(run_a, run_b, chunk_rows=chunk_rows))
    e301 = one.issues.filter(pl.col("code") == "E301").row(0, named=True)
    assert e301["count"] == 2 and "(step 0, sample s002; step 4, sample s020)" in e301["message"]
    assert one.issues.filter(pl.col("code") == "W303")["count"].to_list() == [2]


def test_a_step_in_one_run_only_and_nothing_matched(tmp_path) -> None:
    rows = _rows(4)
    run_a = _write(tmp_path / "a.parquet", [r for r in rows if r["step"] < 3])
    run_b = _write(tmp_path / "b.parquet", [r for r in rows if r["step"] >= 3])
    one = check_run(run_a, run_b)
    many = check_run(run_a, run_b, chunk_rows=1)
    _same(one, many)
    e304 = one.issues.filter(pl.col("code") == "E304").row(0, named=True)
    assert e304["message"] == "0 of 14 samples matched by (step, sample_id); steps 0-2 vs 3-5?"


def test_merge_piece_issues_sums_counts_and_keeps_the_first() -> None:
    first = Issue(
        "W215", "warning", 2, "f: loss_mask empty (step 0, sample a)", step=0, sample_id="a", rule="x"
    )
    later = Issue(
        "W215", "warning", 3, "f: loss_mask empty (step 4, sample b)", step=4, sample_id="b", rule="x"
    )
    other = Issue("W215", "warning", 1, "f: another rule (step 5, sample c)", step=5, sample_id="c", rule="y")
    merged = merge_piece_issues([[first], [later, other]])
    assert [(i.count, i.step, i.message) for i in merged] == [
        (5, 0, "f: loss_mask empty (step 0, sample a) [+3 in later steps]"),
        (1, 5, "f: another rule (step 5, sample c)"),
    ]
    assert merge_piece_issues([[first, other]]) == [first, other]


def test_reader_issues_of_several_pieces_merge_per_code(tmp_path) -> None:
    rows = _rows(5)
    for k in (5, 32):  # a log-prob on a non-loss position in two pieces: the reader's W214
        rows[k]["loss_mask"] = [*rows[k]["loss_mask"][:-1], False]
        rows[k]["old_logprobs"] = [*rows[k]["old_logprobs"][:-1], None]
    run = _write(tmp_path / "r.parquet", rows)
    one = check_run(run).issues.filter(pl.col("code") == "W214").row(0, named=True)
    many = check_run(run, chunk_rows=1).issues.filter(pl.col("code") == "W214").row(0, named=True)
    assert one["count"] == many["count"] == 2
    assert (one["step"], one["sample_id"], one["pos"]) == (many["step"], many["sample_id"], many["pos"])
    assert "set on 2 non-loss positions" in one["message"]
    assert many["message"] == one["message"]  # the run's count and both examples, as one read says them


def test_a_null_step_makes_the_run_read_whole(tmp_path) -> None:
    rows = _rows(6)
    rows[10]["step"] = None  # in no piece of steps: read whole, so the reader reports it (E213)
    run = _write(tmp_path / "r.parquet", rows)
    one = check_run(run)
    _same(one, check_run(run, chunk_rows=1))
    e213 = one.issues.filter(pl.col("code") == "E213").row(0, named=True)
    assert e213["count"] == 1 and "step is null" in e213["message"]
