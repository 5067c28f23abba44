"""Writes the summary frames of `metrics` and `compare` on every run of `sample_data/` (the refactor baseline).

`python tests/baseline/make_baseline.py` saves them as Parquet beside this file; `test_baseline.py` recomputes
them with the current code and asserts equality. A change that should move no number must leave them equal; a
change that fixes a number regenerates them in the same commit and says which rows moved and why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: sample_paths, when run as a script
from sample_paths import SAMPLE_DATA

import pgdiag

ROOT = SAMPLE_DATA
HERE = Path(__file__).resolve().parent
RUNS = ("run_a", "run_b", "synthetic_a", "synthetic_b")


def cases() -> dict[str, Callable[[], pl.DataFrame]]:
    """Name -> a function returning one summary frame."""

    def run(name: str):
        return pgdiag.read_run(ROOT / name)

    out: dict[str, Callable[[], pl.DataFrame]] = {}
    for name in RUNS:
        out[f"metrics-{name}"] = lambda n=name: pgdiag.compute_metrics(run(n)).summary
        out[f"metrics-constant-verl-{name}"] = lambda n=name: (
            pgdiag.compute_metrics(run(n), aggregation="constant", divisor=40960, key_style="verl").summary
        )
    for a, b in (("run_a", "run_b"), ("synthetic_a", "synthetic_b")):
        out[f"compare-{a}-{b}"] = lambda a=a, b=b: pgdiag.compare_runs(run(a), run(b)).report.summary
    out["compare-run_a-old-new"] = lambda: (
        pgdiag.compare_runs(run("run_a"), stream_a="old", stream_b="new").report.summary
    )
    return out


if __name__ == "__main__":
    for name, make in cases().items():
        make().write_parquet(HERE / f"{name}.parquet")
        print("wrote", name)
