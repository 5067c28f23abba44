"""`pgdiag.cli.exit_now`: the CLI's exit skips the interpreter's teardown but keeps what it owes: the exit status,
stdout and stderr (Python's buffers and the C library's), the ``atexit`` handlers, and the wait for non-daemon
threads (then it takes the ordinary exit). Each case is a fresh interpreter whose stdout is a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import atexit, ctypes, sys, threading, time
from pathlib import Path
from pgdiag.cli import exit_now

class Teardown:  # a module global whose __del__ runs only when the interpreter frees the modules
    def __del__(self):
        sys.stderr.write("teardown ran\\n")

kept = Teardown()
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("partial line without newline")  # held in Python's buffer (stdout is a pipe)
ctypes.CDLL(None).printf(b"from C stdio\\n")  # held in the C library's buffer
"""


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + body, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_fast_exit_keeps_status_output_and_atexit_and_skips_teardown(tmp_path: Path) -> None:
    done = _run("exit_now(3)\n", tmp_path)
    assert done.returncode == 3, done.stderr
    assert "partial line without newline" in done.stdout and "from C stdio" in done.stdout
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "teardown ran" not in done.stderr  # the fast path was taken: no module was freed


def test_a_running_thread_is_waited_for_by_the_ordinary_exit(tmp_path: Path) -> None:
    body = """
def late():
    time.sleep(0.5)
    (out / "thread").write_text("finished")
threading.Thread(target=late).start()
exit_now(0)
"""
    done = _run(body, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "thread").read_text() == "finished" and (tmp_path / "atexit").read_text() == "ran"
    assert "partial line without newline" in done.stdout and "from C stdio" in done.stdout
    assert "teardown ran" in done.stderr  # the ordinary exit, teardown included


def test_the_cli_exits_with_its_documented_code(tmp_path: Path) -> None:
    """`python -m pgdiag` through `main`: a usage error's one line and exit 2, a success's output and 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run(
        [sys.executable, "-m", "pgdiag", "check", str(tmp_path / "missing"), "--no-such-option"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "error[E515]" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "pgdiag", "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0 and "logprobs" in ok.stdout, ok.stderr
