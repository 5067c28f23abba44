"""The one reading loop (`pgdiag.data.reader.PieceReader`): pieces of whole steps read with the reader's checks,
their messages merged and the run's first error raised once, after the last piece, with the message one read of
the run gives (counts of every piece added, the first piece's example)."""

from __future__ import annotations

import pytest
from rollout_factory import write_rollouts_file

from pgdiag.analysis.whatif import whatif
from pgdiag.data.load import read_token_batch
from pgdiag.data.reader import PieceReader
from pgdiag.data.runs import read_run
from pgdiag.errors import InvalidInputError


def _rows(bad_steps: tuple[int, ...]) -> list[dict]:
    rows = []
    for step in range(3):
        for i in range(2):
            old = [-1.0, -0.5, float("nan") if step in bad_steps and i == 1 else -0.25]
            rows.append(
                {
                    "step": step,
                    "sample_id": f"{step}-{i}",
                    "group_id": f"g{step}",
                    "input_ids": [1, 2, 3, 4, 5],
                    "prompt_len": 2,
                    "loss_mask": [False, False, True, True, True],
                    "rollout_logprobs": [None, None, -1.0, -0.5, -0.3],
                    "old_logprobs": [None, None, *old],
                    "advantages": [None, None, 1.0, 1.0, 1.0],
                    "reward": float(i),
                }
            )
    return rows


def _read(run, many):
    return read_token_batch(run, streams=["rollout", "old"], piece=many, raise_errors=not many)


def _error(call) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as caught:
        call()
    return caught.value


def test_the_first_error_is_raised_after_the_last_piece_with_the_whole_runs_message(tmp_path):
    run = read_run(write_rollouts_file(tmp_path / "run.parquet", _rows(bad_steps=(0, 2))))
    whole = _error(lambda: _read(run, False))
    reader = PieceReader.planned(run, 1, _read)
    handed = [p.batch.n_samples for p in reader]  # step 0 has the error: no piece is handed on
    # one file of one row group: steps (0, 1) are one piece, step 2 another (`pieces.TIE_FACTOR`)
    assert handed == [] and len(reader.checks) == reader.n_pieces == 2  # every piece read and validated
    pieces = _error(reader.finish)
    assert (pieces.code, str(pieces)) == (whole.code, str(whole))
    assert "2 NaN" in str(whole) and "step 2, sample 2-1" in str(whole)  # both pieces in one message
    assert str(_error(lambda: whatif(run, max_rows=1))) == str(whole)


def test_a_run_without_errors_is_handed_on_piece_by_piece(tmp_path):
    run = read_run(write_rollouts_file(tmp_path / "run.parquet", _rows(bad_steps=())))
    reader = PieceReader.planned(run, 1, _read)
    assert [sorted(set(p.batch.step.tolist())) for p in reader] == [[0, 1], [2]]
    assert reader.finish().n_errors == 0
    whole = PieceReader.planned(run, 10**9, _read)
    assert [p.batch.n_samples for p in whole] == [6] and whole.n_pieces == 1
