"""Packing: batch plans cover every sample once within the budget; the shift puts hidden t-1 on token t."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgdiag.recompute.packing import pack_samples, plan_batches, plan_micro_batches


def test_plan_first_fit_decreasing_worked_example() -> None:
    # lengths 6,5,4,3,2 (indices 4,0,2,1,3) into 8: 6->b0, 5->b1, 4->b2, 3->b1 (5+3), 2->b0 (6+2)
    batches = plan_batches([5, 3, 4, 2, 6], 8)
    assert [b.tolist() for b in batches] == [[4, 3], [0, 1], [2]]


def test_plan_source_order_worked_example() -> None:
    batches = plan_batches([5, 3, 4, 2, 6], 8, order="source")
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4]]


def test_plan_oversized_sample_gets_its_own_batch() -> None:
    batches = plan_batches([3, 20, 4], 8)
    assert [b.tolist() for b in batches] == [[1], [2, 0]]


def test_plan_micro_batches_fixed_sample_count() -> None:
    assert [b.tolist() for b in plan_micro_batches([5, 3, 4, 2, 6], 2)] == [[4, 0], [2, 1], [3]]
    assert [b.tolist() for b in plan_micro_batches([5, 3, 4, 2, 6], 2, order="source")] == [
        [0, 1],
        [2, 3],
        [4],
    ]
    with pytest.raises(ValueError, match="micro_batch"):
        plan_micro_batches([1], 0)


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_tokens"):
        plan_batches([1, 2], 0)
    with pytest.raises(ValueError, match="order"):
        plan_batches([1, 2], 4, order="random")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=0, max_size=40),
    budget=st.integers(1, 120),
    order=st.sampled_from(["length", "source"]),
)
def test_plan_covers_every_sample_once_within_budget(lengths: list[int], budget: int, order: str) -> None:
    batches = plan_batches(lengths, budget, order=order)  # type: ignore[arg-type]
    flat = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    lens = np.asarray(lengths, dtype=np.int64)
    for b in batches:
        assert b.size >= 1
        assert lens[b].sum() <= budget or b.size == 1


def test_pack_worked_example() -> None:
    ids = [np.array([10, 11, 12, 13]), np.array([20, 21, 22])]
    masks = [np.array([False, False, True, True]), np.array([False, True, False])]
    packed = pack_samples(ids, masks, np.array([0, 1]))
    assert packed.input_ids.tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert packed.cu_seqlens.tolist() == [0, 4, 7]
    assert packed.hidden_index.tolist() == [1, 2, 4]
    assert packed.targets.tolist() == [12, 13, 21]
    assert packed.target_sample.tolist() == [0, 0, 1]
    assert packed.target_pos.tolist() == [2, 3, 1]
    assert (packed.n_tokens, packed.n_targets) == (7, 3)


def test_pack_reordered_subset_keeps_caller_indices() -> None:
    ids = [np.array([1, 2]), np.array([3, 4, 5]), np.array([6, 7])]
    masks = [np.array([False, True]), np.array([False, False, True]), np.array([False, True])]
    packed = pack_samples(ids, masks, np.array([2, 0]))
    assert packed.input_ids.tolist() == [6, 7, 1, 2]
    assert packed.targets.tolist() == [7, 2]
    assert packed.target_sample.tolist() == [2, 0]
    assert packed.hidden_index.tolist() == [0, 2]


def test_pack_shift_identity_on_random_samples() -> None:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, size=n) for n in rng.integers(2, 30, size=12)]
    masks = []
    for a in ids:
        m = rng.random(a.shape[0]) < 0.5
        m[0] = False
        masks.append(m)
    packed = pack_samples(ids, masks, np.arange(12))
    flat = packed.input_ids.numpy()
    for k in range(packed.n_targets):
        s, t = int(packed.target_sample[k]), int(packed.target_pos[k])
        assert masks[s][t]
        assert packed.targets[k] == ids[s][t]
        # the hidden row predicting token t sits on token t-1 of the same sample
        assert flat[packed.hidden_index[k]] == ids[s][t - 1]
        assert packed.position_ids[packed.hidden_index[k]] == t - 1
    assert packed.n_targets == sum(int(m.sum()) for m in masks)


def test_pack_rejects_loss_at_position_zero() -> None:
    with pytest.raises(ValueError, match="position 0"):
        pack_samples([np.array([1, 2])], [np.array([True, False])], np.array([0]))
