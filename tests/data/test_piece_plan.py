"""The one piece planner (`pgdiag.data.pieces.plan_step_pieces`): whole steps over 1..N runs, and the steps of
one Parquet row group kept in one piece (Parquet decodes a row group whole, so a cut through one decodes it once
per piece), unless the piece would then exceed `TIE_FACTOR` x `chunk_rows` rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rollout_factory import write_rollouts_file

from pgdiag.data.pieces import (
    TIE_FACTOR,
    StepPiece,
    plan_step_pieces,
    row_group_spans,
    step_chunks,
    tied_steps,
)
from pgdiag.data.runs import read_run


def _rows(steps: int, per_step: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        for k in range(per_step):
            ids = rng.integers(0, 50, 8).tolist()
            rows.append(
                {
                    "step": step,
                    "sample_id": f"s{step}-{k}",
                    "group_id": f"g{step}",
                    "input_ids": ids,
                    "prompt_len": 3,
                    "loss_mask": [False] * 3 + [True] * 5,
                    "rollout_logprobs": [None] * 3 + (-rng.uniform(0.1, 0.9, 5)).tolist(),
                }
            )
    return rows


def test_tied_steps_are_those_one_row_group_spans() -> None:
    assert tied_steps([0, 1, 2, 3, 5], [(1, 3)]) == {1, 2}
    assert tied_steps([0, 1, 2, 3, 5], [(3, 5), (0, 0)]) == {3}
    assert tied_steps([0, 2], [(1, 1)]) == set()


def test_step_chunks_keeps_tied_steps_together_up_to_the_tie_limit() -> None:
    rows = {s: 2 for s in range(6)}
    assert step_chunks(rows, 4) == [(0, 1), (2, 3), (4, 5)]
    assert step_chunks(rows, 4, tied={0, 1, 2}) == [(0, 1, 2, 3), (4, 5)]
    # every step tied: pieces grow to TIE_FACTOR x 2 rows = 8 rows, then are cut
    assert TIE_FACTOR == 4
    assert step_chunks(rows, 2, tied=set(range(6))) == [(0, 1, 2, 3), (4, 5)]


def test_one_row_group_is_read_in_one_piece_when_it_fits_the_tie_limit(tmp_path: Path) -> None:
    one_group = read_run(write_rollouts_file(tmp_path / "one.parquet", _rows(6, 4)))
    per_step = read_run(write_rollouts_file(tmp_path / "per_step.parquet", _rows(6, 4), row_group_rows=4))
    assert row_group_spans(one_group.paths) == [(0, 5)]
    assert row_group_spans(per_step.paths) == []  # each row group holds one step
    # 24 rows, 8 a piece: a row group per step is cut every two steps; one row group of 24 <= 4 x 8 is not cut
    plan = plan_step_pieces([per_step], 8)
    assert [p.steps for p in plan.pieces] == [(0, 1), (2, 3), (4, 5)]
    assert plan.rows_per_step == dict.fromkeys(range(6), 4)
    assert plan_step_pieces([one_group], 8).pieces == [StepPiece(None, (True,))]
    # larger than 4 x 5 = 20 rows: cut at step boundaries, memory stays bounded
    assert [p.steps for p in plan_step_pieces([one_group], 5).pieces] == [(0, 1, 2, 3, 4), (5,)]


def test_pieces_over_several_runs_say_which_runs_have_rows(tmp_path: Path) -> None:
    a = read_run(write_rollouts_file(tmp_path / "a.parquet", _rows(4, 2), row_group_rows=2))
    b_rows = [r for r in _rows(4, 2, seed=1) if r["step"] != 1]
    b = read_run(write_rollouts_file(tmp_path / "b.parquet", b_rows, row_group_rows=2))
    c = read_run(write_rollouts_file(tmp_path / "c.parquet", _rows(4, 2, seed=2), row_group_rows=2))
    plan = plan_step_pieces([a, b, c], 4)
    assert [(p.steps, p.present) for p in plan.pieces] == [
        ((0,), (True, True, True)),
        ((1,), (True, False, True)),
        ((2,), (True, True, True)),
        ((3,), (True, True, True)),
    ]
    assert plan_step_pieces([a, b, c], 100).pieces == [StepPiece(None, (True, True, True))]
