"""Issue 22: what a new user met, and the malformed inputs a hostile user found, each a test.

Every test here failed on main at fefc33e (an exit 101, a traceback, a wrapped or multi-line message, a silently
accepted invalid input, a file written where none was asked for, or a missing hint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_factory import valid_rows, write_rollouts_file

import pgdiag
from pgdiag.errors import PgdiagError, UsageError


def test_error_messages_and_hints_of_the_api_are_one_line() -> None:
    error = UsageError("E501", "nothing matched run\nb", "pass\r\nanother")
    assert (error.message, error.hint) == ("nothing matched run\\nb", "pass\\r\\nanother")
    assert "\n" not in str(error)


def test_an_id_holding_a_newline_stays_one_line_in_check_findings(tmp_path: Path) -> None:
    rows = valid_rows()
    rows[0]["sample_id"] = "a\nb"
    rows[0]["old_logprobs"][2] = float("nan")
    result = pgdiag.check_run(pgdiag.read_run(write_rollouts_file(tmp_path / "run.parquet", rows)))
    assert result.issues["code"].to_list() == ["E207"]
    assert "sample a\\nb, pos 2" in result.issues["message"][0]


def test_check_run_refuses_another_type_for_other(tmp_path: Path) -> None:
    run = pgdiag.read_run(write_rollouts_file(tmp_path / "run.parquet", valid_rows()))
    with pytest.raises(PgdiagError) as raised:
        pgdiag.check_run(run, other="str")  # a path that matches nothing (was AttributeError: no .streams)
    assert raised.value.code == "E501"
    with pytest.raises(PgdiagError) as raised:
        pgdiag.check_run(run, other=5)
    assert raised.value.code == "E513" and "int" in raised.value.message
    assert pgdiag.check_run(run, other=str(tmp_path / "run.parquet")).exit_code == 0  # a path is read
