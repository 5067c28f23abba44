"""The import writer's part files, written on a background thread while the next step is read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from pgdiag.errors import InvalidInputError
from pgdiag.importers import writer
from pgdiag.importers.base import ImportedStep, ImportOptions
from tests.importers.conftest import assert_nothing_written

IDS = [[5, 6, 7, 8], [5, 6, 9]]
MASK = [[False, False, True, True], [False, True, True]]
LOGPROBS = [[0.0, 0.0, -0.5, -0.25], [0.0, -1.0, -0.125]]


def _step(step: int) -> ImportedStep:
    rows = pl.DataFrame(
        {
            "input_ids": IDS,
            "loss_mask": MASK,
            "rollout_logprobs": [[v - step for v in row] for row in LOGPROBS],
        },
        schema={
            "input_ids": pl.List(pl.Int64),
            "loss_mask": pl.List(pl.Boolean),
            "rollout_logprobs": pl.List(pl.Float32),
        },
    )
    return ImportedStep(step=step, rows=rows, src_files=(f"step{step}.pt",), framework="slime")


def _steps(n: int, *, bad: int | None = None) -> Iterator[ImportedStep]:
    for step in range(1, n + 1):
        if step == bad:
            raise InvalidInputError("E703", f"step{step}.pt: samples: expected a list")
        yield _step(step)


def test_every_step_is_written_in_order(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = writer.write_steps(_steps(3), out, options=ImportOptions(), preset="slime")
    assert [s.step for s in result.steps] == [1, 2, 3]
    parts = sorted((out / "rollouts").glob("step=*/part-00000.parquet"))
    assert [p.parent.name for p in parts] == ["step=1", "step=2", "step=3"]
    rows = pl.concat([pl.read_parquet(p) for p in parts])
    assert rows["step"].to_list() == [1, 1, 2, 2, 3, 3]
    # off the mask null, on it the value as given
    expected = [
        [v - step if m else None for v, m in zip(lp, mk, strict=True)]
        for step in (1, 2, 3)
        for lp, mk in zip(LOGPROBS, MASK, strict=True)
    ]
    assert rows["rollout_logprobs"].to_list() == expected


def test_a_failed_part_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = writer.write_parquet

    def failing(table, path, **kwargs):  # type: ignore[no-untyped-def]
        if "step=2" in str(path):
            raise OSError(28, "No space left on device")
        return real(table, path, **kwargs)

    monkeypatch.setattr(writer, "write_parquet", failing)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        writer.write_steps(_steps(3), out, options=ImportOptions(), preset="slime")
    assert_nothing_written(out)


def test_an_error_while_a_part_is_being_written_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(InvalidInputError, match="E703"):
        writer.write_steps(_steps(3, bad=3), out, options=ImportOptions(), preset="slime")
    assert_nothing_written(out)
