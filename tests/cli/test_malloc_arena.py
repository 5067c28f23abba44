"""`pgdiag.cli.one_malloc_arena`: the CLI limits glibc's malloc to one arena (its worker threads' freed memory is
reused by the next chunk instead of staying in arenas of their own), unless the environment sets the limit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pgdiag.cli import one_malloc_arena

REPO = Path(__file__).resolve().parents[2]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# three threads allocate and free numpy arrays, then glibc's malloc_stats prints one "Arena N:" block per arena
PROBE = """
import ctypes, os, sys, threading
import numpy as np
from pgdiag.cli import one_malloc_arena
print(one_malloc_arena(os.environ) if sys.argv[1] == "call" else None)
def work():
    small, large = np.ones(1_000), np.ones(1_000_000)
    del small, large
threads = [threading.Thread(target=work) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
ctypes.CDLL(None).malloc_stats()
"""


def _arenas(mode: str, **extra: str) -> tuple[str, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    for name in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES"):
        if name not in extra:
            env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    arenas = sum(line.startswith("Arena ") for line in done.stderr.splitlines())
    return done.stdout.strip(), arenas


@pytest.mark.skipif(not GLIBC, reason="malloc arenas are glibc's")
def test_threads_share_one_arena_after_the_call() -> None:
    called, arenas = _arenas("none")
    assert called == "None" and arenas >= 2  # the threads took arenas of their own (reused as threads end)
    assert _arenas("call") == ("True", 1)


@pytest.mark.skipif(not GLIBC, reason="malloc arenas are glibc's")
def test_a_limit_the_user_set_is_kept() -> None:
    for extra in ({"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}):
        called, arenas = _arenas("call", **extra)
        assert called == "False" and 2 <= arenas <= 4


def test_nothing_outside_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert one_malloc_arena({}) is False
