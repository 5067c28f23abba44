"""Shared fixtures for the data-layer tests: a small valid row list and a file written from it.

`tests/rollout_factory.py` holds the row list and the file writers (importable by any test module, as
``from rollout_factory import ...``); these fixtures wrap it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_factory import valid_rows, write_rollouts_file


@pytest.fixture
def rollout_rows() -> list[dict[str, Any]]:
    return valid_rows()


@pytest.fixture
def valid_rollouts_file(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> Path:
    return write_rollouts_file(tmp_path / "valid.parquet", rollout_rows)
