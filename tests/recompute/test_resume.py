"""A recompute killed at any point resumes to the dataset an uninterrupted run writes (docs/recompute.md, Resume).

SIGKILL leaves no lock (the kernel drops it) but may leave a temp file ``.<name>.tmp-<pid>-<random>`` beside a
part or the manifest; the resume removes it. Before, a planted stale temp file survived the resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sample_paths import SAMPLE_DATA
from test_logprobs import StopAfter, read_stream
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.recompute.jobs import recompute_logprobs

ROOT = Path(__file__).resolve().parents[2]
TINY = SAMPLE_DATA / "tiny-qwen"
OPTIONS = ["--dtype", "fp32", "--part-samples", "2", "--batch-tokens", "256", "--device", "cpu"]


def resume_and_compare(run: Path) -> None:
    """Resume tag `rc` with the CLI, then assert it equals an uninterrupted run bit for bit, no temp file left."""
    resumed = CliRunner().invoke(
        build_app(), ["logprobs", str(run), "--model", str(TINY), "--tag", "rc", *OPTIONS]
    )
    assert resumed.exit_code == 0, resumed.output
    fresh = CliRunner().invoke(
        build_app(), ["logprobs", str(run), "--model", str(TINY), "--tag", "fresh", *OPTIONS]
    )
    assert fresh.exit_code == 0, fresh.output
    a, b = read_stream(run / "logprobs" / "rc"), read_stream(run / "logprobs" / "fresh")
    assert a.height == 32 and a["sample_id"].n_unique() == 32  # every sample once
    assert a.select("step", "sample_id", "logprobs", "entropy").equals(
        b.select("step", "sample_id", "logprobs", "entropy")
    )
    assert not [p for p in (run / "logprobs").rglob("*") if ".tmp-" in p.name]


def test_resume_removes_stale_temp_files(run_copy: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        recompute_logprobs(
            run_copy, TINY, tag="rc", dtype="fp32", part_samples=2, batch_tokens=256, device="cpu",
            progress=StopAfter(2),
        )  # fmt: skip
    out_dir = run_copy / "logprobs" / "rc"
    # what a writer killed inside `atomic_write` leaves: a part and a manifest half-written under temp names
    stale = [
        out_dir / "step=0" / ".part-00002.parquet.tmp-999999-deadbeef",
        out_dir / "step=0" / ".part-00009.parquet.tmp-999999-0badf00d",
        out_dir / "._manifest.json.tmp-999999-cafebabe",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"PAR1 half-written")
    resume_and_compare(run_copy)
    assert not any(p.exists() for p in stale)


def test_sigkill_then_resume_gives_every_sample_once_bit_identical(run_copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "pgdiag",
        "logprobs",
        str(run_copy),
        "--model",
        str(TINY),
        "--tag",
        "rc",
        "-q",
    ]
    process = subprocess.Popen(
        [*command, *OPTIONS], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    out_dir = run_copy / "logprobs" / "rc"
    deadline = time.monotonic() + 240
    while len(list(out_dir.glob("step=*/part-*.parquet"))) < 3 and process.poll() is None:
        assert time.monotonic() < deadline, "the recompute wrote no part in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read() if process.stderr else ""
    written = len(list(out_dir.glob("step=*/part-*.parquet")))
    assert 3 <= written < 16  # killed mid-run: 32 samples are 16 parts
    resume_and_compare(run_copy)
