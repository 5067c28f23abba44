"""slime preset: rollout and train dumps as slime writes them, every imported value checked."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers.base import ImportOptions, load_preset
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.slime_dumps import (
    Hostile,
    sample_record,
    slime_train_payload,
    tensor,
    top_p_tape,
    write_rollout_dump,
)

PROMPTS = [[11, 12, 13], [11, 12, 13], [21, 22], [21, 22]]
RESPONSES = [[31, 32, 33, 34], [41, 42, 43], [51, 52], [61, 62, 63]]
ROLLOUT_LP = [[-0.5, -0.25, 0.0, -1.0], [-0.125, -2.0, -0.75], [-0.5, -0.5], [-1.5, -0.0625, -3.0]]
LOSS_MASKS = [[1, 1, 0, 1], None, None, [1, 1, 1]]
OLD_LP = [[-0.5, -0.375, -9.0, -1.25], [-0.25, -2.5, -0.5], [-0.75, -0.25], [-1.0, -0.125, -2.5]]
REF_LP = [[-0.625, -0.5, -8.0, -1.0], [-0.5, -2.0, -0.25], [-0.5, -0.5], [-1.25, -0.25, -2.0]]
ADV = [[0.5, 0.5, 0.5, 0.5], [-0.5, -0.5, -0.5], [1.0, 1.0], [-1.0, -1.0, -1.0]]


def _samples(overrides: dict[int, dict] | None = None) -> list[dict]:
    samples = []
    for i in range(4):
        fields = dict(
            index=100 + i,
            group_index=7 + i // 2,
            tokens=PROMPTS[i] + RESPONSES[i],
            response_length=len(RESPONSES[i]),
            rollout_log_probs=ROLLOUT_LP[i],
            loss_mask=LOSS_MASKS[i],
            reward=float(i % 2),
            status=["completed", "truncated", "aborted", "completed"][i],
            weight_versions=(str(3 + i % 2), "9"),
            remove_sample=i == 2,
        )
        fields.update((overrides or {}).get(i, {}))
        samples.append(sample_record(**fields))
    return samples


def _train(rollout_id: int, *, global_batch_sizes: list[int], raw_reward: list | None = None) -> dict:
    shards = []
    for partition in ([0, 2], [1, 3]):
        shards.append(
            {
                "partition": partition,
                "sample_indices": [100 + p for p in partition],
                "tokens": [torch.tensor(PROMPTS[p] + RESPONSES[p]) for p in partition],
                "response_lengths": [len(RESPONSES[p]) for p in partition],
                "loss_masks": [
                    torch.tensor(LOSS_MASKS[p] or [1] * len(RESPONSES[p]), dtype=torch.int) for p in partition
                ],
                "log_probs": [tensor(OLD_LP[p]) for p in partition],
                "ref_log_probs": [tensor(REF_LP[p]) for p in partition],
                "advantages": [tensor(ADV[p]) for p in partition],
                "rewards": [0.7, -0.7],  # group-normalised: never the reward
                "micro_batch_indices": [[[0, 1]]],
                "num_microbatches": [1] * len(global_batch_sizes),
                "global_batch_sizes": global_batch_sizes,
            }
        )
    return slime_train_payload(rollout_id, shards, raw_reward=raw_reward)


def _dump(
    tmp_path: Path,
    *,
    overrides: dict[int, dict] | None = None,
    train: bool = True,
    global_batch_sizes: tuple[int, ...] = (4,),
) -> Path:
    dump = tmp_path / "dump"
    write_rollout_dump(dump / "rollout_data" / "5.pt", 5, _samples(overrides))
    write_rollout_dump(dump / "rollout_data" / "eval_5.pt", 5, _samples())
    if train:
        (dump / "train_data").mkdir()
        torch.save(_train(5, global_batch_sizes=list(global_batch_sizes)), dump / "train_data" / "5.pt")
    return dump


def _read(src: Path, **options: object) -> list:
    return list(load_preset("slime").read(src, ImportOptions(**options)))


def test_rollout_and_train_dump_every_value(tmp_path: Path) -> None:
    (step,) = _read(_dump(tmp_path))
    assert step.step == 5 and step.framework == "slime" and step.default_group_by == "field"
    assert step.warnings == []
    rows = step.rows
    assert rows["input_ids"].to_list() == [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert rows["prompt_len"].to_list() == [3, 3, 2, 2]
    masks = [
        [False] * 3 + [True, True, False, True],
        [False] * 3 + [True] * 3,
        [False] * 4,  # remove_sample: the trainer's mask is all zeros
        [False] * 2 + [True] * 3,
    ]
    assert rows["loss_mask"].to_list() == masks
    for column, source in (
        ("rollout_logprobs", ROLLOUT_LP),
        ("old_logprobs", OLD_LP),
        ("ref_logprobs", REF_LP),
        ("advantages", ADV),
    ):
        for r, row in enumerate(rows[column].to_list()):
            # the preset places values; the writer nulls them off the mask
            assert row[: len(PROMPTS[r])] == [None] * len(PROMPTS[r]), column
            assert row[len(PROMPTS[r]) :] == source[r], column
    assert rows["sample_id"].to_list() == ["100", "101", "102", "103"]
    assert rows["group_id"].to_list() == ["7", "7", "8", "8"]
    assert rows["reward"].to_list() == [0.0, 1.0, 0.0, 1.0]
    assert rows["finish_reason"].to_list() == ["stop", "length", "abort", "stop"]
    assert rows["policy_version"].to_list() == [3, 4, 3, 4]
    assert step.stream_fields == {
        "rollout_logprobs": "rollout_log_probs",
        "old_logprobs": "log_probs",
        "ref_logprobs": "ref_log_probs",
    }
    assert len(step.src_files) == 2 and all("eval" not in f for f in step.src_files)


def test_rollout_dump_alone_and_dict_rewards(tmp_path: Path) -> None:
    dump = _dump(tmp_path, train=False, overrides={0: {"reward": {"acc": 1.0, "fmt": 0.5, "note": "x"}}})
    (step,) = _read(dump / "rollout_data" / "5.pt")
    rows = step.rows
    assert "old_logprobs" not in rows.columns and "advantages" not in rows.columns
    assert rows["reward"].to_list() == [None, 1.0, 0.0, 1.0]
    comps = rows["reward_components"].to_list()
    assert comps[0] == [{"key": "acc", "value": 1.0}, {"key": "fmt", "value": 0.5}] and comps[1] is None


def test_dict_reward_comes_from_train_raw_reward(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    write_rollout_dump(
        dump / "rollout_data" / "5.pt", 5, _samples({i: {"reward": {"acc": float(i)}} for i in range(4)})
    )
    (dump / "train_data").mkdir()
    torch.save(
        _train(5, global_batch_sizes=[4], raw_reward=[0.25, 0.5, 0.75, 1.0]), dump / "train_data" / "5.pt"
    )
    (step,) = _read(dump)
    assert step.rows["reward"].to_list() == [0.25, 0.5, 0.75, 1.0]


def test_w703_more_than_one_optimizer_step(tmp_path: Path) -> None:
    (step,) = _read(_dump(tmp_path, global_batch_sizes=(2, 2)))
    assert [w.code for w in step.warnings] == ["W703"]
    assert "old_logprobs" in step.rows.columns  # kept, flagged


def test_shifted_rollout_stream_is_e703(tmp_path: Path) -> None:
    dump = _dump(tmp_path, train=False, overrides={1: {"rollout_log_probs": [0.0, *ROLLOUT_LP[1]]}})
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert (
        err.value.code == "E703" and "rollout_log_probs" in err.value.message and "row 1" in err.value.message
    )


def test_truncated_file_is_e703(tmp_path: Path) -> None:
    dump = _dump(tmp_path, train=False)
    path = dump / "rollout_data" / "5.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703"


def test_hostile_pickle_is_e701_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dump = _dump(tmp_path, train=False, overrides={0: {"extra": {"metadata": {"x": Hostile(marker)}}}})
    with pytest.raises(UsageError) as err:
        _read(dump)
    assert err.value.code == "E701" and "io.open" in err.value.message
    assert not marker.exists()


def test_train_tokens_must_match_the_rollout(tmp_path: Path) -> None:
    dump = _dump(tmp_path)
    payload = torch.load(dump / "train_data" / "5.pt", weights_only=True)
    payload["samples"][2]["tokens"] = torch.tensor([1, 2, 3, 4])
    torch.save(payload, dump / "train_data" / "5.pt")
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703" and "tokens" in err.value.message


def test_other_train_format_version_is_e703(tmp_path: Path) -> None:
    dump = _dump(tmp_path)
    payload = torch.load(dump / "train_data" / "5.pt", weights_only=True)
    payload["format_version"] = 1
    torch.save(payload, dump / "train_data" / "5.pt")
    with pytest.raises(InvalidInputError) as err:
        _read(dump)
    assert err.value.code == "E703" and "format_version" in err.value.message


def test_zero_values_on_loss_positions_are_kept(tmp_path: Path) -> None:
    (step,) = _read(_dump(tmp_path, train=False, overrides={3: {"rollout_log_probs": [0.0, 0.0, 0.0]}}))
    assert step.rows["rollout_logprobs"].to_list()[3][2:] == [0.0, 0.0, 0.0]
    assert not any(math.isnan(v) for v in step.rows["rollout_logprobs"].to_list()[3][2:])


# ------------------------------------------------------------------------------------------ through the CLI


def test_cli_import_writes_masked_values(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("slime", _dump(tmp_path), out)
    assert result.exit_code == 0, result.stderr
    assert "step 5: 4 samples" in result.stderr
    rows = read_rows(out)
    assert rows["step"].to_list() == [5] * 4 and rows["group_id"].to_list() == ["7", "7", "8", "8"]
    old = rows["old_logprobs"].to_list()
    # masks, not values: the tool token's -9.0 and the removed sample's values are nulled
    assert old[0] == [None] * 3 + [-0.5, -0.375, None, -1.25]
    assert old[2] == [None] * 4
    assert rows["rollout_logprobs"].to_list()[1] == [None] * 3 + ROLLOUT_LP[1]


def test_cli_zero_filled_stream_is_e206_and_writes_nothing(tmp_path: Path) -> None:
    zeros = {i: {"rollout_log_probs": [0.0] * len(RESPONSES[i])} for i in range(4)}
    out = tmp_path / "run"
    result = import_cli("slime", _dump(tmp_path, overrides=zeros, train=False), out)
    assert result.exit_code == 3 and "error[E206]" in result.stderr
    assert_nothing_written(out)


def test_cli_hostile_pickle_exits_2_with_e701(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    result = import_cli(
        "slime", _dump(tmp_path, overrides={0: {"extra": {"metadata": Hostile(marker)}}}), out
    )
    assert result.exit_code == 2 and "error[E701]" in result.stderr and "io.open" in result.stderr
    assert not marker.exists()
    assert_nothing_written(out)


def test_cli_truncated_train_file_exits_3_with_e703(tmp_path: Path) -> None:
    dump = _dump(tmp_path)
    path = dump / "train_data" / "5.pt"
    path.write_bytes(path.read_bytes()[:100])
    out = tmp_path / "run"
    result = import_cli("slime", dump, out)
    assert result.exit_code == 3 and "error[E703]" in result.stderr and "train_data/5.pt" in result.stderr
    assert_nothing_written(out)


def test_cli_w703_is_printed_and_old_kept(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("slime", _dump(tmp_path, global_batch_sizes=(2, 2)), out, "--json")
    assert result.exit_code == 0, result.stderr
    assert "W703" in result.stderr
    assert "old_logprobs" in read_rows(out).columns


def test_numpy_routing_replay_arrays_load(tmp_path: Path) -> None:
    import numpy as np

    routes = np.arange(24, dtype=np.int32).reshape(
        6, 2, 2
    )  # (T - 1, layers, top_k): no route for the last token
    experts = {0: {"extra": {"rollout_routed_experts": routes}}}
    (step,) = _read(_dump(tmp_path, overrides=experts, train=False))
    assert step.rows["input_ids"].to_list()[0] == PROMPTS[0] + RESPONSES[0]
    got = step.rows["routed_experts"].to_list()
    assert got[0] == [*range(24), -1, -1, -1, -1]  # flat (T, L, k), the last token's 2 x 2 entries -1
    assert got[1:] == [None, None, None]  # samples without routes


def test_routing_replay_arrays_of_the_wrong_length_are_e703(tmp_path: Path) -> None:
    import numpy as np

    experts = {0: {"extra": {"rollout_routed_experts": np.zeros((4, 2, 2), dtype=np.int32)}}}
    with pytest.raises(InvalidInputError) as err:
        _read(_dump(tmp_path, overrides=experts, train=False))
    assert err.value.code == "E703" and "rollout_routed_experts" in err.value.message


# top-p kept sets per response token (sample 0's third token is a tool token: an empty span)
TOP_P = [[[31, 5], [32], 1, [34, 1, 2]], [[41], [42, 7], [43, 8, 9]], [[51, 3], [52]], [[61], [62], [63, 60]]]


def _top_p_overrides(tapes: list[list]) -> dict[int, dict]:
    out = {}
    for i, spans in enumerate(tapes):
        ids, offsets = top_p_tape(spans)
        out[i] = {"extra": {"rollout_top_p_token_ids": ids, "rollout_top_p_token_offsets": offsets}}
    return out


def test_top_p_kept_sets_are_imported_over_all_tokens(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("slime", _dump(tmp_path, overrides=_top_p_overrides(TOP_P), train=False), out)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(out)
    ids, offsets = rows["sampling_kept_ids"].to_list(), rows["sampling_kept_offsets"].to_list()
    assert ids[0] == [31, 5, 32, 34, 1, 2]
    assert offsets[0] == [0, 0, 0, 0, 2, 3, 3, 6]  # 3 prompt positions (empty), then slime's response offsets
    assert ids[1] == [41, 42, 7, 43, 8, 9] and offsets[1] == [0, 0, 0, 0, 1, 3, 6]
    assert offsets[2] == [0, 0, 0, 2, 3] and offsets[3] == [0, 0, 0, 1, 2, 4]


@pytest.mark.parametrize(
    ("tapes", "code", "where"),
    [
        (
            [
                [[31, 5], [32], 1, [34, 1, 2]],
                [[41], [42, 7], [43, 8, 9]],
                [[51, 3], [52]],
                [[61], [62], [60, 63]],
            ],
            None,
            None,
        ),
        ([[[31, 5], [99], 1, [34, 1, 2]], *TOP_P[1:]], "E221", "sample 100, pos 4"),
        ([*TOP_P[:3], [[61], [62, 62], [63]]], "E223", "sample 103, pos 3"),
    ],
    ids=["order_of_ids_free", "sampled_outside", "duplicate"],
)
def test_broken_top_p_kept_sets_are_refused(
    tmp_path: Path, tapes: list, code: str | None, where: str | None
) -> None:
    out = tmp_path / "run"
    result = import_cli("slime", _dump(tmp_path, overrides=_top_p_overrides(tapes), train=False), out)
    if code is None:
        assert result.exit_code == 0, result.stderr
        return
    assert result.exit_code == 3 and f"error[{code}]" in result.stderr and where in result.stderr, (
        result.stderr
    )
    assert_nothing_written(out)


def test_top_p_offsets_not_monotone_are_e220(tmp_path: Path) -> None:
    overrides = _top_p_overrides(TOP_P)
    overrides[1]["extra"]["rollout_top_p_token_offsets"] = torch.tensor([0, 3, 1, 6], dtype=torch.int32)
    out = tmp_path / "run"
    result = import_cli("slime", _dump(tmp_path, overrides=overrides, train=False), out)
    assert result.exit_code == 3 and "error[E220]" in result.stderr and "sample 101" in result.stderr, (
        result.stderr
    )
    assert_nothing_written(out)


def test_imported_versions_give_slimes_lag(tmp_path: Path) -> None:
    """slime 624b824a pushes weight_version 1 before rollout 0 and r + 1 after training rollout r
    (`train.py`, `update_weight_from_tensor.py`): rollout 5 trains on version 6, so a sample of version 6 is
    on-policy and one of version 5 one step stale (train_async.py). The preset's offset −1 says so."""
    import polars as pl

    from pgdiag.data.runs import read_run
    from pgdiag.metrics.api import compute_metrics
    from pgdiag.metrics.settings import MetricSettings

    versions = {i: {"weight_versions": (("6",) if i in (0, 3) else ("5", "6"))} for i in range(4)}
    out = tmp_path / "run"
    assert import_cli("slime", _dump(tmp_path, overrides=versions), out).exit_code == 0
    report = compute_metrics(read_run(out), MetricSettings(by=("lag",), new="old", old="rollout"))
    lag = report.summary.filter((pl.col("breakdown") == "lag") & (pl.col("metric") == "count/tokens"))
    tokens = dict(zip(lag["bucket"].to_list(), lag["value"].to_list(), strict=True))
    assert tokens == {"0": 3.0 + 3.0, "1": 3.0}  # samples 0 and 3 at lag 0; 1 at lag 1; 2 has no loss token
