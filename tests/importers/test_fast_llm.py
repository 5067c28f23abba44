"""Fast-LLM preset: capture files (message lines as the capture writes them), every imported value checked."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from pgdiag.capture.fast_llm import message_line
from pgdiag.errors import InvalidInputError
from pgdiag.importers.base import ImportOptions, load_preset
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.fast_llm_messages import DOCS, doc_messages, to_message


def _lines(messages: list[dict]) -> str:
    return "".join(
        message_line(
            f"{i + 1}-0".encode(),
            {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in m.items()},
        )
        for i, m in enumerate(messages)
    )


def _captures(tmp_path: Path, messages: list[dict] | None = None) -> Path:
    folder = tmp_path / "capture"
    folder.mkdir()
    messages = doc_messages() if messages is None else messages
    (folder / "capture_1.jsonl").write_text(_lines(messages[:2]))
    (folder / "capture_2.jsonl").write_text(_lines(messages[2:]))
    (folder / "capture_3.jsonl.partial").write_text(_lines(messages[:1]))
    return folder


def _read(src: Path) -> list:
    return list(load_preset("fast-llm").read(src, ImportOptions()))


def test_every_value(tmp_path: Path) -> None:
    steps = _read(_captures(tmp_path))
    assert [s.step for s in steps] == [1, 2]  # the .partial block is skipped
    rows = [r for s in steps for r in s.rows.iter_rows(named=True)]
    for row, doc in zip(rows, DOCS, strict=True):
        p = doc["spans"][0][1]
        assert row["input_ids"] == doc["tokens"]
        assert row["loss_mask"] == [False] * p + [True] * (len(doc["tokens"]) - p)
        assert row["rollout_logprobs"] == doc["lps"]  # token-aligned; the writer nulls off the mask
        assert row["policy_version_tok"] == doc["version"]
        assert row["advantage"] == doc["adv"] and row["advantages"] == [doc["adv"]] * len(doc["tokens"])
        assert row["reward"] == doc["reward"]
    assert [r["sample_id"] for r in rows] == ["1:0", "1:1", "2:0", "2:1"]


def test_json_list_fields_and_object_data(tmp_path: Path) -> None:
    folder = tmp_path / "capture"
    folder.mkdir()
    line = {
        "id": "1-0",
        "tokens": [4, 5, 6],
        "old_log_probabilities": [0.0, -0.5, -1.5],
        "data": {"reward": 2.0},
    }
    (folder / "capture_7.jsonl").write_text(json.dumps(line) + "\n")
    (step,) = _read(folder)
    assert step.step == 7 and step.rows["loss_mask"].to_list() == [[False, True, True]]  # position 0 only
    assert step.rows["rollout_logprobs"].to_list() == [[0.0, -0.5, -1.5]] and step.rows[
        "reward"
    ].to_list() == [2.0]


def test_int32_packed_tokens_are_e703(tmp_path: Path) -> None:
    message = to_message([5, 6, 7], [0.0, -1.0, -2.0])
    message["tokens"] = base64.b64decode(base64.b64encode(bytes(12)))  # 3 tokens as int32: 12 bytes
    with pytest.raises(InvalidInputError) as err:
        _read(_captures(tmp_path, [message] * 4))
    assert err.value.code == "E703" and "tokens" in err.value.message


def test_shifted_stream_is_e703(tmp_path: Path) -> None:
    message = to_message([5, 6, 7], [-1.0, -2.0])  # a next-token list: one value short
    with pytest.raises(InvalidInputError) as err:
        _read(_captures(tmp_path, [message] * 4))
    assert err.value.code == "E703" and "old_log_probabilities" in err.value.message


def test_truncated_file_is_e703_and_writes_nothing(tmp_path: Path) -> None:
    folder = _captures(tmp_path)
    path = folder / "capture_2.jsonl"
    path.write_bytes(path.read_bytes()[:-10])
    out = tmp_path / "run"
    result = import_cli("fast-llm", folder, out)
    assert result.exit_code == 3 and "error[E703]" in result.stderr and "capture_2.jsonl" in result.stderr
    assert_nothing_written(out)


def test_zero_filled_stream_is_e206_and_writes_nothing(tmp_path: Path) -> None:
    messages = [
        to_message(d["tokens"], [0.0] * len(d["tokens"]), loss_masking_spans=d["spans"]) for d in DOCS
    ]
    out = tmp_path / "run"
    result = import_cli("fast-llm", _captures(tmp_path, messages), out)
    assert result.exit_code == 3 and "error[E206]" in result.stderr
    assert_nothing_written(out)


def test_cli_import(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("fast-llm", _captures(tmp_path), out)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(out)
    assert rows["rollout_logprobs"].to_list()[0] == [None] * 3 + [-0.5, -0.25]
    assert rows["advantages"].to_list()[0] == [None] * 3 + [0.5, 0.5]
