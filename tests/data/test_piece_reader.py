"""The one reading loop (`pgdiag.data.reader.PieceReader`, and `RunsReader` for 2..N runs): pieces of whole steps read with the reader's checks,
their messages merged and the run's first error raised once, after the last piece, with the message one read of
the run gives (counts of every piece added, the first piece's example)."""

from __future__ import annotations

import pytest
from rollout_factory import write_rollouts_file

from pgdiag.analysis.whatif import whatif
from pgdiag.compare.api import compare_runs
from pgdiag.compare.nway import compare_many
from pgdiag.compare.settings import CompareSettings
from pgdiag.data.load import read_token_batch
from pgdiag.data.pieces import plan_step_pieces
from pgdiag.data.reader import PieceReader, RunsReader
from pgdiag.data.runs import read_run, restrict_steps
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


def _two_runs(tmp_path, bad_a: tuple[int, ...], bad_b: tuple[int, ...]):
    run_a = read_run(write_rollouts_file(tmp_path / "a.parquet", _rows(bad_steps=bad_a)))
    run_b = read_run(write_rollouts_file(tmp_path / "b.parquet", _rows(bad_steps=bad_b)))
    return run_a, run_b


def test_compare_in_pieces_raises_run_a_s_first_error_with_the_whole_runs_message(tmp_path):
    """`RunsReader` under `compare_runs` and N-way: run a's merged message (both pieces' NaNs), after the last
    piece, as reading the runs whole raises it (run a is read first), not the first bad piece's own message."""
    run_a, run_b = _two_runs(tmp_path, bad_a=(0, 2), bad_b=(0,))
    whole = _error(lambda: compare_runs(run_a, run_b, chunk_rows=10**9))
    assert "2 NaN" in str(whole) and "a.parquet" in str(whole)
    pieces = _error(lambda: compare_runs(run_a, run_b, chunk_rows=1))
    assert (pieces.code, str(pieces)) == (whole.code, str(whole))
    nway = _error(lambda: compare_many([run_a, run_b, run_b], CompareSettings(chunk_rows=1)))
    assert (nway.code, str(nway)) == (whole.code, str(whole))
    only_b = _error(lambda: compare_runs(*_two_runs(tmp_path / "b", bad_a=(), bad_b=(2,)), chunk_rows=1))
    assert "b.parquet" in str(only_b) and "sample 2-1" in str(only_b)


def test_runs_reader_without_raising_hands_on_every_piece_and_merges_each_runs_checks(tmp_path):
    run_a, run_b = _two_runs(tmp_path, bad_a=(0, 2), bad_b=())

    def read(piece, many):
        loaded = [_read(restrict_steps(run, piece.steps), many) for run in (run_a, run_b)]
        return [one.batch.n_samples for one in loaded], [one.checks for one in loaded]

    plan = plan_step_pieces([run_a, run_b], 1).pieces
    reader = RunsReader(plan, read, n_runs=2, raises=False)
    assert [p.read for p in reader] == [[2, 2]] * 3  # the bad pieces too: check reports, never raises
    merged_a, merged_b = reader.finish()
    assert merged_a is not None and merged_b is not None
    assert merged_a.n_errors == 1 and merged_b.n_errors == 0
    whole = _error(lambda: _read(run_a, False))
    assert (merged_a.found[0].code, merged_a.found[0].message) == (whole.code, whole.message)
    raising = RunsReader(plan, read, n_runs=2)
    assert [p.read for p in raising] == []  # the first piece of run a has an error: nothing handed on
    assert str(_error(raising.finish)) == str(whole)
