"""Preset trl: every imported value against the tensors the hook file was made from; the refusals."""

from __future__ import annotations

import math

import pytest
import torch

import pgdiag
from pgdiag.errors import InvalidInputError, UsageError
from tests.importers.conftest import assert_nothing_written
from tests.importers.hook_fixtures import (
    TRL_COMPLETIONS,
    TRL_PROMPTS,
    hostile_pt,
    rewrite_hook_file,
    write_trl_hook_file,
)

COLUMNS = ["sample_id", "group_id", "input_ids", "prompt_len", "loss_mask", "rollout_logprobs", "old_logprobs",
           "ref_logprobs", "advantages", "advantage", "reward", "reward_components", "finish_reason"]  # fmt: skip


def test_values_match_the_tensors_they_were_written_from(tmp_path):
    output = write_trl_hook_file(tmp_path / "dump", step=5)
    result = pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert result.n_samples == 4 and [s.step for s in result.steps] == [5]
    rows = pgdiag.read_run(tmp_path / "out").collect(COLUMNS).sort("sample_id")
    for r, row in enumerate(rows.iter_rows(named=True)):
        prompt, completion = TRL_PROMPTS[r], TRL_COMPLETIONS[r]
        p, t = len(prompt), len(prompt) + len(completion)
        assert row["sample_id"] == f"5:{r}" and row["group_id"] == f"c5:{r // 2}"
        assert row["input_ids"] == prompt + completion and row["prompt_len"] == p
        assert row["loss_mask"] == [False] * p + [True] * len(completion)
        for column, field in (
            ("rollout_logprobs", "sampling_per_token_logps"),
            ("old_logprobs", "old_per_token_logps"),
            ("ref_logprobs", "ref_per_token_logps"),
        ):
            assert row[column][:p] == [None] * p
            assert row[column][p:] == output[field][r, : len(completion)].tolist()
        adv = output["advantages"][r].item()
        assert row["advantage"] == adv and row["advantages"] == [None] * p + [adv] * (t - p)
        assert row["finish_reason"] == ("stop" if completion[-1] == 1 else "length")
    assert rows["reward"].to_list() == [1.5, 0.5, 1.0, None]  # NaN (unscorable) -> null
    assert rows["reward_components"].to_list()[0] == {"correct": 1.0, "format": 0.5}


def test_rank_files_concatenate_in_rank_order(tmp_path):
    dump = tmp_path / "dump"
    write_trl_hook_file(dump, step=0)
    single = dump / "step_0.pt"
    for rank in (0, 1):
        payload = torch.load(single, weights_only=True)
        payload.update(rank=rank, world_size=2)
        torch.save(payload, dump / f"step_0.rank{rank}.pt")
    single.unlink()
    pgdiag.import_run("trl", dump, tmp_path / "out")
    rows = pgdiag.read_run(tmp_path / "out").collect(["sample_id", "group_id", "input_ids"])
    assert rows.height == 8 and rows["group_id"].n_unique() == 4
    (dump / "step_0.rank1.pt").unlink()
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", dump, tmp_path / "out2")
    assert err.value.code == "E703" and "rank" in err.value.message
    assert_nothing_written(tmp_path / "out2")


def test_shifted_stream_is_e206(tmp_path):
    # sampling log-probs one column late: each first completion token gets the 0.0 fill
    def shift(out):
        logps = out["sampling_per_token_logps"]
        out["sampling_per_token_logps"] = torch.cat([torch.zeros(4, 1), logps[:, :-1]], dim=1)

    write_trl_hook_file(tmp_path / "dump", edit=shift)
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E206" and "rollout_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_stream_of_another_width_is_e703(tmp_path):
    def widen(out):
        out["old_per_token_logps"] = torch.cat([out["old_per_token_logps"], torch.zeros(4, 1)], dim=1)

    write_trl_hook_file(tmp_path / "dump", edit=widen)
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703" and "old_per_token_logps" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_zero_filled_stream_is_e206(tmp_path):
    write_trl_hook_file(tmp_path / "dump", edit=lambda out: out["old_per_token_logps"].zero_())
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E206" and "old_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_missing_old_stream_is_imported_without_it(tmp_path):
    # one iteration without vLLM: TRL computes no old log-probs; the run has the other streams
    write_trl_hook_file(tmp_path / "dump", edit=lambda out: out.pop("old_per_token_logps"))
    result = pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert "old" not in result.streams and {"rollout", "ref"} <= set(result.streams)


def test_truncated_file_is_e703(tmp_path):
    write_trl_hook_file(tmp_path / "dump")
    path = tmp_path / "dump" / "step_0.pt"
    path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703" and "step_0.pt" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_unknown_format_and_missing_tensor_are_e703(tmp_path):
    write_trl_hook_file(tmp_path / "dump")
    path = tmp_path / "dump" / "step_0.pt"
    rewrite_hook_file(path, lambda p: p["tensors"].pop("completion_lengths"))
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703" and "completion_lengths" in err.value.message
    rewrite_hook_file(path, lambda p: p.update(format="pgdiag.hookdump/v9"))
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703" and "format" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_hostile_pickle_is_e701_and_runs_nothing(tmp_path):
    write_trl_hook_file(tmp_path / "dump")
    path = tmp_path / "dump" / "step_0.pt"
    marker = tmp_path / "pwned"
    hostile_pt(path, marker, torch.load(path, weights_only=True))
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E701" and "io.open" in err.value.message  # builtins.open pickles as io.open
    assert not marker.exists()
    assert_nothing_written(tmp_path / "out")


def test_trls_own_completions_parquet_is_text_only_e702(tmp_path):
    src = tmp_path / "completions"
    src.mkdir()
    (src / "completions_00010.parquet").write_bytes(b"PAR1")
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("trl", src, tmp_path / "out")
    assert err.value.code == "E702"
    assert_nothing_written(tmp_path / "out")


def test_nan_reward_row_keeps_its_advantage(tmp_path):
    write_trl_hook_file(tmp_path / "dump")
    pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    row = (
        pgdiag.read_run(tmp_path / "out")
        .collect(["sample_id", "reward", "advantage"])
        .sort("sample_id")
        .row(3)
    )
    assert row[1] is None and not math.isnan(row[2])
