"""Helpers shared by the importer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def assert_nothing_written(out: Path) -> None:
    """OUT does not exist and no temp directory was left beside it."""
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == []


@pytest.fixture
def repo_root() -> Path:
    return REPO
