"""Preset nemo-rl against files written as NeMo-RL's logger writes them (tests/importers/nemo_rl_fixture.py)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

import pgdiag
from pgdiag.errors import InvalidInputError
from tests.importers.conftest import assert_nothing_written
from tests.importers.nemo_rl_fixture import group_samples, write_train_data


def _dump(tmp_path, steps=(1, 2), **kwargs):
    src = tmp_path / "logs" / "exp"
    made = {
        n: write_train_data(src / f"train_data_step{n}.jsonl", group_samples(n), seed=n, **kwargs)
        for n in steps
    }
    return src, made


def _rows(out):
    return pgdiag.read_run(out).collect(
        [
            "step",
            "sample_id",
            "group_id",
            "input_ids",
            "prompt_len",
            "loss_mask",
            "rollout_logprobs",
            "reward",
        ]
        + [
            c
            for c in ("old_logprobs", "advantages")
            if c in pgdiag.read_run(out).lazy.collect_schema().names()
        ]
    )


def test_values_match_the_tensors_they_were_written_from(tmp_path):
    src, made = _dump(tmp_path)
    result = pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert [s.step for s in result.steps] == [1, 2]
    assert [s.n_samples for s in result.steps] == [4, 4]
    df = _rows(tmp_path / "out")
    samples = group_samples(1)
    for row in df.iter_rows(named=True):
        step, idx = row["step"], int(row["sample_id"].split(":")[1])
        assert row["sample_id"] == f"{step}:{idx}"
        src_t = made[step]
        s = group_samples(step)[idx]
        T = int(src_t["input_lengths"][idx])
        assert row["input_ids"] == src_t["token_ids"][idx, :T].tolist()
        assert row["prompt_len"] == len(s.prompt)
        expect_mask = ((src_t["token_loss_mask"][idx, :T] != 0) & bool(s.sample_mask)).tolist()
        assert row["loss_mask"] == expect_mask
        for column, field in (
            ("rollout_logprobs", "generation_logprobs"),
            ("old_logprobs", "prev_logprobs"),
            ("advantages", "advantages"),
        ):
            values = src_t[field][idx, :T].tolist()
            assert row[column] == [v if m else None for v, m in zip(values, expect_mask, strict=True)]
        assert row["reward"] == pytest.approx(float(src_t["rewards"][idx]))
    # two prompts per step: groups by prompt tokens
    step1 = df.filter(pl.col("step") == 1).sort("sample_id")
    assert step1["group_id"][0] == step1["group_id"][1] != step1["group_id"][2] == step1["group_id"][3]
    assert len(samples) == 4
    meta = pgdiag.read_run(tmp_path / "out").meta
    assert (
        meta["source"]["framework"] == "nemo-rl" and meta["streams"]["old"]["source_field"] == "prev_logprobs"
    )


def test_filtered_rewards_win(tmp_path):
    src, made = _dump(tmp_path, steps=(1,), dynamic_sampling=True)
    pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    df = _rows(tmp_path / "out").sort("sample_id")
    assert df["reward"].to_list() == pytest.approx(made[1]["rewards"].tolist())


def test_force_on_policy_zeros_drop_old_with_w701(tmp_path):
    src, _ = _dump(tmp_path, force_on_policy_ratio=True)
    result = pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert result.dropped_streams == ("old",)
    assert "W701" in result.issues.issues["code"].to_list()
    run = pgdiag.read_run(tmp_path / "out")
    assert "old" not in run.streams and "old_logprobs" not in run.lazy.collect_schema().names()
    sidecar = json.loads((tmp_path / "out" / "pgdiag.json").read_text())
    assert sidecar["stream_notes"]["old"].startswith("W701")


def test_zeros_on_some_steps_only_fail_e206(tmp_path):
    src = tmp_path / "logs"
    write_train_data(src / "train_data_step1.jsonl", group_samples(1), force_on_policy_ratio=True)
    write_train_data(src / "train_data_step2.jsonl", group_samples(2))
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert err.value.code == "E206" and "old_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_truncated_file_is_e703(tmp_path):
    src, _ = _dump(tmp_path)
    path = src / "train_data_step2.jsonl"
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert err.value.code == "E703" and "train_data_step2.jsonl" in err.value.message
    assert_nothing_written(tmp_path / "out")


def _rewrite(path, edit):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        edit(line)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_shifted_stream_is_e206(tmp_path):
    # generation_logprobs one position late: the prompt's 0.0 lands on each first loss position
    src, _ = _dump(tmp_path, steps=(1,))
    _rewrite(
        src / "train_data_step1.jsonl",
        lambda d: d.update(generation_logprobs=[[0.0, *d["generation_logprobs"][0][:-1]]]),
    )
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert err.value.code == "E206"
    assert_nothing_written(tmp_path / "out")


def test_zero_filled_rollout_is_e206(tmp_path):
    src, _ = _dump(tmp_path, steps=(1,))
    _rewrite(
        src / "train_data_step1.jsonl",
        lambda d: d.update(generation_logprobs=[[0.0] * len(d["token_ids"][0])]),
    )
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert err.value.code == "E206" and "rollout_logprobs" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_unwrapped_value_is_e703(tmp_path):
    src, _ = _dump(tmp_path, steps=(1,))
    _rewrite(src / "train_data_step1.jsonl", lambda d: d.update(rewards=[1.0, 2.0]))
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert err.value.code == "E703" and "rewards" in err.value.message


def test_cli_import_then_compare_zero_deltas(tmp_path):
    from typer.testing import CliRunner

    from pgdiag.cli.app import build_app

    src, _ = _dump(tmp_path)
    runner = CliRunner()
    for name in ("a", "b"):
        res = runner.invoke(
            build_app(), ["import", "--preset", "nemo-rl", str(src), str(tmp_path / name), "--json"]
        )
        assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout.strip().splitlines()[-1])
    assert payload["inputs"]["n_samples"] == 8 and payload["inputs"]["steps"] == [1, 2]
    res = runner.invoke(build_app(), ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])["summary"]
    values = [
        v for pair in summary.values() for k, v in pair.items() if k.endswith(("abs_mean", "/rms", "/bias"))
    ]
    assert values and np.allclose(values, 0.0, atol=0) and all(v == 0.0 for v in values)


def test_ignore_hides_w701_but_still_drops(tmp_path):
    src, _ = _dump(tmp_path, force_on_policy_ratio=True)
    result = pgdiag.import_run("nemo-rl", src, tmp_path / "out", ignore=("W701",))
    assert result.dropped_streams == ("old",) and "W701" not in result.issues.issues["code"].to_list()
    assert pgdiag.read_run(tmp_path / "out").meta["import"]["ignored_codes"] == ["W701"]


def test_token_id_past_int32_is_e103_not_wrapped(tmp_path):
    # before: int64 ids were cast to int32 without a check, so 2**31 became -2**31 in the imported run
    src, _ = _dump(tmp_path, steps=(1,))
    _rewrite(src / "train_data_step1.jsonl", lambda d: d.update(token_ids=[[2**31, *d["token_ids"][0][1:]]]))
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("nemo-rl", src, tmp_path / "out")
    assert err.value.code == "E103"
    assert str(2**31) in err.value.message and "input_ids" in err.value.message
    assert_nothing_written(tmp_path / "out")
