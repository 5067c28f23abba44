"""Kept-set columns (docs/schema.md, "Kept sets"): written by write_run, read back, validated (E220-E223), and
the zero-fill rules quiet where a renormalised log-prob is 0.0 over a one-token set."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

import pgdiag
from pgdiag.checks.run import check_run
from pgdiag.data.kept import (
    KEPT_BITMASK,
    KEPT_BITMASK_POSITIONS,
    bitmask_ids,
    kept_from_series,
    pack_bitmask,
    position_sets,
    position_sizes,
)
from pgdiag.data.load import read_token_batch
from pgdiag.data.runs import read_run
from pgdiag.errors import InvalidInputError


def _frame(**changes) -> pl.DataFrame:
    """Two samples of T = 4 (prompt 2): the loss positions 2 and 3 hold kept sets; positions 0-1 are empty."""
    rows = {
        "step": [0, 0],
        "sample_id": ["a", "b"],
        "input_ids": [[1, 2, 5, 7], [1, 3, 4, 9]],
        "loss_mask": [[False, False, True, True], [False, False, True, True]],
        "prompt_len": [2, 2],
        # sample a: position 2 keeps {5, 6}, position 3 keeps {7} (one token: log-prob 0.0 is right)
        # sample b: position 2 keeps {4, 8, 2}, position 3 keeps {9, 1}
        "sampling_kept_ids": [[5, 6, 7], [4, 8, 2, 9, 1]],
        "sampling_kept_offsets": [[0, 0, 0, 2, 3], [0, 0, 0, 3, 5]],
        "rollout_logprobs": [[None, None, -0.3, 0.0], [None, None, -1.2, -0.1]],
        "old_logprobs": [[None, None, -0.5, -1.5], [None, None, -1.3, -0.2]],
    }
    rows.update(changes)
    return pl.DataFrame(rows)


def _write(tmp_path: Path, frame: pl.DataFrame) -> Path:
    out = tmp_path / "run"
    pgdiag.write_run(frame, out, sampling={"engine": "vllm", "logprobs_mode": "processed", "top_p": 0.9})
    return out


def test_written_read_back_and_sizes(tmp_path: Path) -> None:
    out = _write(tmp_path, _frame())
    part = next((out / "rollouts").rglob("*.parquet"))
    schema = pq.read_schema(part)
    assert str(schema.field("sampling_kept_ids").type) == "list<element: int32>"
    assert str(schema.field("sampling_kept_offsets").type) == "list<element: int32>"
    result = check_run(read_run(out))
    assert result.n_errors == 0, result.issues
    # E206 and W216 stay quiet: the single 0.0 sits where the set holds one token
    assert not {"E206", "W216"} & set(result.issues["code"].to_list()), result.issues
    table = pq.read_table(part).sort_by("sample_id")  # written sorted by group: a, b again
    kept = kept_from_series(
        {c: pl.Series(c, table.column(c)) for c in ("sampling_kept_ids", "sampling_kept_offsets")}
    )
    assert kept is not None
    seq_offsets = np.array([0, 4, 8])
    assert position_sizes(kept, seq_offsets).tolist() == [0, 0, 2, 1, 0, 0, 3, 2]
    sets = position_sets(kept, seq_offsets, np.array([3, 6, 0]))
    assert sets.offsets.tolist() == [0, 1, 4, 4] and sets.ids.tolist() == [7, 4, 8, 2]
    assert sets.logprobs is None


def test_zero_without_a_singleton_set_still_warns(tmp_path: Path) -> None:
    # sample b, pos 2 keeps three tokens: its 0.0 counts (one of the 3 counted loss values: > 1 %)
    frame = _frame(rollout_logprobs=[[None, None, -0.3, 0.0], [None, None, 0.0, -0.1]])
    with pytest.raises(InvalidInputError) as raised:
        _write(tmp_path, frame)
    assert raised.value.code == "E206" and "sample b, pos 2" in raised.value.message


def test_zero_over_a_singleton_set_is_not_a_fill(tmp_path: Path) -> None:
    # every loss value of sample a is 0.0 (an all-zero sample is E206 without K); both sets hold one token
    frame = _frame(
        sampling_kept_ids=[[5, 7], [4, 8, 2, 9, 1]],
        sampling_kept_offsets=[[0, 0, 0, 1, 2], [0, 0, 0, 3, 5]],
        rollout_logprobs=[[None, None, 0.0, 0.0], [None, None, -1.2, -0.1]],
    )
    out = _write(tmp_path, frame)
    result = check_run(read_run(out))
    assert not {"E206", "W216"} & set(result.issues["code"].to_list()), result.issues
    without_k = frame.drop("sampling_kept_ids", "sampling_kept_offsets")
    with pytest.raises(InvalidInputError) as raised:
        pgdiag.write_run(without_k, tmp_path / "plain")
    assert raised.value.code == "E206"


@pytest.mark.parametrize(
    ("changes", "code", "needle"),
    [
        ({"sampling_kept_offsets": [[0, 0, 2, 0, 3], [0, 0, 0, 3, 5]]}, "E220", "sample a"),
        ({"sampling_kept_offsets": [[0, 0, 2, 3], [0, 0, 0, 3, 5]]}, "E220", "4 offsets for 4 tokens"),
        ({"sampling_kept_ids": [[5, 6, 8], [4, 8, 2, 9, 1]]}, "E221", "sample a, pos 3, token 7"),
        ({"sampling_kept_ids": [[5, 6, 7], [4, 8, 4, 9, 1]]}, "E223", "sample b, pos 2"),
        ({"sampling_kept_ids": [[5, -6, 7], [4, 8, 2, 9, 1]]}, "E222", "sample a, pos 2, id -6"),
    ],
)
def test_broken_kept_sets_are_refused_and_write_nothing(
    tmp_path: Path, changes: dict, code: str, needle: str
) -> None:
    with pytest.raises(InvalidInputError) as raised:
        _write(tmp_path, _frame(**changes))
    assert raised.value.code == code
    assert needle in raised.value.message, raised.value.message
    assert not (tmp_path / "run").exists()


def test_kept_logprobs_must_align_with_the_ids(tmp_path: Path) -> None:
    frame = _frame(sampling_kept_logprobs=[[-0.3, -1.4], [-1.2, -2.0, -3.0, -0.1, -2.4]])
    with pytest.raises(InvalidInputError) as raised:
        _write(tmp_path, frame)
    assert raised.value.code == "E201" and "sampling_kept_logprobs" in raised.value.message


def test_check_reports_the_code_of_a_file_written_by_hand(tmp_path: Path) -> None:
    out = _write(tmp_path, _frame())
    part = next((out / "rollouts").rglob("*.parquet"))
    table = pq.read_table(part)
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    broken = {"a": [5, 6, 8], "b": [4, 8, 2, 9, 1]}  # sample a, pos 3 samples 7, now outside its set
    bad = frame.with_columns(
        pl.Series("sampling_kept_ids", [broken[s] for s in frame["sample_id"]], dtype=pl.List(pl.Int32))
    )
    pq.write_table(bad.to_arrow().replace_schema_metadata(table.schema.metadata), part)
    result = check_run(read_run(out))
    issue = result.issues.filter(pl.col("code") == "E221").to_dicts()
    assert len(issue) == 1 and "step 0, sample a, pos 3" in issue[0]["message"]
    with pytest.raises(InvalidInputError) as raised:
        read_token_batch(read_run(out), streams=["rollout", "old"])
    assert raised.value.code == "E221"


def test_bitmask_form(tmp_path: Path) -> None:
    vocab = 20
    mask_b2 = pack_bitmask([4, 8, 2], vocab)
    assert bitmask_ids(mask_b2).tolist() == [2, 4, 8]
    frame = _frame(
        sampling_kept_ids=[[5, 6, 7], [9, 1]],
        sampling_kept_offsets=[[0, 0, 0, 2, 3], [0, 0, 0, 0, 2]],
    ).with_columns(
        pl.Series(KEPT_BITMASK_POSITIONS, [[], [2]], dtype=pl.List(pl.Int32)),
        pl.Series(KEPT_BITMASK, [[], mask_b2.tolist()], dtype=pl.List(pl.UInt8)),
    )
    out = _write(tmp_path, frame)
    assert check_run(read_run(out)).n_errors == 0
    part = next((out / "rollouts").rglob("*.parquet"))
    table = pq.read_table(part).sort_by("sample_id")
    kept = kept_from_series(
        {c: pl.Series(c, table.column(c)) for c in table.column_names if c.startswith("sampling_kept")}
    )
    assert kept is not None
    seq_offsets = np.array([0, 4, 8])
    assert position_sizes(kept, seq_offsets).tolist() == [0, 0, 2, 1, 0, 0, 3, 2]
    sets = position_sets(kept, seq_offsets, np.array([6, 7]))
    assert sets.ids.tolist() == [2, 4, 8, 9, 1] and sets.offsets.tolist() == [0, 3, 5]
    # the sampled token 4 of sample b, pos 2 must be in the bitmask
    bad = frame.with_columns(
        pl.Series(KEPT_BITMASK, [[], pack_bitmask([8, 2], vocab).tolist()], dtype=pl.List(pl.UInt8))
    )
    with pytest.raises(InvalidInputError) as raised:
        _write(tmp_path / "bad", bad)
    assert raised.value.code == "E221" and "sample b, pos 2" in raised.value.message
    assert math.isfinite(0.0)


def test_bitmask_sets_equal_the_per_mask_loop() -> None:
    """The vectorised expansion against `bitmask_ids` mask by mask (the former loop), edge masks included."""
    from pgdiag.data.kept import bitmask_sets, bitmask_sizes

    rng = np.random.default_rng(4)
    vocab = 1003  # not a multiple of 8: the last byte is partial
    masks = [pack_bitmask(rng.choice(vocab, size, replace=False), vocab) for size in (1, 7, 500, 1003, 64)]
    masks += [pack_bitmask([], vocab), pack_bitmask([0, 1002], vocab)]
    bits = np.stack(masks)
    ids, offsets = bitmask_sets(bits)
    loop = [bitmask_ids(m) for m in masks]
    assert offsets.tolist() == [0, *np.cumsum([x.size for x in loop]).tolist()]
    assert ids.tolist() == np.concatenate(loop).tolist()
    assert bitmask_sizes(bits).tolist() == [1, 7, 500, 1003, 64, 0, 2]
    assert ids[offsets[6] : offsets[7]].tolist() == [0, 1002]


def _columns(ids, offsets, positions, bitmasks) -> object:
    series = {
        "sampling_kept_ids": pl.Series(ids, dtype=pl.List(pl.Int32)),
        "sampling_kept_offsets": pl.Series(offsets, dtype=pl.List(pl.Int32)),
        KEPT_BITMASK_POSITIONS: pl.Series(positions, dtype=pl.List(pl.Int32)),
        KEPT_BITMASK: pl.Series(bitmasks, dtype=pl.List(pl.UInt8)),
    }
    return kept_from_series({k: pl.Series(k, v) for k, v in series.items()})


def test_position_sets_with_bitmasks_equal_a_loop_by_position() -> None:
    """Three rows (T = 3, 4, 2), ids and bitmasks mixed, queries out of order and repeated: the sets equal a
    loop over the positions by hand; packed (`expand_bitmasks=False`) they give the head the same bitmask words
    as the expanded ids."""
    import torch

    from pgdiag.kernels.kept_set import KeptSet, kept_words

    vocab = 30
    sets = {  # (row, pos) -> kept ids; bitmask positions marked by their row
        (0, 0): [3],
        (0, 1): [1, 2, 29],
        (0, 2): [],
        (1, 0): [],
        (1, 1): [5, 6],
        (1, 2): [0, 8, 9, 10, 11, 12],
        (1, 3): [7],
        (2, 0): [4, 20],
        (2, 1): [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 25],
    }
    as_bitmask = {(0, 1), (1, 2), (2, 1)}
    lengths = [3, 4, 2]
    ids, offsets, positions, bitmasks = [], [], [], []
    for row, length in enumerate(lengths):
        row_ids, row_offsets, row_pos, row_bits = [], [0], [], []
        for pos in range(length):
            if (row, pos) in as_bitmask:
                row_pos.append(pos)
                row_bits.extend(pack_bitmask(sets[row, pos], vocab).tolist())
            else:
                row_ids.extend(sets[row, pos])
            row_offsets.append(len(row_ids))
        ids.append(row_ids)
        offsets.append(row_offsets)
        positions.append(row_pos)
        bitmasks.append(row_bits)
    kept = _columns(ids, offsets, positions, bitmasks)
    seq_offsets = np.array([0, 3, 7, 9])
    queries = np.array([8, 1, 5, 0, 2, 5, 7, 3, 6])
    flat_to = {int(seq_offsets[r]) + p: (r, p) for r in range(3) for p in range(lengths[r])}
    want = [sorted(sets[flat_to[int(q)]]) for q in queries]
    got = position_sets(kept, seq_offsets, queries)
    assert [got.ids[got.offsets[i] : got.offsets[i + 1]].tolist() for i in range(queries.size)] == want
    assert position_sizes(kept, seq_offsets).tolist() == [len(sets[flat_to[t]]) for t in range(9)]
    packed = position_sets(kept, seq_offsets, queries, expand_bitmasks=False)
    assert packed.bitmask_queries is not None and packed.bitmask_queries.tolist() == [0, 1, 2, 5]
    kept_set = KeptSet(
        torch.from_numpy(packed.ids),
        torch.from_numpy(packed.offsets),
        bitmask_tokens=torch.from_numpy(packed.bitmask_queries),
        bitmasks=torch.from_numpy(packed.bitmasks),
    )
    expanded = KeptSet(torch.from_numpy(got.ids), torch.from_numpy(got.offsets))
    # the words the head reads (one shard from id 7, mid-word): the packed form and the expanded ids agree
    words = kept_words(kept_set, 0, queries.size, vocab_start=7, vocab_local=vocab - 7, impl="torch")
    assert torch.equal(
        words, kept_words(expanded, 0, queries.size, vocab_start=7, vocab_local=vocab - 7, impl="torch")
    )
    assert torch.equal(kept_set.recorded(), torch.tensor([len(one) > 0 for one in want]))
