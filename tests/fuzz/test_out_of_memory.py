"""Running out of memory is one ``error[E518]`` line (exit 2), not an internal error (docs/reliability.md).

The real thing: a `pgdiag metrics` process whose address space is capped (``RLIMIT_AS``) a little above what it
used on the sample run, given a run of 1M response tokens that needs more. Python's `MemoryError`, numpy's
`_ArrayMemoryError` and pyarrow's `ArrowMemoryError` all end in E518; a failed allocation inside polars' native
code aborts the process (exit 134, polars' own message) before Python sees it, which no handler can catch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from clean_error import error_code, run_cli
from sample_paths import SAMPLE_DATA

from pgdiag.data.writing import source_meta, stream_meta, write_rollouts

SAMPLE = SAMPLE_DATA
ROOT = Path(__file__).resolve().parents[2]

CAPPED_METRICS = """
import resource, sys
from pgdiag.cli import run
assert run(["metrics", sys.argv[1], "-q"]) == 0  # every module imported, polars' threads started
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmPeak"))
limit = peak + int(sys.argv[3]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(run(["metrics", sys.argv[2], "--new", "old", "--old", "rollout"]))
"""


def _big_run(path: Path, n_rows: int = 100, length: int = 10_000) -> Path:
    """Two steps of `n_rows` samples of `length` tokens (1M response tokens by default)."""
    rng = np.random.default_rng(0)
    offsets = pa.array(np.arange(n_rows + 1, dtype=np.int32) * length)

    def lists(values: np.ndarray) -> pl.Series:
        return pl.from_arrow(pa.ListArray.from_arrays(offsets, pa.array(values.ravel())))

    mask = np.ones((n_rows, length), dtype=bool)
    mask[:, 0] = False
    old = -rng.random((n_rows, length), dtype=np.float32)
    frame = pl.DataFrame(
        {
            "step": np.repeat(np.arange(2), n_rows // 2),
            "sample_id": [f"s{i}" for i in range(n_rows)],
            "group_id": [f"g{i // 4}" for i in range(n_rows)],
            "prompt_len": np.ones(n_rows, dtype=np.int32),
            "input_ids": lists(rng.integers(0, 1000, size=(n_rows, length), dtype=np.int32)),
            "loss_mask": lists(mask),
            "old_logprobs": lists(old),
            "rollout_logprobs": lists(old - np.float32(0.01)),
            "reward": np.ones(n_rows, dtype=np.float32),
        }
    )
    streams = {"old": stream_meta("old"), "rollout": stream_meta("rollout")}
    return write_rollouts(frame, path, label="big", source=source_meta("tests"), streams_meta=streams)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmPeak from /proc (Linux)")
def test_capped_address_space_is_e518(tmp_path: Path) -> None:
    run = _big_run(tmp_path / "big")
    outcomes = []
    # between what polars needs to read the run and what the metrics need; virtual reservations (thread arenas)
    # move the window a little from run to run, so a few caps are tried until one lands in numpy
    for headroom_mib in (48, 64, 80, 96, 112, 128):
        done = subprocess.run(
            [sys.executable, "-c", CAPPED_METRICS, str(SAMPLE / "run_a"), str(run), str(headroom_mib)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
        )
        output = done.stdout + done.stderr
        assert "Traceback" not in output and "internal error" not in output, output
        if done.returncode in (134, -6):  # polars' own allocation failed first: its abort (SIGABRT), not ours
            assert "memory allocation of" in output, output
        elif done.returncode != 0:
            lines = [line for line in output.splitlines() if line.strip()]
            assert done.returncode == 2 and lines[0].startswith("error[E518] out of memory while running"), (
                output
            )
            assert lines[1].startswith("hint: read fewer steps with --steps"), output
        outcomes.append(done.returncode)
        if done.returncode == 2:
            break
    assert 2 in outcomes, outcomes  # the cap was reached inside numpy at least once


@pytest.mark.parametrize(
    "failure",
    [
        lambda: np.empty(2**44),  # numpy's _ArrayMemoryError (16 TiB)
        lambda: (_ for _ in ()).throw(MemoryError()),
        lambda: (_ for _ in ()).throw(pa.ArrowMemoryError("malloc of size 64 failed")),
    ],
)
@pytest.mark.parametrize("command", ["check", "metrics", "compare", "report"])
def test_memory_error_anywhere_is_e518(monkeypatch, tmp_path: Path, command: str, failure) -> None:
    import pgdiag.data.runs
    import pgdiag.report.report

    def out_of_memory(*args, **kwargs):
        failure()
        raise AssertionError("the allocation did not fail")

    monkeypatch.setattr(pgdiag.data.runs, "read_run", out_of_memory)
    monkeypatch.setattr(pgdiag.report.report, "load_report", out_of_memory)
    args = {
        "check": ["check", SAMPLE / "run_a"],
        "metrics": ["metrics", SAMPLE / "run_a"],
        "compare": ["compare", SAMPLE / "run_a", SAMPLE / "run_b"],
        "report": ["report", tmp_path / "r.parquet"],
    }[command]
    result = run_cli(args)
    assert error_code(result) == "E518", result.output
    assert f"out of memory while running pgdiag {command}" in result.output
