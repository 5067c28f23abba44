"""`pgdiag.model.warmup`: Triton's installation key is computed once, on a thread, and the first kernel's
own call then finds it in Triton's cache (the real ``triton_key``, in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_thread_computes_the_key_triton_then_finds() -> None:
    pytest.importorskip("triton")
    code = """
import threading
from triton.runtime.cache import triton_key
from pgdiag.model.warmup import triton_key_thread
assert triton_key.cache_info().currsize == 0
thread = triton_key_thread()
assert triton_key_thread() is thread and thread.daemon and thread is not threading.main_thread()
thread.join()
assert triton_key.cache_info().currsize == 1 and triton_key.cache_info().misses == 1
key = triton_key()
assert triton_key.cache_info().hits == 1 and key.startswith(__import__("triton").__version__)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
