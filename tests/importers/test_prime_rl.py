"""prime-rl preset: 0.8.0 MicroBatch files encoded by msgspec, every imported value checked, the pinned field
order checked field by field."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import polars as pl
import pytest

from pgdiag.errors import InvalidInputError
from pgdiag.importers.base import ImportOptions, load_preset
from pgdiag.importers.msgpack import decode
from tests.importers.cli_import import import_cli, read_rows
from tests.importers.conftest import assert_nothing_written
from tests.importers.prime_rl_batches import Sample, dummy, pack, write_rank

# three samples; prompt tokens masked, one tool token (mask false) in sample 1
SAMPLES = [
    Sample([7, 8, 100, 101, 102], [False, False, True, True, True], [0.0, 0.0, -0.5, -0.25, -1.0],
           [0.0, 0.0, 0.75, 0.75, 0.75], [1.0, 1.0, 0.7, 0.7, 0.7], "math", [0.0, 0.0, -0.5, -0.5, -0.75]),
    Sample([7, 8, 110, 55, 111], [False, False, True, False, True], [0.0, 0.0, -2.0, 0.0, -0.125],
           [0.0, 0.0, -0.75, -0.75, -0.75], [1.0, 1.0, 0.7, 0.7, 0.7], "math", [0.0, 0.0, -1.5, -3.0, -0.25]),
    Sample([9, 120, 121], [False, True, True], [0.0, -0.0625, -4.0],
           [0.0, 0.5, 0.5], [1.0, 1.0, 1.0], "code", [0.0, -0.125, -3.5]),
]  # fmt: skip


def _dump(tmp_path: Path, samples: list[Sample] = SAMPLES) -> Path:
    root = tmp_path / "out"
    first = pack(samples[:2], pad_to_multiple_of=4)  # 10 tokens + 2 padding
    write_rank(root, 3, 0, [first])
    write_rank(root, 3, 1, [pack(samples[2:]), dummy(first)])
    return root


def _read(src: Path) -> list:
    return list(load_preset("prime-rl").read(src, ImportOptions()))


def test_decoder_matches_msgspec() -> None:
    value = [[1, 300, -5, 70000, 2**40], [0.5, -1.25], [True, False], "é", b"\x00\x01", None, {"k": [1.5]}]
    data = msgspec.msgpack.encode(value)
    decoded = decode(data, source="x")
    assert decoded[0] == value[0] and decoded[3:6] == value[3:6] and decoded[6]["k"].tolist() == [1.5]
    assert decoded[1].tolist() == [0.5, -1.25] and decoded[2].tolist() == [True, False]


def test_every_value(tmp_path: Path) -> None:
    (step,) = _read(_dump(tmp_path))
    rows = step.rows
    assert step.step == 3 and step.framework_version == "0.8.0" and rows.height == 3
    assert [w.code for w in step.warnings] == ["note"]  # the dummy micro-batch
    assert rows["input_ids"].to_list() == [s.token_ids for s in SAMPLES]
    assert rows["loss_mask"].to_list() == [s.mask for s in SAMPLES]
    assert rows["rollout_logprobs"].to_list() == [s.logprobs for s in SAMPLES]
    assert rows["ref_logprobs"].to_list() == [s.ref_logprobs for s in SAMPLES]
    assert rows["advantages"].to_list() == [s.advantages for s in SAMPLES]
    got_t = np.array([x for row in rows["temperature_tok"].to_list() for x in row])
    assert np.array_equal(got_t, np.array([x for s in SAMPLES for x in s.temperatures], dtype=np.float32))
    assert rows["env"].to_list() == ["math", "math", "code"]
    assert rows["sample_id"].to_list() == ["3:0", "3:1", "3:2"]
    assert "old_logprobs" not in rows.columns and "reward" not in rows.columns


def test_rl_weights_zero_leave_the_loss_mask(tmp_path: Path) -> None:
    samples = list(SAMPLES)
    samples[2] = Sample(**{**SAMPLES[2].__dict__, "rl_weights": [1.0, 0.0, 1.0]})
    root = tmp_path / "out"
    write_rank(root, 0, 0, [pack(samples)])
    (step,) = _read(root)
    assert step.rows["loss_mask"].to_list()[2] == [False, False, True]


def _raw_batch(tmp_path: Path) -> list:
    root = _dump(tmp_path)
    return msgspec.msgpack.decode((root / "rollouts" / "step_3" / "rank_0.bin").read_bytes())


def _rewrite(tmp_path: Path, raw: list) -> Path:
    root = tmp_path / "out"
    (root / "rollouts" / "step_3" / "rank_0.bin").write_bytes(msgspec.msgpack.encode(raw))
    return root


def test_swapped_fields_are_e703_naming_the_field(tmp_path: Path) -> None:
    raw = _raw_batch(tmp_path)
    raw[0][6], raw[0][7] = raw[0][7], raw[0][6]  # temperatures <-> env_names: another version's order
    with pytest.raises(InvalidInputError) as err:
        _read(_rewrite(tmp_path, raw))
    assert err.value.code == "E703" and "temperatures" in err.value.message


def test_extra_trailing_field_is_e703(tmp_path: Path) -> None:
    raw = _raw_batch(tmp_path)
    raw[0] = raw[0] + [None] * (18 - len(raw[0]))  # 17 with kept_tokens (prime-rl#3431), one more
    with pytest.raises(InvalidInputError) as err:
        _read(_rewrite(tmp_path, raw))
    assert err.value.code == "E703" and "18" in err.value.message


def test_shifted_stream_is_e703_naming_the_field(tmp_path: Path) -> None:
    raw = _raw_batch(tmp_path)
    raw[0][3] = raw[0][3][1:]  # inference_logprobs one short: a next-token list
    with pytest.raises(InvalidInputError) as err:
        _read(_rewrite(tmp_path, raw))
    assert err.value.code == "E703" and "inference_logprobs" in err.value.message


def test_truncated_file_is_e703(tmp_path: Path) -> None:
    root = _dump(tmp_path)
    path = root / "rollouts" / "step_3" / "rank_1.bin"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(InvalidInputError) as err:
        _read(root)
    assert err.value.code == "E703" and "rank_1.bin" in err.value.message


def test_cli_import_and_zero_filled_refusal(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("prime-rl", _dump(tmp_path), out)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(out)
    assert rows["rollout_logprobs"].to_list()[1] == [None, None, -2.0, None, -0.125]
    zeros = [Sample(**{**s.__dict__, "logprobs": [0.0] * len(s.token_ids)}) for s in SAMPLES]
    out2 = tmp_path / "run2"
    result = import_cli("prime-rl", _dump(tmp_path / "z", zeros), out2)
    assert result.exit_code == 3 and "error[E206]" in result.stderr
    assert_nothing_written(out2)


def _with_routes(samples: list[Sample], layers: int = 2, top_k: int = 3) -> list[Sample]:
    """The samples with engine routes: expert (7 t + 3 l + j) % 16 of token t, layer l, rank j (uint8 as vLLM)."""
    out = []
    for s in samples:
        t = np.arange(len(s.token_ids))[:, None, None]
        routes = ((7 * t + 3 * np.arange(layers)[None, :, None] + np.arange(top_k)) % 16).astype(np.uint8)
        out.append(Sample(**{**s.__dict__, "routed_experts": routes}))
    return out


def test_routed_experts_cut_per_sample_and_kept_flat(tmp_path: Path) -> None:
    samples = _with_routes(SAMPLES)
    (step,) = _read(_dump(tmp_path, samples))
    got = step.rows["routed_experts"].to_list()
    assert step.rows.schema["routed_experts"] == pl.List(pl.Int16)
    assert got == [s.routed_experts.reshape(-1).astype(int).tolist() for s in samples]  # type: ignore[union-attr]


def test_routed_experts_reach_the_written_run(tmp_path: Path) -> None:
    samples = _with_routes(SAMPLES)
    out = tmp_path / "run"
    result = import_cli("prime-rl", _dump(tmp_path, samples), out)
    assert result.exit_code == 0, result.output
    rows = read_rows(out).sort("sample_id")
    assert rows["routed_experts"].to_list() == [
        s.routed_experts.reshape(-1).astype(int).tolist()  # type: ignore[union-attr]
        for s in samples
    ]


def test_routed_experts_of_the_wrong_token_count_are_e703(tmp_path: Path) -> None:
    samples = _with_routes(SAMPLES)
    samples[1] = Sample(**{**samples[1].__dict__, "routed_experts": samples[1].routed_experts[:-1]})  # type: ignore[index]
    with pytest.raises(InvalidInputError) as err:
        _read(_dump(tmp_path, samples))
    assert err.value.code == "E703" and "routed_experts" in err.value.message


# the kept set of every token of SAMPLES (no mask on prompt and tool tokens), each holding the sampled token
KEPT = [
    [[], [], [100, 3], [101], [102, 4, 5]],
    [[], [], [110, 111], [], [111]],
    [[], [120, 6, 7], [121]],
]


def _with_kept(kept: list[list[list[int]]]) -> list[Sample]:
    return [Sample(**{**s.__dict__, "kept": k}) for s, k in zip(SAMPLES, kept, strict=True)]


def test_kept_tokens_become_kept_sets_per_packed_sample(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_cli("prime-rl", _dump(tmp_path, _with_kept(KEPT)), out)
    assert result.exit_code == 0, result.output
    rows = read_rows(out).sort("sample_id")
    assert rows["sampling_kept_ids"].to_list() == [[t for k in sets for t in k] for sets in KEPT]
    assert rows["sampling_kept_offsets"].to_list() == [
        [0, 0, 0, 2, 3, 6],
        [0, 0, 0, 2, 2, 3],
        [0, 0, 3, 4],  # the padding segment of the first micro-batch is dropped with its zero counts
    ]


def test_kept_tokens_without_the_sampled_token_are_e221(tmp_path: Path) -> None:
    broken = [KEPT[0], [[], [], [110, 111], [], [112]], KEPT[2]]
    out = tmp_path / "run"
    result = import_cli("prime-rl", _dump(tmp_path, _with_kept(broken)), out)
    assert result.exit_code == 3 and "error[E221]" in result.output and "sample 3:1, pos 4" in result.output
    assert_nothing_written(out)


def test_kept_tokens_counts_not_matching_the_ids_are_e703(tmp_path: Path) -> None:
    root = _dump(tmp_path, _with_kept(KEPT))
    raw = msgspec.msgpack.decode((root / "rollouts" / "step_3" / "rank_0.bin").read_bytes())
    ids, counts = raw[0][-1]
    raw[0][-1] = [ids[:-4], counts]  # one id fewer than the counts add up to
    with pytest.raises(InvalidInputError) as err:
        _read(_rewrite(tmp_path, raw))
    assert err.value.code == "E703" and "kept_tokens" in err.value.message
