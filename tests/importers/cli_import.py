"""Run ``pgdiag import`` in-process and read what it wrote, for the preset tests."""

from __future__ import annotations

from pathlib import Path

import polars as pl
from typer.testing import CliRunner, Result

from pgdiag.cli.app import build_app


def import_cli(preset: str, src: Path, out: Path, *extra: str) -> Result:
    """``pgdiag import --preset PRESET SRC OUT [extra]``; the result carries exit code, stdout and stderr."""
    args = ["import", "--preset", preset, str(src), str(out), *extra]
    return CliRunner().invoke(build_app(), args, catch_exceptions=False)


def read_rows(out: Path) -> pl.DataFrame:
    """Every imported row, in (step, sample_id) order."""
    files = sorted(out.glob("rollouts/**/*.parquet"))
    return pl.concat([pl.read_parquet(f, hive_partitioning=False) for f in files]).sort("step", "sample_id")
