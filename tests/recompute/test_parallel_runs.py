"""Data-parallel bookkeeping, a worker killed mid-part, and the two-node launch, on the CPU with gloo.

Every sample of the plan is written once by one replica (part i to replica i mod dp), the parts add up to the
one-process stream bit for bit (TP = 1 replicas forward the same batches, so fp32 or not the numbers are the
same); a replica worker killed with SIGKILL stops the job, and the rerun computes only the parts not on disk;
``torchrun --nnodes 2`` with a c10d rendezvous on 127.0.0.1 writes the same stream as one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import psutil
from sample_paths import SAMPLE_DATA
from test_logprobs import read_stream

import pgdiag
from pgdiag.data.schema import RECOMPUTE_FOOTER_KEY, read_footer
from pgdiag.recompute.launch import free_port, replica_parts

ROOT = Path(__file__).resolve().parents[2]
TINY = SAMPLE_DATA / "tiny-qwen"
OPTIONS = ["--dtype", "fp32", "--batch-tokens", "256", "--device", "cpu"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def values(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.select("step", "sample_id", "segment_idx", "logprobs", "entropy")


def parts_on_disk(directory: Path) -> dict[str, tuple[int, int]]:
    """Relative part path -> (inode, mtime ns): a part rewritten by a resume changes both."""
    return {
        str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in directory.glob("step=*/part-*.parquet")
    }


def test_replica_parts_partition_the_plan() -> None:
    for n_parts in range(0, 12):
        for dp in range(1, 5):
            shares = [list(replica_parts(n_parts, rank, dp)) for rank in range(dp)]
            assert sorted(i for share in shares for i in share) == list(range(n_parts))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1  # whole parts, dealt round robin
    assert list(replica_parts(7, 1, 3)) == [1, 4]


def test_dp3_writes_every_sample_once_in_the_planned_parts_bit_identical(run_copy: Path) -> None:
    """32 samples in parts of 3 are 11 parts: 4, 4 and 3 for three replicas."""
    common = {"dtype": "fp32", "device": "cpu", "part_samples": 3, "batch_tokens": 256}
    one = pgdiag.recompute_logprobs(run_copy, TINY, tag="one", **common)
    three = pgdiag.recompute_logprobs(run_copy, str(TINY), tag="dp3", dp=3, **common)
    assert (three.settings.dp, three.parts_computed, three.n_samples) == (3, 11, 32)
    manifest = json.loads((three.path / "_manifest.json").read_text())
    planned = [p["path"] for p in manifest["parts"]]
    assert manifest["complete"] and len(planned) == 11
    assert sorted(parts_on_disk(three.path)) == sorted(planned)  # every planned part once, nothing else
    ids = []
    for entry in manifest["parts"]:
        footer = read_footer(three.path / entry["path"])[RECOMPUTE_FOOTER_KEY]
        assert footer["part"] == {k: v for k, v in entry.items() if k != "path"}  # the file is its plan entry
        rows = pl.read_parquet(three.path / entry["path"])
        assert rows.height == entry["n_samples"]
        ids += rows["sample_id"].to_list()
    a, b = read_stream(one.path), read_stream(three.path)
    assert len(ids) == len(set(ids)) == b.height == 32  # every sample once
    assert values(b).equals(values(a))  # the same batches per part: bit for bit


def _workers(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's spawned recompute workers (not the resource tracker)."""
    children = psutil.Process(launcher.pid).children(recursive=True)
    return sorted((c for c in children if "spawn_main" in " ".join(c.cmdline())), key=lambda c: c.pid)


def test_dp2_worker_sigkill_mid_part_then_resume_recomputes_only_missing_parts(run_copy: Path) -> None:
    """`--dp 2` in parts of 1 (32 parts); one worker SIGKILLed once a few parts are on disk: the job stops
    with a non-zero exit and no traceback; the rerun keeps every finished part (same inode and mtime) and
    the stream equals an uninterrupted one bit for bit, every sample once."""
    out_dir = run_copy / "logprobs" / "rc"
    command = [sys.executable, "-m", "pgdiag", "logprobs", str(run_copy), "--model", str(TINY), "--tag", "rc"]
    command += [*OPTIONS, "--part-samples", "1", "--dp", "2", "-q"]
    launcher = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(parts_on_disk(out_dir)) < 3 and launcher.poll() is None:
        assert time.monotonic() < deadline, "the recompute wrote no part in time"
        time.sleep(0.05)
    victims = _workers(launcher)
    assert len(victims) == 2, [c.cmdline() for c in victims]
    os.kill(victims[1].pid, signal.SIGKILL)  # replica 1 (started second), in the middle of its next part
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0 and "Traceback" not in stderr, stderr
    before = parts_on_disk(out_dir)
    assert 3 <= len(before) < 32, sorted(before)
    manifest = json.loads((out_dir / "_manifest.json").read_text())
    assert manifest["complete"] is False

    resumed = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    after = parts_on_disk(out_dir)
    assert len(after) == 32
    assert {path: after[path] for path in before} == before  # no finished part recomputed
    fresh = pgdiag.recompute_logprobs(run_copy, TINY, tag="fresh", dtype="fp32", device="cpu", part_samples=1,
                                      batch_tokens=256)  # fmt: skip
    a, b = read_stream(out_dir), read_stream(fresh.path)
    assert a.height == 32 and a["sample_id"].n_unique() == 32
    assert values(a).equals(values(b))
    assert not [p for p in out_dir.rglob("*") if ".tmp-" in p.name]


def test_two_node_torchrun_on_127_0_0_1_writes_the_one_process_stream(run_copy: Path) -> None:
    """Two single-process "nodes" (``torchrun --nnodes 2 --node-rank k``, c10d rendezvous on 127.0.0.1:PORT),
    `--dp 2`: one JSON object (global rank 0), the manifest says dp 2, the stream equals one process bit for
    bit."""
    args = ["logprobs", str(run_copy), "--model", str(TINY), *OPTIONS, "--part-samples", "4"]
    single = subprocess.run([sys.executable, "-m", "pgdiag", *args, "--tag", "one", "-q"], env=ENV,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "pgdiag-test",
                "-m",
                "pgdiag",
                *args,
                "--tag",
                "nodes",
                "--dp",
                "2",
                "--json",
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr
    objects = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(objects) == 1  # global rank 0 alone reports
    settings = objects[0]["summary"]["nodes"]["settings"]
    assert (settings["tp"], settings["dp"]) == (1, 2)
    a, b = read_stream(run_copy / "logprobs" / "one"), read_stream(run_copy / "logprobs" / "nodes")
    assert b.height == 32 and b["sample_id"].n_unique() == 32
    assert values(b).equals(values(a))
