"""Preset verl: hook files (legacy trainer and v1 transfer queue) and RolloutSkip gen_batch.dp, every imported
value against the tensors the files were made from; W702 bypass mode; the refusals."""

from __future__ import annotations

import datetime
import json
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pgdiag
from pgdiag.errors import InvalidInputError, UsageError
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.hook_fixtures import (
    VERL_PROMPTS,
    VERL_RESPONSES,
    hostile_pickle,
    hostile_pt,
    rewrite_hook_file,
    write_verl_hook_files,
)

pytest.importorskip("tensordict")

from tests.importers.verl_fixtures import save_gen_batch

COLUMNS = ["step", "sample_id", "group_id", "input_ids", "prompt_len", "loss_mask", "rollout_logprobs",
           "old_logprobs", "ref_logprobs", "advantages", "reward", "reward_components", "env"]  # fmt: skip


def _rows(out):
    run = pgdiag.read_run(out)
    names = run.lazy.collect_schema().names()
    return run.collect([c for c in COLUMNS if c in names]).sort(["step", "sample_id"])


def test_legacy_hook_values_match_the_batch(tmp_path):
    made = write_verl_hook_files(tmp_path / "dump", steps=(3, 4))
    result = pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    assert [s.step for s in result.steps] == [3, 4] and result.n_samples == 8
    rows = _rows(tmp_path / "out")
    for row in rows.iter_rows(named=True):
        r = int(row["sample_id"].split(":")[1])
        td, nt = made[row["step"]].batch, made[row["step"]].non_tensor_batch
        prompt, response = VERL_PROMPTS[r], VERL_RESPONSES[r]
        p, n = len(prompt), len(response)
        mask = td["response_mask"][r, :n].bool().tolist()
        assert row["input_ids"] == prompt + response and row["prompt_len"] == p
        assert row["loss_mask"] == [False] * p + mask
        for column, field in (
            ("rollout_logprobs", "rollout_log_probs"),
            ("old_logprobs", "old_log_probs"),
            ("ref_logprobs", "ref_log_prob"),
            ("advantages", "advantages"),
        ):
            expected = [v if m else None for v, m in zip(td[field][r, :n].tolist(), mask, strict=True)]
            assert row[column] == [None] * p + expected, column
        assert row["reward"] == pytest.approx(float(td["token_level_scores"][r].sum()), abs=0)
        assert row["group_id"] == nt["uid"][r] and row["env"] == nt["data_source"][r]
        assert row["reward_components"] == {"acc": nt["acc"][r]}


def test_bypass_mode_old_copy_is_dropped_with_w702(tmp_path):
    write_verl_hook_files(tmp_path / "dump", bypass=True)
    result = pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    assert "old" not in result.streams and result.dropped_streams == ("old",)
    w702 = result.issues.issues.filter(result.issues.issues["code"] == "W702")
    assert w702.height == 1 and "bypass_mode" in w702["message"][0]
    assert "old_logprobs" not in pgdiag.read_run(tmp_path / "out").lazy.collect_schema().names()


def test_shifted_stream_is_e206(tmp_path):
    write_verl_hook_files(tmp_path / "dump")

    def shift(payload):
        rollout = payload["tensors"]["rollout_log_probs"]
        payload["tensors"]["rollout_log_probs"] = torch.cat([torch.zeros(4, 1), rollout[:, :-1]], dim=1)

    rewrite_hook_file(tmp_path / "dump" / "step_3.pt", shift)
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E206" and "rollout_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_zero_filled_stream_is_e206(tmp_path):
    write_verl_hook_files(tmp_path / "dump")
    rewrite_hook_file(tmp_path / "dump" / "step_3.pt", lambda p: p["tensors"]["ref_log_prob"].zero_())
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E206" and "ref_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_truncated_hook_file_is_e703(tmp_path):
    write_verl_hook_files(tmp_path / "dump")
    path = tmp_path / "dump" / "step_3.pt"
    path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E703"
    assert_nothing_written(tmp_path / "out")


def test_hostile_hook_file_is_e701(tmp_path):
    write_verl_hook_files(tmp_path / "dump")
    path, marker = tmp_path / "dump" / "step_3.pt", tmp_path / "pwned"
    hostile_pt(path, marker, torch.load(path, weights_only=True))
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    assert err.value.code == "E701" and not marker.exists()
    assert_nothing_written(tmp_path / "out")


# ---- v1 trainer: the hook reads the transfer queue -------------------------------------------------------


def test_v1_hook_reads_the_transfer_queue_and_drops_padding_rows(tmp_path, monkeypatch):
    import pgdiag.capture.verl

    prompts = [torch.tensor(p) for p in VERL_PROMPTS]
    responses = [torch.tensor(r) for r in VERL_RESPONSES]
    rollout = [-(torch.arange(len(r)) + 1) / 10 for r in VERL_RESPONSES]
    store = {
        "prompts": torch.nested.nested_tensor(prompts, layout=torch.jagged),
        "responses": torch.nested.nested_tensor(responses, layout=torch.jagged),
        "response_mask": torch.nested.nested_tensor(
            [torch.ones(len(r)) for r in responses], layout=torch.jagged
        ),
        "rollout_log_probs": torch.nested.nested_tensor(rollout, layout=torch.jagged),
        "rm_scores": torch.nested.nested_tensor([torch.ones(len(r)) for r in responses], layout=torch.jagged),
        "uid": np.array(["u0", "u1", "u0", "u1"], dtype=object),
    }
    calls = []

    def kv_batch_get(keys, partition_id, select_fields):
        calls.append(tuple(select_fields))
        missing = [f for f in select_fields if f not in store]
        if missing:
            raise KeyError(missing[0])
        return {f: store[f] for f in select_fields}

    monkeypatch.setitem(sys.modules, "transfer_queue", types.SimpleNamespace(kv_batch_get=kv_batch_get))
    keys = ["u0_s0_0", "u1_s1_0", "u0_s2_0", "u1_s3_1"]
    tags = [{"min_global_steps": 6}, {"min_global_steps": 7}, {"min_global_steps": 7, "is_padding": True},
            {"min_global_steps": 7}]  # fmt: skip
    seen = {}

    class Trainer:
        def __init__(self) -> None:
            self.config = {"actor_rollout_ref": {"rollout": {"temperature": 1.0, "n": 2}}}

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            seen["args"] = (batch, metrics, timing_raw, global_steps, epoch)
            return "metrics done"

    trainer = Trainer()
    pgdiag.capture.verl.install(trainer, tmp_path / "dump")
    batch = SimpleNamespace(keys=keys, tags=tags, partition_id="train")
    assert trainer._compute_metrics(batch, {}, {}, global_steps=7, epoch=0) == "metrics done"
    assert seen["args"][3] == 7 and seen["args"][0] is batch
    pgdiag.import_run("verl", tmp_path / "dump", tmp_path / "out")
    rows = (
        pgdiag.read_run(tmp_path / "out")
        .collect(
            [
                "sample_id",
                "segment_idx",
                "group_id",
                "input_ids",
                "rollout_logprobs",
                "reward",
                "policy_version",
            ]
        )
        .sort("sample_id")
    )
    kept = [0, 1, 3]  # row 2 is padding
    assert rows["sample_id"].to_list() == ["u0_s0", "u1_s1", "u1_s3"]
    assert rows["segment_idx"].to_list() == [0, 0, 1] and rows["group_id"].to_list() == ["u0", "u1", "u1"]
    assert rows["input_ids"].to_list() == [VERL_PROMPTS[r] + VERL_RESPONSES[r] for r in kept]
    assert rows["reward"].to_list() == [float(len(VERL_RESPONSES[r])) for r in kept]
    assert rows["policy_version"].to_list() == [6, 7, 7]
    third = rows["rollout_logprobs"].to_list()[2]
    assert third[:3] == [None] * 3 and third[3] == pytest.approx(-0.1)


# ---- RolloutSkip gen_batch.dp ----------------------------------------------------------------------------


def _gen_batch(tmp_path, step=2, meta_info=None):
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    responses = torch.tensor([[11, 12, 0], [13, 14, 15]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": torch.cumsum(attention, dim=1),
        "response_mask": torch.tensor([[1, 1, 0], [1, 0, 1]]),
        "rollout_log_probs": torch.tensor([[-0.5, -0.25, 0.0], [-1.0, 0.0, -2.0]]),
    }
    root = tmp_path / "dumps" / "exp_proj" / "GBS1_N2_in3_out3"
    return save_gen_batch(
        root / str(step), step, tensors, {"uid": np.array(["g", "g"], dtype=object)}, meta_info
    ), tensors


def test_gen_batch_values_match_the_dataproto(tmp_path):
    _gen_batch(tmp_path)
    result = pgdiag.import_run("verl", tmp_path / "dumps", tmp_path / "out")
    assert [s.step for s in result.steps] == [2] and result.streams == ("rollout",)
    rows = (
        pgdiag.read_run(tmp_path / "out")
        .collect(["sample_id", "group_id", "input_ids", "prompt_len", "loss_mask", "rollout_logprobs"])
        .sort("sample_id")
    )
    assert rows["input_ids"].to_list() == [[5, 6, 11, 12], [7, 8, 9, 13, 14, 15]]
    assert rows["prompt_len"].to_list() == [2, 3] and rows["group_id"].to_list() == ["g", "g"]
    assert rows["loss_mask"].to_list() == [[False, False, True, True], [False] * 3 + [True, False, True]]
    assert rows["rollout_logprobs"].to_list() == [[None, None, -0.5, -0.25], [None] * 3 + [-1.0, None, -2.0]]


def test_gen_batch_loads_without_tensordict_or_verl(tmp_path):
    import subprocess

    _gen_batch(tmp_path)
    code = (
        "import sys, pgdiag\n"
        f"pgdiag.import_run('verl', {str(tmp_path / 'dumps')!r}, {str(tmp_path / 'out')!r})\n"
        "print(sorted(m for m in ('tensordict', 'verl', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_truncated_gen_batch_is_e703(tmp_path):
    path, _ = _gen_batch(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("verl", tmp_path / "dumps", tmp_path / "out")
    assert err.value.code == "E703" and "gen_batch.dp" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_hostile_gen_batch_is_e701_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = hostile_pickle(tmp_path / "dumps" / "x" / "1" / "gen_batch.dp", marker)
    (path.parent / "meta.json").write_text('{"global_steps": 1}')
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("verl", tmp_path / "dumps", tmp_path / "out")
    assert err.value.code == "E701" and "io.open" in err.value.message
    assert not marker.exists()
    assert_nothing_written(tmp_path / "out")


def _expected_gen_batch_rows(tensors):
    """Each row's tokens, loss mask and rollout log-probs as RolloutSkip's batch holds them: the attended
    prompt and response tokens, response_mask on the response, the rollout value where the mask is on."""
    width = tensors["prompts"].shape[1]
    rows = []
    for r in range(tensors["prompts"].shape[0]):
        attended = tensors["attention_mask"][r].bool()
        ids = tensors["input_ids"][r][attended].tolist()
        n_prompt = int(attended[:width].sum())
        n_response = len(ids) - n_prompt
        mask = tensors["response_mask"][r][:n_response].bool().tolist()
        rollout = tensors["rollout_log_probs"][r][:n_response].tolist()
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": [False] * n_prompt + mask,
                "rollout_logprobs": [None] * n_prompt
                + [v if m else None for v, m in zip(rollout, mask, strict=True)],
            }
        )
    return rows


def test_gen_batch_global_outside_the_allow_list_needs_allow_unsafe_pickle(tmp_path):
    # an innocent stdlib global verl's allow-list does not hold: a date in meta_info pickles as datetime.date
    dump = tmp_path / "dumps"
    _, tensors = _gen_batch(
        tmp_path, meta_info={"temperature": 1.0, "dumped_on": datetime.date(2026, 11, 24)}
    )
    refused = import_cli("verl", dump, tmp_path / "refused")
    assert refused.exit_code == 2
    assert "error[E701]" in refused.stderr and "datetime.date" in refused.stderr
    assert "--allow-unsafe-pickle" in refused.stderr  # the hint names the escape
    assert_nothing_written(tmp_path / "refused")

    out = tmp_path / "unsafe"
    loaded = import_cli("verl", dump, out, "--allow-unsafe-pickle")
    assert loaded.exit_code == 0, loaded.stderr
    assert "--allow-unsafe-pickle: code inside the dump may run" in loaded.stderr
    rows = read_rows(out)
    expected = _expected_gen_batch_rows(tensors)
    for column in ("input_ids", "loss_mask", "rollout_logprobs"):
        assert rows[column].to_list() == [row[column] for row in expected], column
    assert rows["group_id"].to_list() == ["g", "g"] and rows["step"].to_list() == [2, 2]
    sidecar = json.loads((out / "pgdiag.json").read_text())
    assert sidecar["source"]["unsafe_load"] is True

    # the same batch without the date imports through the allow-list to bit-identical columns
    safe_dump = tmp_path / "safe"
    _gen_batch(safe_dump)
    assert import_cli("verl", safe_dump / "dumps", tmp_path / "safe_out").exit_code == 0
    safe_rows = read_rows(tmp_path / "safe_out")
    for column in ("input_ids", "loss_mask", "rollout_logprobs", "prompt_len", "seq_hash"):
        assert safe_rows[column].to_list() == rows[column].to_list(), column
    assert json.loads((tmp_path / "safe_out" / "pgdiag.json").read_text())["source"]["unsafe_load"] is False


def test_cli_hostile_gen_batch_without_the_flag_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = hostile_pickle(tmp_path / "dumps" / "x" / "1" / "gen_batch.dp", marker)
    (path.parent / "meta.json").write_text('{"global_steps": 1}')
    result = import_cli("verl", tmp_path / "dumps", tmp_path / "out")
    assert result.exit_code == 2 and "error[E701]" in result.stderr and "io.open" in result.stderr
    assert not marker.exists()
    assert_nothing_written(tmp_path / "out")


def test_v1_rollout_tq_dump_is_e703(tmp_path):
    (tmp_path / "skip" / "3" / "0").mkdir(parents=True)
    (tmp_path / "skip" / "3" / "0" / "tq_batch.pt").write_bytes(b"")
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("verl", tmp_path / "skip", tmp_path / "out")
    assert err.value.code == "E703" and "tq_batch.pt" in err.value.message
