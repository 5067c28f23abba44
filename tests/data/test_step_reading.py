"""Reading a run step by step: `step_rows`, `restrict_steps`, `step_chunks` (the primitives of bounded-memory
commands), including a recompute tag whose join must read only the chosen steps."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from rollout_factory import write_logprobs_part, write_rollouts_file
from sample_paths import SAMPLE_DATA

from pgdiag.data.load import read_token_batch
from pgdiag.data.pieces import run_steps, step_chunks, step_rows
from pgdiag.data.runs import read_run, restrict_steps
from pgdiag.data.seqhash import seq_hash
from pgdiag.errors import InvalidInputError

RUN_A = str(SAMPLE_DATA / "run_a")


def test_step_rows_counts_every_row_of_each_step() -> None:
    run = read_run(RUN_A)
    steps = run.lazy.select("step").collect()["step"].to_list()
    expected = {s: steps.count(s) for s in sorted(set(steps))}
    assert step_rows(run) == expected
    assert run_steps(run) == sorted(expected)


def test_restricted_run_reads_exactly_the_rows_of_its_steps() -> None:
    run = read_run(RUN_A)
    whole = read_token_batch(run, streams=["rollout", "new"]).batch
    for step in run_steps(run):
        part = read_token_batch(restrict_steps(run, [step]), streams=["rollout", "new"]).batch
        rows = np.flatnonzero(whole.step == step)
        assert part.n_samples == rows.shape[0]
        assert list(part.sample_id) == list(whole.sample_id[rows])
        lo, hi = int(whole.offsets[rows[0]]), int(whole.offsets[rows[-1] + 1])
        np.testing.assert_array_equal(part.streams["new"], whole.streams["new"][lo:hi])
        np.testing.assert_array_equal(part.token_id, whole.token_id[lo:hi])


def test_restricted_recompute_join_reads_only_those_steps(tmp_path, rollout_rows) -> None:
    root = tmp_path / "run"
    for step in sorted({r["step"] for r in rollout_rows}):
        rows = [r for r in rollout_rows if r["step"] == step]
        write_rollouts_file(root / "rollouts" / f"step={step}" / "part-00000.parquet", rows)
    tag_dir = root / "logprobs" / "rc"
    tag_dir.mkdir(parents=True)
    (tag_dir / "_manifest.json").write_text(json.dumps({"tag": "rc", "complete": True}))
    step0 = [r for r in rollout_rows if r["step"] == 0]
    step1 = [r for r in rollout_rows if r["step"] == 1]
    write_logprobs_part(tag_dir / "step=0" / "part-00000.parquet", _recompute_rows(step0, -0.5))
    # step 1's recompute rows are duplicated: reading them is refused, so a step-0 read proves they were not read
    write_logprobs_part(tag_dir / "step=1" / "part-00000.parquet", _recompute_rows(step1 + step1, -0.5))
    run = read_run(root)
    with pytest.raises(InvalidInputError):
        read_token_batch(run, streams=["rollout", "rc"])
    part = read_token_batch(restrict_steps(run, [0]), streams=["rollout", "rc"]).batch
    assert set(part.step.tolist()) == {0}
    np.testing.assert_array_equal(part.streams["rc"], part.streams["rollout"] - 0.5)


def _recompute_rows(rows: list[dict[str, Any]], shift: float) -> list[dict[str, Any]]:
    return [
        {
            "step": r["step"],
            "sample_id": r["sample_id"],
            "segment_idx": 0,
            "seq_hash": seq_hash(r["input_ids"]),
            "logprobs": [None if v is None else v + shift for v in r["rollout_logprobs"]],
        }
        for r in rows
    ]


def test_step_chunks_group_consecutive_steps_under_the_row_budget() -> None:
    rows = {0: 4, 1: 4, 2: 10, 3: 1, 4: 1, 5: 3}
    assert step_chunks(rows, 8) == [(0, 1), (2,), (3, 4, 5)]
    assert step_chunks(rows, 4) == [(0,), (1,), (2,), (3, 4), (5,)]
    assert step_chunks(rows, 100) == [(0, 1, 2, 3, 4, 5)]
    assert step_chunks({}, 8) == []
