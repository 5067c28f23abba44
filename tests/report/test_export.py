"""`--to-tensorboard`: the event files read back with tensorboard's own reader to the report's per-step values
(float32, as TensorBoard stores scalars), under the chosen key style, from `metrics` and `drift`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pgdiag.report.export import step_scalars
from pgdiag.report.report import load_report
from tests.analysis.test_drift import N_STEPS, synthetic_run

SAMPLE = SAMPLE_DATA


def invoke(*args: str):
    from pgdiag.cli.app import build_app

    return CliRunner().invoke(build_app(), list(args))


def read_back(logdir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize(("command", "style"), [("metrics", "pgdiag"), ("drift", "verl")])
def test_tensorboard_reads_back_the_report(command: str, style: str, tmp_path: Path):
    run = str(SAMPLE / "run_a") if command == "metrics" else str(synthetic_run(tmp_path, jump=True))
    logdir, out = tmp_path / "tb", tmp_path / "rep"
    result = invoke(
        command, run, "--key-style", style, "--to-tensorboard", str(logdir), "--out", str(out), "-q"
    )
    assert result.exit_code in (0, 1), result.output
    expected = step_scalars(load_report(out / f"{command}.parquet"))
    assert expected.height > 0
    back = read_back(logdir)
    assert set(back) == set(expected["metric"].unique())
    for step, metric, value in expected.iter_rows():
        assert back[metric][step] == np.float32(value)
    if command == "drift":
        assert "rollout_corr/k3_kl" in back and len(back["rollout_corr/k3_kl"]) == N_STEPS
    else:
        assert "policy/kl_k3" in back


def test_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    result = invoke("metrics", str(SAMPLE / "run_a"), "--to-tensorboard", str(tmp_path / "tb"), "-q")
    assert result.exit_code == 2
    assert "error[E509]" in result.output


# --to-wandb: W&B 0.31 ships no reader of its run log, so the test reads the LevelDB-style record log itself:
# a 7-byte ":W&B" file header, then 32 KiB blocks of chunks (crc32c 4, length 2 little-endian, kind 1: 1 full,
# 2 first, 3 middle, 4 last), each finished record a `wandb_internal_pb2.Record`.
WANDB_BLOCK = 32768


def wandb_records(log: Path):
    from wandb.proto.wandb_internal_pb2 import Record

    data = log.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (kind == 0 and length == 0):  # block trailer or zero padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    import json

    (log,) = run_dir.glob("run-*.wandb")
    back: dict[str, dict[int, float]] = {}
    for record in wandb_records(log):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {  # wandb-core writes a key as a one-part nested_key
            item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        step = record.history.step.num
        assert items.pop("_step", step) == step  # wandb leaves `_step` out where it is 0
        for key, value in items.items():
            if not key.startswith("_"):
                back.setdefault(key, {})[step] = value
    return back


@pytest.mark.parametrize(("command", "style"), [("metrics", "pgdiag"), ("drift", "verl")])
def test_wandb_offline_run_reads_back_the_report(
    command: str, style: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default: no network, no login
    run = str(SAMPLE / "run_a") if command == "metrics" else str(synthetic_run(tmp_path, jump=True))
    out = tmp_path / "rep"
    where = ["--wandb-dir", str(tmp_path / "wb")] if command == "drift" else []  # metrics: beside --out
    result = invoke(
        command,
        run,
        "--key-style",
        style,
        "--to-wandb",
        "pgdiag-test",
        *where,
        "--out",
        str(out),
        "-q",
        "--json",
    )
    assert result.exit_code in (0, 1), result.output
    import json

    run_dir = Path(json.loads(result.stdout)["files"]["wandb"])
    assert run_dir.parent == (tmp_path / "wb" / "wandb" if command == "drift" else out / "wandb")
    assert run_dir.name.startswith("offline-run-") and (run_dir / "files").is_dir()
    expected = step_scalars(load_report(out / f"{command}.parquet"))
    back = wandb_history(run_dir)
    assert set(back) == set(expected["metric"].unique())
    for step, metric, value in expected.iter_rows():
        assert back[metric][step] == value  # float64 as written, not rounded
    if command == "drift":
        assert len(back["rollout_corr/k3_kl"]) == N_STEPS


def test_wandb_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    result = invoke("drift", str(SAMPLE / "run_a"), "--to-wandb", "p", "--wandb-dir", str(tmp_path), "-q")
    assert result.exit_code == 2
    assert "error[E509]" in result.output
    assert not (tmp_path / "wandb").exists()
