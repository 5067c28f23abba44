"""SkyRL preset: TrainingInputBatch pickles as SkyRL dumps them, every imported value checked."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers.base import ImportOptions, load_preset
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.skyrl_batch import build_batch, install_module
from tests.importers.slime_dumps import Hostile

PROMPTS = [[3, 4, 5], [3, 4, 5], [8, 9]]
RESPONSES = [[20, 21], [22, 23, 24, 25], [26, 27, 28]]
LOSS = [[1, 1], [1, 0, 0, 1], [1, 1, 1]]
STREAMS = {
    "rollout_logprobs": [[-0.5, -0.25], [-1.0, -0.5, -0.125, -2.0], [-0.75, -0.375, -1.5]],
    "action_log_probs": [[-0.625, -0.25], [-1.25, -0.5, -4.0, -2.0], [-0.5, -0.5, -1.25]],
    "base_action_log_probs": [[-0.5, -0.5], [-1.0, -0.75, -3.0, -1.5], [-1.0, -0.25, -1.0]],
    "advantages": [[0.5, 0.5], [-0.5, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0]],
}
COLUMNS = {
    "rollout_logprobs": "rollout_logprobs",
    "action_log_probs": "old_logprobs",
    "base_action_log_probs": "ref_logprobs",
    "advantages": "advantages",
}


def _write(tmp_path: Path, *, streams: dict | None = None, bf16: tuple[str, ...] = (), step: int = 4) -> Path:
    install_module()
    folder = tmp_path / "export" / "dumped_data"
    folder.mkdir(parents=True, exist_ok=True)
    batch = build_batch(
        PROMPTS,
        RESPONSES,
        LOSS,
        streams or STREAMS,
        uids=["a", "a", "b"],
        dp_size=4,
        pad_token_id=151643,
        bf16=bf16,
    )
    batch.save(folder / f"global_step_{step}_training_input.pkl")
    return tmp_path / "export"


def _read(src: Path) -> list:
    return list(load_preset("skyrl").read(src, ImportOptions()))


def test_every_value(tmp_path: Path) -> None:
    (step,) = _read(_write(tmp_path))
    rows = step.rows
    assert step.step == 4 and step.framework == "skyrl" and rows.height == 3  # the pad_size row dropped
    assert [w.code for w in step.warnings] == ["note"]
    assert rows["input_ids"].to_list() == [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert rows["prompt_len"].to_list() == [3, 3, 2]
    assert rows["loss_mask"].to_list() == [
        [False] * 3 + [True, True],
        [False] * 3 + [True, False, False, True],
        [False] * 2 + [True] * 3,
    ]
    for key, column in COLUMNS.items():
        values = rows[column].to_list()
        assert [v[len(PROMPTS[i]) :] for i, v in enumerate(values)] == STREAMS[key], column
        assert all(v[: len(PROMPTS[i])] == [None] * len(PROMPTS[i]) for i, v in enumerate(values)), column
    assert rows["group_id"].to_list() == ["c4:0", "c4:0", "c4:1"]
    assert step.default_group_by == "field"
    assert "reward" not in rows.columns and "sample_id" not in rows.columns
    assert step.stream_fields == {
        "rollout_logprobs": "rollout_logprobs",
        "old_logprobs": "action_log_probs",
        "ref_logprobs": "base_action_log_probs",
    }


def test_bf16_tensors_go_through_torch_save_bytes(tmp_path: Path) -> None:
    (step,) = _read(_write(tmp_path, bf16=("action_log_probs",)))
    # the values above are exact in bf16
    assert [v[3:] for v in step.rows["old_logprobs"].to_list()[:2]] == STREAMS["action_log_probs"][:2]


def test_shifted_stream_is_e703(tmp_path: Path) -> None:
    install_module()
    batch = build_batch(PROMPTS, RESPONSES, LOSS, STREAMS, uids=["a", "a", "b"], dp_size=1)
    batch["rollout_logprobs"] = batch["rollout_logprobs"].roll(-1, dims=1)  # one column early
    folder = tmp_path / "dumped_data"
    folder.mkdir()
    batch.save(folder / "global_step_2_training_input.pkl")
    with pytest.raises(InvalidInputError) as err:
        _read(tmp_path)
    assert (
        err.value.code == "E703" and "rollout_logprobs" in err.value.message and "row 0" in err.value.message
    )


def test_truncated_file_is_e703(tmp_path: Path) -> None:
    export = _write(tmp_path)
    path = export / "dumped_data" / "global_step_4_training_input.pkl"
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(InvalidInputError) as err:
        _read(export)
    assert err.value.code == "E703"


def test_hostile_pickle_is_e701(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = tmp_path / "export" / "dumped_data"
    folder.mkdir(parents=True)
    (folder / "global_step_1_training_input.pkl").write_bytes(pickle.dumps({"batch": Hostile(marker)}))
    with pytest.raises(UsageError) as err:
        _read(tmp_path / "export")
    assert err.value.code == "E701" and "io.open" in err.value.message
    assert not marker.exists()


def test_non_left_padded_sequences_are_e703(tmp_path: Path) -> None:
    install_module()
    batch = build_batch(PROMPTS, RESPONSES, LOSS, STREAMS, uids=["a", "a", "b"], dp_size=1)
    batch["attention_mask"] = batch["attention_mask"].flip(1)  # right padding: another layout
    folder = tmp_path / "dumped_data"
    folder.mkdir()
    batch.save(folder / "global_step_2_training_input.pkl")
    with pytest.raises(InvalidInputError) as err:
        _read(tmp_path)
    assert err.value.code == "E703" and "attention_mask" in err.value.message


def test_cli_import_and_zero_filled_refusal(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("skyrl", _write(tmp_path), out)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(out)
    assert rows["old_logprobs"].to_list()[1] == [None] * 3 + [-1.25, None, None, -2.0]
    zeros = dict(STREAMS, rollout_logprobs=[[0.0] * len(r) for r in RESPONSES])
    out2 = tmp_path / "run2"
    result = import_cli("skyrl", _write(tmp_path / "z", streams=zeros), out2)
    assert result.exit_code == 3 and "error[E206]" in result.stderr
    assert_nothing_written(out2)
