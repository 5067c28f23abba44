"""Fixtures of the recompute tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sample_paths import SAMPLE_DATA


@pytest.fixture
def run_copy(tmp_path: Path) -> Path:
    """Step 0 of the sample run (32 samples), copied without its recomputed streams (test_refusals copies every
    step: its own `run_copy` overrides this one)."""
    run = tmp_path / "run_a"
    shutil.copytree(SAMPLE_DATA / "run_a", run, ignore=shutil.ignore_patterns("logprobs", "step=[123]"))
    return run
