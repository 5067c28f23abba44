"""Preset openrlhf: next-token columns, action ranges and index groups against the experiences the hook
recorded (tests/importers/hook_fixtures.py); the refusals."""

from __future__ import annotations

import pytest
import torch

import pgdiag
from pgdiag.errors import InvalidInputError, UsageError
from tests.importers.conftest import assert_nothing_written
from tests.importers.hook_fixtures import (
    OPENRLHF_SAMPLES,
    hostile_pt,
    rewrite_hook_file,
    write_openrlhf_hook_files,
)

COLUMNS = ["step", "sample_id", "group_id", "input_ids", "prompt_len", "loss_mask", "rollout_logprobs",
           "old_logprobs", "ref_logprobs", "advantages", "reward", "finish_reason"]  # fmt: skip


def _sample_values(experiences, index):
    """(micro-batch, row) of the sample with `index` in generation order."""
    for e in experiences:
        if index in e.index:
            return e, e.index.index(index)
    raise KeyError(index)


def test_values_match_the_experiences(tmp_path):
    made = write_openrlhf_hook_files(tmp_path / "dump", steps=(0, 1))
    result = pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert [s.step for s in result.steps] == [0, 1] and result.streams == ("rollout", "old", "ref")
    rows = pgdiag.read_run(tmp_path / "out").collect(COLUMNS).sort(["step", "sample_id"])
    for row in rows.iter_rows(named=True):
        index = int(row["sample_id"].split(":")[1])  # rows are recorded in index order here
        tokens, ranges, reward, truncated = OPENRLHF_SAMPLES[index]
        e, r = _sample_values(made[row["step"]], index)
        t = len(tokens)
        action = [any(a <= i < b for a, b in ranges) for i in range(t)]
        assert row["input_ids"] == tokens and row["loss_mask"] == action
        assert row["prompt_len"] == ranges[0][0] and row["group_id"] == f"c{row['step']}:{index // 2}"
        for column, field in (
            ("rollout_logprobs", "rollout_log_probs"),
            ("old_logprobs", "action_log_probs"),
            ("ref_logprobs", "base_action_log_probs"),
            ("advantages", "advantages"),
        ):
            values = getattr(e, field)[r].tolist()  # column c scores token c + 1
            expected = [None] + [v if action[c + 1] else None for c, v in enumerate(values[: t - 1])]
            assert [v is None for v in row[column]] == [v is None for v in expected], column
            assert [v for v in row[column] if v is not None] == [v for v in expected if v is not None]
        assert row["reward"] == reward and row["finish_reason"] == ("length" if truncated else "stop")


def test_groups_follow_index_not_row_order(tmp_path):
    dump = tmp_path / "dump"
    write_openrlhf_hook_files(dump)

    def reverse(payload):  # dynamic batching: rows arrive out of generation order
        for name, t in payload["tensors"].items():
            payload["tensors"][name] = t.flip(0)
        payload["lists"]["index"] = payload["lists"]["index"][::-1]

    rewrite_hook_file(dump / "step_0.pt", reverse)
    pgdiag.import_run("openrlhf", dump, tmp_path / "out")
    rows = pgdiag.read_run(tmp_path / "out").collect(["sample_id", "group_id", "input_ids"])
    by_ids = {tuple(r["input_ids"]): r["group_id"] for r in rows.iter_rows(named=True)}
    assert [by_ids[tuple(s[0])] for s in OPENRLHF_SAMPLES] == ["c0:0", "c0:0", "c0:1", "c0:1"]


def test_shifted_stream_is_e206(tmp_path):
    write_openrlhf_hook_files(tmp_path / "dump")

    def shift(payload):  # rollout one column early: the last action of each sample gets the pad 0.0
        t = payload["tensors"]["rollout_log_probs"]
        payload["tensors"]["rollout_log_probs"] = torch.cat([t[:, 1:], torch.zeros(t.shape[0], 1)], dim=1)

    rewrite_hook_file(tmp_path / "dump" / "step_0.pt", shift)
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E206" and "rollout_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_token_aligned_columns_are_e703(tmp_path):
    write_openrlhf_hook_files(tmp_path / "dump")

    def widen(payload):  # a column per token instead of per next token
        t = payload["tensors"]["action_log_probs"]
        payload["tensors"]["action_log_probs"] = torch.cat([torch.zeros(t.shape[0], 1), t], dim=1)

    rewrite_hook_file(tmp_path / "dump" / "step_0.pt", widen)
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703" and "action_log_probs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_zero_filled_stream_is_e206(tmp_path):
    write_openrlhf_hook_files(tmp_path / "dump")
    rewrite_hook_file(tmp_path / "dump" / "step_0.pt", lambda p: p["tensors"]["action_log_probs"].zero_())
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E206" and "old_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_no_reference_model_means_no_ref_stream(tmp_path):
    # without --algo.kl.use_loss OpenRLHF sets base_action_log_probs to None: nothing to import, not zeros
    write_openrlhf_hook_files(tmp_path / "dump")
    rewrite_hook_file(tmp_path / "dump" / "step_0.pt", lambda p: p["tensors"].pop("base_action_log_probs"))
    result = pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert result.streams == ("rollout", "old")


def test_truncated_file_is_e703(tmp_path):
    write_openrlhf_hook_files(tmp_path / "dump")
    path = tmp_path / "dump" / "step_0.pt"
    path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703"
    assert_nothing_written(tmp_path / "out")


def test_hostile_pickle_is_e701(tmp_path):
    write_openrlhf_hook_files(tmp_path / "dump")
    path, marker = tmp_path / "dump" / "step_0.pt", tmp_path / "pwned"
    hostile_pt(path, marker, torch.load(path, weights_only=True))
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E701" and not marker.exists()
    assert_nothing_written(tmp_path / "out")


def test_a_trl_file_is_not_an_openrlhf_file(tmp_path):
    from tests.importers.hook_fixtures import write_trl_hook_file

    write_trl_hook_file(tmp_path / "dump")
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("openrlhf", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703" and "framework" in err.value.message
