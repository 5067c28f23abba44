"""miles preset: rollout dumps with AdapterRef/RewardSpec records, per-rank train files de-duplicated on
sample_indices, and the dashboard_columns Parquet alone, as miles 31f1ca96 writes them."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import polars as pl
import pytest
import torch

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers.base import ImportOptions, load_preset
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.slime_dumps import Hostile, sample_record, tensor, write_rollout_dump

PROMPTS = [[5, 6], [5, 6], [7, 8, 9]]
RESPONSES = [[10, 11, 12], [13, 14], [15, 16]]
ROLLOUT_LP = [[-0.5, -1.0, -0.25], [-2.0, -0.125], [-0.75, -1.5]]
OLD_LP = [[-0.625, -1.0, -0.5], [-2.25, -0.25], [-0.5, -1.25]]
REF_LP = [[-0.5, -0.75, -0.25], [-2.0, -0.5], [-1.0, -1.0]]
ADV = [[1.0] * 3, [-1.0] * 2, [0.5] * 2]


@pytest.fixture
def miles_types(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``miles.utils.types`` with its two frozen dataclasses, so pickles name them as miles' own do."""

    @dataclasses.dataclass(frozen=True)
    class AdapterRef:
        name: str
        slot: int

    @dataclasses.dataclass(frozen=True)
    class RewardSpec:
        rm_type: str | None = None
        custom_rm_path: str | None = None

    module = types.ModuleType("miles.utils.types")
    for cls in (AdapterRef, RewardSpec):
        cls.__module__ = module.__name__
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    for name in ("miles", "miles.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "miles.utils.types", module)
    return module


def _samples(miles_types: types.ModuleType, overrides: dict[int, dict] | None = None) -> list[dict]:
    out = []
    for i in range(3):
        fields = dict(
            index=40 + i,
            group_index=i // 2,
            tokens=PROMPTS[i] + RESPONSES[i],
            response_length=len(RESPONSES[i]),
            rollout_log_probs=ROLLOUT_LP[i],
            reward=float(i),
            extra={
                "adapter": miles_types.AdapterRef(name="lora-a", slot=1),
                "reward_spec": miles_types.RewardSpec(rm_type="math"),
                "rollout_indexer_topk": None,
                "opd_reverse_kl": None,
                "routing_key": None,
            },
        )
        fields.update((overrides or {}).get(i, {}))
        out.append(sample_record(**fields))
    return out


def _rank_file(
    path: Path, rows: list[int], *, with_log_probs: bool = True, cp_size: int = 1, **edit: object
) -> None:
    data = {
        "tokens": [torch.tensor(PROMPTS[r] + RESPONSES[r]) for r in rows],
        "response_lengths": [len(RESPONSES[r]) for r in rows],
        "total_lengths": [len(PROMPTS[r]) + len(RESPONSES[r]) for r in rows],
        "sample_indices": [40 + r for r in rows],
        "ref_log_probs": [tensor(REF_LP[r]) for r in rows],
        "advantages": [tensor(ADV[r]) for r in rows],
        "raw_reward": [0.0, 1.0, 2.0],
    }
    if with_log_probs:
        data["log_probs"] = [tensor(OLD_LP[r]) for r in rows]
    data.update(edit)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rollout_id": 2,
            "rank": 0,
            "rollout_data": data,
            "cp_rank": 0,
            "cp_size": cp_size,
            "qkv_format": "thd",
        },
        path,
    )


def _dump(tmp_path: Path, miles_types: types.ModuleType, overrides: dict[int, dict] | None = None) -> Path:
    dump = tmp_path / "dump"
    write_rollout_dump(dump / "rollout_data" / "2.pt", 2, _samples(miles_types, overrides), metadata={})
    # DP 2 x TP 2 x PP 2: rank 0/1 (PP stage 0) lack log_probs, TP peers repeat rows
    _rank_file(dump / "train_data" / "2_0.pt", [0, 1], with_log_probs=False)
    _rank_file(dump / "train_data" / "2_1.pt", [0, 1])
    _rank_file(dump / "train_data" / "2_2.pt", [0, 1])
    _rank_file(dump / "train_data" / "2_3.pt", [2])
    _rank_file(dump / "train_data" / "2_4.pt", [2])
    return dump


def _read(src: Path) -> list:
    return list(load_preset("miles").read(src, ImportOptions()))


def test_pt_dump_deduplicated_every_value(tmp_path: Path, miles_types: types.ModuleType) -> None:
    (step,) = _read(_dump(tmp_path, miles_types))
    rows = step.rows
    assert step.step == 2 and step.framework == "miles" and len(step.src_files) == 6
    assert rows["input_ids"].to_list() == [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert rows["prompt_len"].to_list() == [2, 2, 3]
    for column, source in (
        ("rollout_logprobs", ROLLOUT_LP),
        ("old_logprobs", OLD_LP),
        ("ref_logprobs", REF_LP),
        ("advantages", ADV),
    ):
        assert [row[len(PROMPTS[r]) :] for r, row in enumerate(rows[column].to_list())] == source, column
        assert all(
            row[: len(PROMPTS[r])] == [None] * len(PROMPTS[r]) for r, row in enumerate(rows[column].to_list())
        )
    assert rows["sample_id"].to_list() == ["40", "41", "42"]
    assert rows["group_id"].to_list() == ["0", "0", "1"]
    assert rows["reward"].to_list() == [0.0, 1.0, 2.0]


def test_disagreeing_peers_are_e703(tmp_path: Path, miles_types: types.ModuleType) -> None:
    dump = _dump(tmp_path, miles_types)
    _rank_file(dump / "train_data" / "2_4.pt", [2], advantages=[tensor([0.5, 0.25])])
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703" and "advantages" in err.value.message and "2_4.pt" in err.value.message


def test_context_parallel_is_e703(tmp_path: Path, miles_types: types.ModuleType) -> None:
    dump = _dump(tmp_path, miles_types)
    _rank_file(dump / "train_data" / "2_3.pt", [2], cp_size=2)
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703" and "cp_size" in err.value.message


def test_shifted_train_stream_is_e703(tmp_path: Path, miles_types: types.ModuleType) -> None:
    dump = _dump(tmp_path, miles_types)
    _rank_file(dump / "train_data" / "2_3.pt", [2], ref_log_probs=[tensor([0.0, *REF_LP[2]])])
    _rank_file(dump / "train_data" / "2_4.pt", [2], ref_log_probs=[tensor([0.0, *REF_LP[2]])])
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703" and "ref_log_probs" in err.value.message


def test_truncated_train_file_is_e703(tmp_path: Path, miles_types: types.ModuleType) -> None:
    dump = _dump(tmp_path, miles_types)
    path = dump / "train_data" / "2_1.pt"
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703"


def test_hostile_pickle_is_e701(tmp_path: Path, miles_types: types.ModuleType) -> None:
    marker = tmp_path / "pwned"
    dump = _dump(tmp_path, miles_types, {1: {"reward": Hostile(marker)}})
    with pytest.raises(UsageError) as err:
        _read(dump)
    assert err.value.code == "E701" and "io.open" in err.value.message
    assert not marker.exists()


def _write_dashboard(path: Path, rows: list[dict]) -> None:
    schema = dict(
        sample_index=pl.Int32,
        response_length=pl.Int32,
        total_length=pl.Int32,
        tokens=pl.List(pl.Int32),
        loss_mask=pl.List(pl.Int8),
        rollout_log_probs=pl.List(pl.Float32),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows, schema=schema).write_parquet(path, row_group_size=8)


def test_dashboard_columns_alone(tmp_path: Path) -> None:
    folder = tmp_path / "dump" / "dashboard_columns"
    rows = [
        dict(
            sample_index=40 + i,
            response_length=len(RESPONSES[i]),
            total_length=len(PROMPTS[i]) + len(RESPONSES[i]),
            tokens=PROMPTS[i] + RESPONSES[i],
            loss_mask=[1, 0, 1] if i == 0 else None,
            rollout_log_probs=ROLLOUT_LP[i],
        )
        for i in range(3)
    ]
    _write_dashboard(folder / "rollout_2.parquet", rows)
    _write_dashboard(folder / "rollout_eval_2.parquet", rows)
    (step,) = _read(tmp_path / "dump")
    out = step.rows
    assert step.step == 2 and step.default_group_by == "prompt" and "group_id" not in out.columns
    assert out["loss_mask"].to_list() == [
        [False, False, True, False, True],
        [False, False, True, True],
        [False] * 3 + [True] * 2,
    ]
    assert [row[len(PROMPTS[r]) :] for r, row in enumerate(out["rollout_logprobs"].to_list())] == ROLLOUT_LP
    assert out["sample_id"].to_list() == ["40", "41", "42"]
    assert "reward" not in out.columns and "finish_reason" not in out.columns


def test_cli_import_and_zero_filled_refusal(tmp_path: Path, miles_types: types.ModuleType) -> None:
    out = tmp_path / "run"
    result = import_cli("miles", _dump(tmp_path, miles_types), out)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(out)
    assert rows["ref_logprobs"].to_list()[2] == [None] * 3 + REF_LP[2]
    zeros = {i: {"rollout_log_probs": [0.0] * len(RESPONSES[i])} for i in range(3)}
    out2 = tmp_path / "run2"
    result = import_cli("miles", _dump(tmp_path / "z", miles_types, zeros), out2)
    assert result.exit_code == 3 and "error[E206]" in result.stderr
    assert_nothing_written(out2)
