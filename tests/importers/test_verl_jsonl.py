"""Preset verl-jsonl: files written as verl's _write_generations writes them, retokenized with a real tokenizer."""

from __future__ import annotations

import json

import polars as pl
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import pgdiag
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers.base import ImportOptions
from tests.importers.conftest import assert_nothing_written

VOCAB = {
    "[UNK]": 0,
    "what": 1,
    "is": 2,
    "two": 3,
    "plus": 4,
    "four": 5,
    "it": 6,
    "three": 7,
    "five": 8,
    "?": 9,
}


@pytest.fixture
def tokenizer_path(tmp_path):
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def _write_generations(dump_path, global_steps, inputs, outputs, scores, extra):
    """verl-project/verl 1dda039b ``RayPPOTrainer._write_generations``, minus the thread."""
    dump_path.mkdir(parents=True, exist_ok=True)
    n = len(inputs)
    base_data = {
        "input": inputs,
        "output": outputs,
        "gts": [None] * n,
        "score": scores,
        "step": [global_steps] * n,
    }
    for k, v in extra.items():
        if len(v) == n:
            base_data[k] = v
    with open(dump_path / f"{global_steps}.jsonl", "w") as f:
        for i in range(n):
            entry = {k: v[i] for k, v in base_data.items()}
            f.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")


def _v1_dump(tmp_path):
    src = tmp_path / "rollout_data"
    uids = ["u-a_0_0", "u-a_1_0", "u-b_0_0", "u-b_1_0"]  # {uid}_{session_id}_{index}, sorted
    _write_generations(
        src,
        7,
        ["what is two plus two ?"] * 2 + ["what is three ?"] * 2,
        ["four", "five", "three", "it is three"],
        [1.0, 0.0, 1.0, 1.0],
        {"acc": [1, 0, 1, 1], "uid": uids},
    )
    return src


def test_text_only_without_retokenize_is_e702(tmp_path):
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("verl-jsonl", _v1_dump(tmp_path), tmp_path / "out")
    assert err.value.code == "E702" and "7.jsonl" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_retokenized_v1_ids_groups_and_rewards(tmp_path, tokenizer_path):
    options = ImportOptions(retokenize=True, tokenizer=tokenizer_path)
    result = pgdiag.import_run("verl-jsonl", _v1_dump(tmp_path), tmp_path / "out", options=options)
    assert result.n_samples == 4 and result.streams == ()
    df = pl.read_parquet(tmp_path / "out" / "rollouts" / "part-00000.parquet").sort("sample_id")
    assert df["sample_id"].to_list() == ["u-a_0", "u-a_1", "u-b_0", "u-b_1"]
    assert df["group_id"].to_list() == ["u-a", "u-a", "u-b", "u-b"]
    assert df["segment_idx"].to_list() == [0, 0, 0, 0]
    assert df["input_ids"].to_list()[0] == [1, 2, 3, 4, 3, 9, 5]
    assert df["input_ids"].to_list()[3] == [1, 2, 7, 9, 6, 2, 7]
    assert df["prompt_len"].to_list() == [6, 6, 4, 4]
    assert df["loss_mask"].to_list()[3] == [False] * 4 + [True] * 3
    assert df["reward"].to_list() == [1.0, 0.0, 1.0, 1.0]
    assert df["reward_components"].to_list()[1] == {"acc": 0.0}
    assert df["step"].to_list() == [7] * 4
    meta = pgdiag.read_run(tmp_path / "out").meta
    assert meta["source"]["retokenized"] is True and meta["tokenizer"]["vocab_size"] == len(VOCAB)


def test_legacy_request_ids_and_prompt_groups(tmp_path, tokenizer_path):
    src = tmp_path / "legacy"
    _write_generations(
        src, 3, ["what is two ?", "what is two ?"], ["four", "five"], [1.0, 0.0], {"request_id": ["r1", "r2"]}
    )
    options = ImportOptions(retokenize=True, tokenizer=tokenizer_path)
    pgdiag.import_run("verl-jsonl", src, tmp_path / "out", options=options)
    df = pl.read_parquet(tmp_path / "out" / "rollouts" / "part-00000.parquet").sort("sample_id")
    assert df["sample_id"].to_list() == ["r1", "r2"]
    assert df["group_id"][0] == df["group_id"][1] and df["group_id"][0].startswith("p")


def test_truncated_file_is_e703(tmp_path, tokenizer_path):
    src = _v1_dump(tmp_path)
    path = src / "7.jsonl"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run(
            "verl-jsonl",
            src,
            tmp_path / "out",
            options=ImportOptions(retokenize=True, tokenizer=tokenizer_path),
        )
    assert err.value.code == "E703"
    assert_nothing_written(tmp_path / "out")


def test_empty_prompt_is_e703(tmp_path, tokenizer_path):
    src = tmp_path / "d"
    _write_generations(src, 1, [""], ["four"], [1.0], {})
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run(
            "verl-jsonl",
            src,
            tmp_path / "out",
            options=ImportOptions(retokenize=True, tokenizer=tokenizer_path),
        )
    assert err.value.code == "E703" and "input" in err.value.message
    assert_nothing_written(tmp_path / "out")
