"""Every row validation code, triggered by a crafted file (code, severity, exit code, message locations)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq
import pytest
from rollout_factory import valid_rows, write_rollouts_file

from pgdiag.checks.run import check_run
from pgdiag.data.load import read_token_batch
from pgdiag.data.runs import read_run
from pgdiag.data.validate import CheckResult
from pgdiag.errors import EXIT_GATE, EXIT_INVALID, EXIT_OK, InvalidInputError


def _check(tmp_path: Path, rows: list[dict[str, Any]], **kwargs: Any) -> CheckResult:
    path = write_rollouts_file(tmp_path / "bad.parquet", rows, raw_types=kwargs.pop("raw_types", None))
    return check_run(read_run(path), **kwargs)


def _only(result: CheckResult, code: str) -> dict[str, Any]:
    hits = result.issues.filter(pl.col("code") == code).to_dicts()
    assert len(hits) == 1, result.issues
    return hits[0]


def _edit(row: int, **changes: Any) -> list[dict[str, Any]]:
    rows = copy.deepcopy(valid_rows())
    rows[row].update(changes)
    return rows


def test_clean_file_passes(tmp_path: Path) -> None:
    result = _check(tmp_path, valid_rows())
    assert result.issues.height == 0 and result.exit_code == EXIT_OK
    assert result.n_errors == 0 and result.n_warnings == 0


def _assert_error(tmp_path: Path, rows: list[dict[str, Any]], code: str, *needles: str, **kw: Any) -> dict:
    result = _check(tmp_path, rows, **kw)
    issue = _only(result, code)
    assert issue["severity"] == "error" and result.exit_code == EXIT_INVALID
    for needle in needles:
        assert needle in issue["message"], issue["message"]
    with pytest.raises(InvalidInputError) as raised:
        read_token_batch(read_run(tmp_path / "bad.parquet"), streams=["rollout", "old"])
    assert raised.value.exit_code == EXIT_INVALID
    return issue


def test_e102_missing_column(tmp_path: Path) -> None:
    path = write_rollouts_file(tmp_path / "bad.parquet", valid_rows())
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["group_id"]), path)  # footer metadata kept, group_id gone
    result = check_run(read_run(path))
    issue = _only(result, "E102")
    assert "missing column group_id" in issue["message"] and "bad.parquet" in issue["message"]
    assert result.exit_code == EXIT_INVALID
    with pytest.raises(InvalidInputError) as raised:
        read_token_batch(read_run(path), streams=["rollout"])
    assert raised.value.code == "E102" and raised.value.hint == "re-import with pgdiag import --group-by"


def test_e103_uncastable_type_and_overflow(tmp_path: Path) -> None:
    rows = valid_rows()
    for r in rows:
        r["old_logprobs"] = [None if v is None else str(v) for v in r["old_logprobs"]]
    issue = _assert_error(
        tmp_path, rows, "E103", "old_logprobs", raw_types={"old_logprobs": pl.List(pl.String)}
    )
    assert issue["count"] == 1
    huge = _edit(1, rollout_logprobs=[None, None, -3e39, -0.75])
    _assert_error(
        tmp_path,
        huge,
        "E103",
        "rollout_logprobs",
        "3e+39",
        raw_types={"rollout_logprobs": pl.List(pl.Float64)},
    )


def test_e201_length(tmp_path: Path) -> None:
    rows = _edit(1, old_logprobs=[None, None, -2.5])
    issue = _assert_error(
        tmp_path,
        rows,
        "E201",
        "bad.parquet",
        "old_logprobs",
        "step 0",
        "sample 0:1",
        "length 3 != input_ids 4",
    )
    assert issue["step"] == 0 and issue["sample_id"] == "0:1"


def test_e202_prompt_len(tmp_path: Path) -> None:
    _assert_error(
        tmp_path, _edit(2, prompt_len=0), "E202", "prompt_len", "step 1", "sample 1:0", "prompt_len 0"
    )
    _assert_error(tmp_path, _edit(2, prompt_len=7), "E202", "prompt_len 7, T 6")


def test_e203_loss_before_prompt(tmp_path: Path) -> None:
    rows = _edit(
        0,
        loss_mask=[True, False, True, False, True, True],
        rollout_logprobs=[-0.5, None, -0.5, None, -1.25, -0.125],
        old_logprobs=[-0.5, None, -0.5, None, -1.0, -0.25],
        advantages=[1.0, None, 1.0, None, 1.0, 1.0],
    )
    issue = _assert_error(tmp_path, rows, "E203", "loss_mask", "step 0", "sample 0:0", "pos 0")
    assert issue["pos"] == 0


def test_e204_null_on_loss(tmp_path: Path) -> None:
    rows = _edit(3, rollout_logprobs=[None, None, -2.0, None])
    issue = _assert_error(
        tmp_path, rows, "E204", "rollout_logprobs", "step 1", "sample 1:1", "pos 3", "token 22, last"
    )
    assert issue["pos"] == 3 and issue["count"] == 1
    loaded = read_token_batch(read_run(tmp_path / "bad.parquet"), streams=["rollout"], ignore=["E204"])
    assert loaded.batch.streams["rollout"][-1] != loaded.batch.streams["rollout"][-1]  # NaN marks the null


def test_e205_positive(tmp_path: Path) -> None:
    issue = _assert_error(
        tmp_path,
        _edit(0, old_logprobs=[None, None, 0.31, None, -1.0, -0.25]),
        "E205",
        "old_logprobs: 1 positive values (max 0.31)",
        "sample 0:0",
        "pos 2",
    )
    assert issue["count"] == 1


def test_e206_zero_fill(tmp_path: Path) -> None:
    rows = _edit(1, rollout_logprobs=[None, None, 0.0, 0.0])
    result = _check(tmp_path, rows)
    messages = result.issues.filter(pl.col("code") == "E206")["message"].to_list()
    assert any("rollout_logprobs: 20.0 % exact 0.0 on loss positions" in m for m in messages)
    assert any("rollout_logprobs 0.0 where old_logprobs < -1 on 1 tokens" in m for m in messages)  # pair rule
    assert result.exit_code == EXIT_INVALID
    # one zero among many values in a sample that is not all-zero, below 1 %: a warning (W216) instead
    rows = valid_rows()
    long = {
        "step": 2,
        "sample_id": "2:0",
        "group_id": "g2",
        "input_ids": list(range(1, 202)),
        "prompt_len": 1,
        "loss_mask": [False] + [True] * 200,
        "rollout_logprobs": [None] + [0.0] + [-0.5] * 199,
        "old_logprobs": [None] + [-0.5] * 200,
        "advantages": [None] + [1.0] * 200,
    }
    many = [{**long, "sample_id": f"2:{i}"} for i in range(2)]
    result = _check(tmp_path, rows + many)
    issue = _only(result, "W216")
    assert (
        issue["severity"] == "warning"
        and issue["count"] == 2
        and "rollout_logprobs: 2 exact 0.0" in issue["message"]
    )
    assert result.exit_code == EXIT_OK and _check(tmp_path, rows + many, strict=True).exit_code == EXIT_GATE


def test_e207_nan_inf(tmp_path: Path) -> None:
    rows = _edit(2, old_logprobs=[None, None, float("nan"), None, float("-inf"), -0.25])
    issue = _assert_error(
        tmp_path, rows, "E207", "old_logprobs: 1 NaN, 0 +inf, 1 -inf", "step 1", "sample 1:0", "pos 2"
    )
    assert issue["count"] == 2
    _assert_error(tmp_path, _edit(0, reward=float("nan")), "E207", "reward")


def test_e208_token_ids(tmp_path: Path) -> None:
    issue = _assert_error(
        tmp_path, _edit(1, input_ids=[11, 12, -5, 22]), "E208", "input_ids", "token -5", "sample 0:1"
    )
    assert issue["pos"] == 2
    result = _check(tmp_path, valid_rows(), vocab_size=16)
    assert "token 21" in _only(result, "E208")["message"] and _only(result, "E208")["count"] == 6


def test_e209_step_without_loss_tokens(tmp_path: Path) -> None:
    rows = valid_rows()
    for r in rows[2:]:
        r["loss_mask"] = [False] * len(r["loss_mask"])
        r["rollout_logprobs"] = r["old_logprobs"] = r["advantages"] = [None] * len(r["loss_mask"])
    result = _check(tmp_path, rows)
    assert "step 1 has no loss tokens" in _only(result, "E209")["message"]
    assert _only(result, "W215")["count"] == 2


def test_e210_duplicate(tmp_path: Path) -> None:
    rows = valid_rows()
    rows[1]["sample_id"] = "0:0"
    issue = _assert_error(tmp_path, rows, "E210", "duplicate", "step 0", "sample 0:0")
    assert issue["count"] == 2


def test_e211_group(tmp_path: Path) -> None:
    _assert_error(tmp_path, _edit(3, group_id=""), "E211", "1 samples without group_id", "sample 1:1")


def test_e212_seq_hash(tmp_path: Path) -> None:
    _assert_error(tmp_path, _edit(0, seq_hash=7), "E212", "seq_hash", "step 0", "sample 0:0")


def test_e213_nulls(tmp_path: Path) -> None:
    _assert_error(
        tmp_path,
        _edit(1, input_ids=[11, None, 21, 22], seq_hash=1),
        "E213",
        "input_ids has nulls",
        "sample 0:1",
    )
    _assert_error(tmp_path, _edit(2, prompt_len=None), "E213", "prompt_len is null", "sample 1:0")


def test_w214_values_outside_mask(tmp_path: Path) -> None:
    rows = _edit(0, advantages=[1.0, 1.0, 1.0, None, 1.0, 1.0])
    result = _check(tmp_path, rows)
    issue = _only(result, "W214")
    assert issue["count"] == 2 and "advantages set on 2 non-loss positions" in issue["message"]
    assert "pos 0" in issue["message"] and result.exit_code == EXIT_OK
    assert _check(tmp_path, rows, ignore=["W214"]).issues.height == 0


def test_w215_and_w217(tmp_path: Path) -> None:
    rows = valid_rows()
    extra = copy.deepcopy(rows[0])
    extra.update(
        sample_id="0:2",
        loss_mask=[False] * 6,
        rollout_logprobs=[None] * 6,
        old_logprobs=[None] * 6,
        advantages=[None] * 6,
        group_id="g0b",
    )
    result = _check(tmp_path, [*rows, extra])
    assert "1 samples with no loss tokens" in _only(result, "W215")["message"]
    w217 = _only(result, "W217")
    assert w217["step"] == 0 and "sizes 1 to 2" in w217["message"]
    assert result.exit_code == EXIT_OK


def test_max_examples_and_more_count(tmp_path: Path) -> None:
    rows = valid_rows()
    for r in rows:
        r["old_logprobs"] = [None if v is None else 0.5 for v in r["old_logprobs"]]
    result = _check(tmp_path, rows, max_examples=2)
    message = _only(result, "E205")["message"]
    assert message.count("sample ") == 2 and message.endswith("; 8 more")


def test_e302_from_null_pattern(tmp_path: Path) -> None:
    rows = valid_rows()
    for r in rows:  # next-token aligned: value of token i stored at i - 1
        r["rollout_logprobs"] = [*r["rollout_logprobs"][1:], None]
        r["rollout_logprobs"][1] = -0.5
    result = _check(tmp_path, rows)
    issue = _only(result, "E302")
    assert "rollout_logprobs looks shifted by -1" in issue["message"] and issue["count"] == 4
    assert result.exit_code == EXIT_INVALID
    single_null = _check(tmp_path, _edit(3, rollout_logprobs=[None, None, -2.0, None]))
    assert "E302" not in single_null.issues["code"].to_list()


def test_more_examples_than_five(tmp_path: Path) -> None:
    rows = [
        {
            **r,
            "sample_id": f"{r['step']}:{k}{r['sample_id']}",
            "rollout_logprobs": [None] * len(r["input_ids"]),
        }
        for k in range(4)
        for r in valid_rows()
    ]
    result = _check(tmp_path, rows, max_examples=8)
    message = _only(result, "E204")["message"]
    assert message.count("token ") == 8 and message.endswith("; 32 more")
