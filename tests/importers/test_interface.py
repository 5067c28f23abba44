"""The importer interface: alignment helpers, derived ids, safe loading (hand-computed values)."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import polars as pl
import pytest
import torch

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers import alignment, ids
from pgdiag.importers.base import ImportOptions, load_preset, preset_names
from pgdiag.importers.safe_load import load_pickle, load_pt, numpy_allow_list, record_shim


def _rows(flat):
    out = []
    for r in range(len(flat.offsets) - 1):
        lo, hi = flat.offsets[r], flat.offsets[r + 1]
        vals = flat.values[lo:hi].tolist()
        valid = [True] * (hi - lo) if flat.valid is None else flat.valid[lo:hi].tolist()
        out.append([v if ok else None for v, ok in zip(vals, valid, strict=True)])
    return out


def test_response_aligned_places_at_prompt_length():
    resp = alignment.from_rows([[-0.5, -0.25], [-1.0]])
    placed = alignment.response_aligned(resp, np.array([2, 1]), np.array([5, 3]))
    assert _rows(placed) == [[None, None, -0.5, -0.25, None], [None, -1.0, None]]


def test_response_longer_than_room_is_e703():
    resp = alignment.from_rows([[-0.5, -0.25, -0.1]])
    with pytest.raises(InvalidInputError) as err:
        alignment.response_aligned(resp, np.array([2]), np.array([4]), source="f.pt", field="logprobs")
    assert err.value.code == "E703" and "f.pt, row 0: logprobs" in err.value.message


def test_from_padded_left_and_right():
    block = np.array([[0, 0, 7, 8], [5, 6, 9, 1]])
    left = alignment.from_padded(block, np.array([2, 4]), start=np.array([2, 0]))
    assert _rows(left) == [[7, 8], [5, 6, 9, 1]]


def test_right_aligned_block_skyrl_layout():
    # width A = 3; row 0: T = 4, R = 2 -> tokens 2,3 from columns 1,2; row 1: T = 2, R = 1 -> token 1 from col 2
    block = np.array([[9.0, -0.1, -0.2], [9.0, 9.0, -0.3]], dtype=np.float32)
    placed = alignment.right_aligned_block(block, np.array([2, 1]), np.array([2, 1]), np.array([4, 2]))
    assert _rows(placed) == [
        [None, None, pytest.approx(-0.1), pytest.approx(-0.2)],
        [None, pytest.approx(-0.3)],
    ]


def test_next_token_columns():
    block = np.array([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]], dtype=np.float32)
    placed = alignment.next_token(block, np.array([4, 2]))
    rows = _rows(placed)
    assert rows[0][0] is None and rows[0][1:] == pytest.approx([-0.1, -0.2, -0.3])
    assert rows[1][0] is None and rows[1][1] == pytest.approx(-0.4)


def test_shift_moves_and_refuses_values_moved_out():
    vals = alignment.from_rows([[-0.1, -0.2, 0.0]])
    assert _rows(alignment.shift(vals, np.array([3]), 1))[0][1:] == pytest.approx([-0.1, -0.2])
    short = alignment.from_rows([[-0.1, -0.2]])
    assert _rows(alignment.shift(short, np.array([3]), 1))[0][1:] == pytest.approx([-0.1, -0.2])
    with pytest.raises(InvalidInputError):
        alignment.shift(alignment.from_rows([[-0.1, -0.2, -0.3]]), np.array([3]), 1)


def test_to_series_nulls_and_types():
    flat = alignment.response_aligned(alignment.from_rows([[-0.5]]), np.array([1]), np.array([2]))
    series = alignment.to_series("rollout_logprobs", flat, pl.List(pl.Float32))
    assert series.to_list() == [[None, -0.5]] and series.dtype == pl.List(pl.Float32)


def test_ids():
    assert ids.row_sample_ids(3, 3).to_list() == ["3:0", "3:1", "3:2"]
    assert ids.contiguous_group_ids(2, 5, 2).to_list() == ["c2:0", "c2:0", "c2:1", "c2:1", "c2:2"]
    assert ids.range_group_ids(4, np.array([0, 1, 3])).to_list() == ["c4:0", "c4:1", "c4:1"]
    toks = alignment.from_rows([[1, 2, 3], [1, 2, 4], [1, 5]], dtype=np.int32)
    groups = ids.prompt_group_ids(toks, np.array([2, 2, 1]))
    expected = "p" + hashlib.blake2b(np.array([1, 2], "<i4").tobytes(), digest_size=8).hexdigest()
    assert groups.to_list()[:2] == [expected, expected] and groups[2] != expected
    mask = alignment.from_rows([[0, 0, 1], [0, 0, 0], [1, 1]], dtype=bool)
    assert ids.first_loss_positions(mask).tolist() == [2, 3, 0]


def test_options_check():
    ImportOptions(group_by="contiguous:8").check()
    with pytest.raises(UsageError):
        ImportOptions(group_by="contiguous:x").check()
    with pytest.raises(UsageError):
        load_preset("nope")
    assert preset_names()[0] == "verl" and "canonical" in preset_names()


class _Hostile:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_hostile_pickle_never_runs(tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(UsageError) as err:
        load_pickle(pickle.dumps({"x": _Hostile(str(target))}), numpy_allow_list(), name="dump.pkl")
    assert err.value.code == "E701" and "global io.open" in err.value.message
    assert not target.exists()


def test_hostile_pt_never_runs(tmp_path):
    target = tmp_path / "pwned"
    path = tmp_path / "step_1.pt"
    torch.save({"tensors": {"a": torch.zeros(2)}, "evil": _Hostile(str(target))}, path)
    assert not target.exists()
    with pytest.raises(UsageError) as err:
        load_pt(path, numpy_allow_list())
    assert err.value.code == "E701" and "global io.open" in err.value.message
    assert not target.exists()


def test_pt_numpy_and_record_shims(tmp_path):
    path = tmp_path / "ok.pt"
    torch.save({"t": torch.arange(3), "arr": np.arange(4, dtype=np.int64)}, path)
    loaded = load_pt(path, numpy_allow_list())
    assert loaded.value["t"].tolist() == [0, 1, 2] and loaded.value["arr"].tolist() == [0, 1, 2, 3]
    assert not loaded.unsafe_load
    # a truncated archive is E703
    torn = tmp_path / "torn.pt"
    torn.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(InvalidInputError) as err:
        load_pt(torn, numpy_allow_list())
    assert err.value.code == "E703"


class Ref:
    def __init__(self, name, version):
        self.name, self.version = name, version


Ref.__module__ = "fw.types"


def test_record_shim_reads_state_without_framework(monkeypatch):
    import sys
    import types

    module = types.ModuleType("fw.types")
    module.Ref = Ref
    monkeypatch.setitem(sys.modules, "fw", types.ModuleType("fw"))
    monkeypatch.setitem(sys.modules, "fw.types", module)
    data = pickle.dumps([Ref("lora", 3)])
    monkeypatch.delitem(sys.modules, "fw.types")
    value = load_pickle(data, {"fw.types.Ref": record_shim("fw.types.Ref")}, name="x").value
    assert value[0].name == "lora" and value[0].version == 3 and type(value[0]) is not Ref
