"""The Fast-LLM capture against a real Redis server started by the test (Debian's redis-server)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.importers.cli_import import import_cli, read_rows
from tests.importers.fast_llm_messages import DOCS, doc_messages

redis = pytest.importorskip("redis")
REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server binary not installed")
STREAM, GROUP = "fast_llm_streaming", "fast_llm_group"
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    server = subprocess.Popen(
        [
            REDIS_SERVER,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def _capture(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pgdiag.capture", "fast-llm", "--redis", url, "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_capture_then_import(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    # the trainer's group exists before the producer starts, as Fast-LLM creates it
    client.xgroup_create(name=STREAM, groupname=GROUP, id="0", mkstream=True)
    messages = doc_messages()
    for message in [*messages, messages[0]]:  # five documents: two full steps of 2 and one partial block
        client.xadd(STREAM, message)
    out = tmp_path / "capture"
    done = _capture(redis_url, out, "--docs-per-step", "2", "--idle-timeout", "1")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "capture_1.jsonl",
        "capture_2.jsonl",
        "capture_3.jsonl.partial",
    ]
    assert "captured 5 messages" in done.stderr
    # the capture neither joined the group nor acknowledged nor trimmed: the trainer still gets every message
    assert client.xlen(STREAM) == 5
    assert [g["name"] for g in client.xinfo_groups(STREAM)] == [GROUP.encode()]
    delivered = client.xreadgroup(GROUP, "fast_llm_consumer_0", {STREAM: ">"}, count=10, noack=True)
    assert len(delivered[0][1]) == 5
    run = tmp_path / "run"
    result = import_cli("fast-llm", out, run)
    assert result.exit_code == 0, result.stderr
    rows = read_rows(run)
    assert rows["step"].to_list() == [1, 1, 2, 2]
    assert rows["input_ids"].to_list() == [d["tokens"] for d in DOCS]
    for row, doc in zip(rows.iter_rows(named=True), DOCS, strict=True):
        p = doc["spans"][0][1]
        assert row["rollout_logprobs"] == [None] * p + doc["lps"][p:]
        assert row["policy_version_tok"] == doc["version"]
        assert row["reward"] == doc["reward"]


def test_capture_without_docs_per_step_writes_one_file(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    for message in doc_messages():
        client.xadd(STREAM, message)
    out = tmp_path / "capture"
    done = _capture(redis_url, out, "--max-messages", "3", "--first-step", "10")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["capture_10.jsonl"]
    assert len((out / "capture_10.jsonl").read_text().splitlines()) == 3


def test_unreachable_redis_is_one_error_line(tmp_path: Path) -> None:
    done = _capture(f"redis://127.0.0.1:{_free_port()}/0", tmp_path / "capture", "--max-messages", "1")
    assert done.returncode == 2 and done.stderr.startswith("error[E501]") and "Traceback" not in done.stderr
