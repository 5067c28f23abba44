"""PipelineRL preset: actor stream and training_data stream files, every imported value checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgdiag.errors import InvalidInputError
from pgdiag.importers.base import ImportOptions, load_preset
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.pipelinerl_streams import packed_batch, rl_example, training_text, write_lines

P1, P2 = [1, 2, 3], [4, 5]
GROUP_A = [  # (prompt, completion, logprobs, reward, finished, model_version, rollout_index)
    (P1, [10, 11], [-0.5, -0.25], 1.0, True, 7, 1),
    (P1, [12, 13, 14], [-1.0, -0.125, -2.0], 0.0, False, 8, 0),
]
GROUP_B = [(P2, [20], [-0.75], 0.5, True, 8, 0), (P2, [21, 22], [-1.5, -0.0625], 0.0, True, 8, 1)]


def _actor(tmp_path: Path, group_a: list = GROUP_A) -> Path:
    def line(group: list, gid: str) -> list:
        return [
            training_text(p, c, lp, reward=r, finished=f, group_id=gid, model_version=v, rollout_index=k)
            for p, c, lp, r, f, v, k in group
        ]

    exp = tmp_path / "exp"
    write_lines(
        exp / "streams" / "actor" / "0" / "0" / "0.jsonl",
        [line(group_a, "actor_0"), line(GROUP_B, "actor_1")],
    )
    return exp


def _read(src: Path) -> list:
    return list(load_preset("pipelinerl").read(src, ImportOptions()))


def test_actor_every_value(tmp_path: Path) -> None:
    steps = _read(_actor(tmp_path))
    assert [s.step for s in steps] == [7, 8]  # a group's step is its smallest model_version
    a, b = steps
    assert a.rows["input_ids"].to_list() == [[*P1, 10, 11], [*P1, 12, 13, 14]]
    assert a.rows["prompt_len"].to_list() == [3, 3]
    assert a.rows["loss_mask"].to_list() == [[False] * 3 + [True] * 2, [False] * 3 + [True] * 3]
    assert a.rows["rollout_logprobs"].to_list() == [
        [None] * 3 + [-0.5, -0.25],
        [None] * 3 + [-1.0, -0.125, -2.0],
    ]
    assert a.rows["sample_id"].to_list() == ["actor_0/1", "actor_0/0"]
    assert a.rows["segment_idx"].to_list() == [0, 0]
    assert a.rows["group_id"].to_list() == ["actor_0", "actor_0"]
    assert a.rows["policy_version"].to_list() == [7, 8]  # each row keeps its own version
    assert a.rows["reward"].to_list() == [1.0, 0.0]
    assert a.rows["finish_reason"].to_list() == ["stop", "length"]
    assert a.sampling["logprobs_mode"] == "processed"
    assert b.rows["input_ids"].to_list() == [[*P2, 20], [*P2, 21, 22]]
    assert "ref_logprobs" not in a.rows.columns


def test_actor_shifted_logprobs_are_e703(tmp_path: Path) -> None:
    shifted = [(P1, [10, 11], [-0.5, -0.25, -0.1], 1.0, True, 7, 1), GROUP_A[1]]
    with pytest.raises(InvalidInputError) as err:
        _read(_actor(tmp_path, shifted))
    assert err.value.code == "E703" and "logprobs" in err.value.message and "line 1" in err.value.message


def test_torn_last_line_is_e703(tmp_path: Path) -> None:
    exp = _actor(tmp_path)
    path = exp / "streams" / "actor" / "0" / "0" / "0.jsonl"
    path.write_bytes(path.read_bytes()[:-20])
    out = tmp_path / "run"
    result = import_cli("pipelinerl", exp, out)
    assert result.exit_code == 3 and "error[E703]" in result.stderr and "line 2" in result.stderr
    assert_nothing_written(out)


def _training(tmp_path: Path, *, ref_copy: bool = False, zero_old: bool = False) -> Path:
    olds = [[-0.5, -0.25], [-1.0, -0.125, -2.0], [-0.75]]
    refs = olds if ref_copy else [[-0.625, -0.25], [-1.0, -0.5, -1.5], [-1.0]]
    if zero_old:
        olds = [[0.0] * len(o) for o in olds]
    ex = [
        rl_example(P1, [10, 11], olds[0], refs[0], reward=1.0, adv=0.5, version=4),
        rl_example(P1, [12, 13, 14], olds[1], refs[1], reward=0.0, adv=-0.5, version=4),
        rl_example(P2, [20], olds[2], refs[2], reward=0.25, adv=0.0, version=4),
    ]
    lines = [
        packed_batch(ex[:2], seq_parallel=4),  # 11 tokens + 1 synthetic padding token
        packed_batch([ex[0]], sentinel=True),
        packed_batch(ex[2:]),
    ]
    exp = tmp_path / "exp"
    write_lines(exp / "streams" / "training_data" / "0" / "0" / "0.jsonl", lines)
    return exp / "streams" / "training_data"


def test_training_data_every_value(tmp_path: Path) -> None:
    (step,) = _read(_training(tmp_path))
    rows = step.rows
    assert step.step == 4 and rows.height == 3  # sentinel batch skipped, padding example dropped
    assert rows["input_ids"].to_list() == [[*P1, 10, 11], [*P1, 12, 13, 14], [*P2, 20]]
    assert rows["loss_mask"].to_list() == [
        [False] * 3 + [True] * 2,
        [False] * 3 + [True] * 3,
        [False, False, True],
    ]
    assert rows["rollout_logprobs"].to_list() == [
        [0.0] * 3 + [-0.5, -0.25],
        [0.0] * 3 + [-1.0, -0.125, -2.0],
        [0.0, 0.0, -0.75],
    ]
    assert rows["ref_logprobs"].to_list()[1] == [0.0] * 3 + [-1.0, -0.5, -1.5]
    assert rows["advantages"].to_list()[0] == [0.0] * 3 + [0.5, 0.5]
    assert rows["reward"].to_list() == [1.0, 0.0, 0.25]
    assert rows["sample_id"].to_list() == ["4:0", "4:1", "4:2"]
    assert step.stream_fields["rollout_logprobs"] == "old_logprobs"


def test_training_data_ref_copy_is_w702_and_dropped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("pipelinerl", _training(tmp_path, ref_copy=True), out, "--json")
    assert result.exit_code == 0, result.stderr
    assert "W702" in result.stderr
    rows = read_rows(out)
    assert "ref_logprobs" not in rows.columns
    assert rows["rollout_logprobs"].to_list()[0] == [None] * 3 + [-0.5, -0.25]  # masked on import
    assert json.loads((out / "pgdiag.json").read_text())


def test_training_data_zero_filled_is_e206_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("pipelinerl", _training(tmp_path, zero_old=True), out)
    assert result.exit_code == 3 and "error[E206]" in result.stderr
    assert_nothing_written(out)


def test_actor_cli_import(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("pipelinerl", _actor(tmp_path), out)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(out)
    assert sorted(rows["step"].unique().to_list()) == [7, 8]
