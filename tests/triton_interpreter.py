"""Run a file of Triton kernel cases in a child pytest with the Triton interpreter on (TRITON_INTERPRET=1): Triton
reads the variable when a kernel is defined, so the cases cannot share the parent's process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(cases: Path) -> None:
    """Assert that every case of `cases` passes under the interpreter (its output tail in the message if not)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
