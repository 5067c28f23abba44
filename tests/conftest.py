"""Shared fixtures for the data-layer tests: a small valid row list and a file written from it.

`tests/rollout_factory.py` holds the row list and the file writers (importable by any test module, as
``from rollout_factory import ...``); these fixtures wrap it. The factory is imported inside the fixtures so
that GPU-only test runs on machines without polars can still load this conftest.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def rollout_rows() -> list[dict[str, Any]]:
    from rollout_factory import valid_rows

    return valid_rows()


@pytest.fixture
def valid_rollouts_file(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> Path:
    from rollout_factory import write_rollouts_file

    return write_rollouts_file(tmp_path / "valid.parquet", rollout_rows)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", default=False, help="run the fuzz suite (tests/fuzz) at its large size"
    )


@pytest.fixture
def fuzz_examples(request: pytest.FixtureRequest) -> int:
    """Hypothesis examples per fuzz test: small in CI, large under --slow (docs/reliability.md)."""
    return 400 if request.config.getoption("--slow") else 4
