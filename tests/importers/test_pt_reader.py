"""The C-unpickler .pt reader: the same values as torch.load, and nothing outside the allow-list runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers.pt_reader import load_pt_lists
from pgdiag.importers.safe_load import numpy_allow_list
from tests.importers.slime_dumps import Hostile


def test_same_values_as_torch_load(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    payload = {
        "view": base[1:, ::2],  # a strided view sharing the storage below
        "base": base,
        "bf16": torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "ids": torch.tensor([1, 2**40, -3]),
        "array": np.array([[1.5, 2.5]], dtype=np.float32),
        "lists": [[1, 2, 3], [-0.5, 0.25], None, "text", {"k": (1, 2)}],
    }
    path = tmp_path / "x.pt"
    torch.save(payload, path)
    expected = torch.load(path, weights_only=False)
    got = load_pt_lists(path, numpy_allow_list()).value
    for key in ("view", "base", "bf16", "bool", "ids"):
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key
    assert got["view"].data_ptr() != 0 and got["view"].stride() == expected["view"].stride()
    assert np.array_equal(got["array"], expected["array"]) and got["lists"] == expected["lists"]


def test_global_outside_the_allow_list_is_e701(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "x.pt"
    torch.save({"samples": [{"x": Hostile(marker)}]}, path)
    with pytest.raises(UsageError) as err:
        load_pt_lists(path, numpy_allow_list())
    assert err.value.code == "E701" and "io.open" in err.value.message
    assert not marker.exists()


def test_truncated_archive_is_e703(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:-300])
    with pytest.raises(InvalidInputError) as err:
        load_pt_lists(path)
    assert err.value.code == "E703"
