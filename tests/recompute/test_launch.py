"""Distributed recompute on CPU with gloo: `--tp 2` / `--dp 2` self-launch equals one process; layout rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from test_logprobs import cli_app, make_checkpoint, make_rows, read_stream, write_run
from typer.testing import CliRunner

from pgdiag.errors import UsageError
from pgdiag.recompute.launch import (
    current_layout,
    launched_by_torchrun,
    resolve_degrees,
    single_process_layout,
)

REPO = Path(__file__).resolve().parents[2]


def test_resolve_degrees() -> None:
    assert resolve_degrees(4, None, None) == (4, 1)
    assert resolve_degrees(4, 2, None) == (2, 2)
    assert resolve_degrees(4, None, 2) == (2, 2)
    assert resolve_degrees(6, 3, 2) == (3, 2)
    for world, tp, dp in ((4, 3, None), (4, 2, 3), (2, None, 4)):
        with pytest.raises(UsageError) as error:
            resolve_degrees(world, tp, dp)
        assert error.value.code == "E510"  # the launch does not fit the world size


def test_single_process_layout_and_torchrun_detection() -> None:
    layout = current_layout(None)
    assert layout == single_process_layout()
    assert layout.is_main and layout.is_writer and (layout.tp_size, layout.dp_size) == (1, 1)
    assert launched_by_torchrun({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not launched_by_torchrun({"LOCAL_RANK": "0"})


def _stream_values(directory: Path) -> tuple[list[str], np.ndarray]:
    frame = read_stream(directory)
    values = np.array(frame["logprobs"].explode().fill_null(np.nan).to_list() + frame["entropy"].explode()
                      .fill_null(np.nan).to_list(), dtype=float)  # fmt: skip
    return frame["sample_id"].to_list(), values


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(directory)
    return directory


def fp32_cpu_args(run: Path, ckpt: Path) -> list[str]:
    """`pgdiag logprobs` on the CPU in fp32, parts of 3 samples."""
    return [
        "logprobs",
        str(run),
        "--model",
        str(ckpt),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--part-samples",
        "3",
    ]


def test_cli_tp2_and_dp2_self_launch_equal_one_process(ckpt: Path, tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", make_rows(seed=11))
    runner = CliRunner()
    common = fp32_cpu_args(run, ckpt)
    single = runner.invoke(cli_app(), [*common, "--tag", "tp1"])
    assert single.exit_code == 0, single.output
    tp2 = runner.invoke(cli_app(), [*common, "--tag", "tp2", "--tp", "2", "--json"])
    assert tp2.exit_code == 0, tp2.output
    assert '"tp": 2' in tp2.stdout and '"dp": 1' in tp2.stdout
    dp2 = runner.invoke(cli_app(), [*common, "--tag", "dp2", "--dp", "2"])
    assert dp2.exit_code == 0, dp2.output
    ids1, v1 = _stream_values(run / "logprobs" / "tp1")
    for tag in ("tp2", "dp2"):
        ids, values = _stream_values(run / "logprobs" / tag)
        assert ids == ids1
        assert np.array_equal(np.isnan(values), np.isnan(v1))
        np.testing.assert_allclose(values[~np.isnan(values)], v1[~np.isnan(v1)], atol=1e-5, rtol=0)
    manifest = pl.read_json(run / "logprobs" / "dp2" / "_manifest.json")
    assert manifest["complete"].item() is True and manifest["settings"].struct.field("dp").item() == 2


class FileProgress:
    """A picklable progress callback that appends the tokens done to a file (workers run in other processes)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, update) -> None:  # type: ignore[no-untyped-def]
        with self.path.open("a") as out:
            out.write(f"{update.tokens_done} {update.tokens_total}\n")


def test_python_tp2_equals_tp1_with_progress_on_rank_0(ckpt: Path, tmp_path: Path) -> None:
    """`pgdiag.recompute_logprobs(..., tp=2)` from Python starts gloo workers itself and writes what tp=1 does."""
    import pgdiag

    run = write_run(tmp_path / "run", make_rows(seed=5))
    common = {"dtype": "fp32", "device": "cpu", "part_samples": 3}
    one = pgdiag.recompute_logprobs(run, ckpt, tag="py1", **common)
    progress = FileProgress(tmp_path / "progress.txt")
    two = pgdiag.recompute_logprobs(run, str(ckpt), tag="py2", tp=2, progress=progress, **common)
    assert (one.settings.tp, two.settings.tp) == (1, 2) and two.n_samples == one.n_samples
    ids1, v1 = _stream_values(one.path)
    ids2, v2 = _stream_values(two.path)
    assert ids2 == ids1 and np.array_equal(np.isnan(v2), np.isnan(v1))
    np.testing.assert_allclose(v2[~np.isnan(v2)], v1[~np.isnan(v1)], atol=1e-5, rtol=0)
    lines = (tmp_path / "progress.txt").read_text().split()
    done, total = int(lines[-2]), int(lines[-1])
    assert done == total == two.n_tokens  # only global rank 0 reports, and it reports every token


def test_torchrun_two_ranks_write_one_stream_and_one_json_object(ckpt: Path, tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", make_rows(seed=13, n_steps=1))
    args = ["logprobs", str(run), "--model", str(ckpt), "--dtype", "fp32", "--device", "cpu"]
    single = CliRunner().invoke(cli_app(), [*args, "--tag", "one"])
    assert single.exit_code == 0, single.output
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pgdiag"]
    done = subprocess.run(
        [*torchrun, *args, "--tag", "two", "--json"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    objects = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert len(objects) == 1 and objects[0]["summary"]["two"]["settings"]["tp"] == 2  # torchrun: tp = world
    ids1, v1 = _stream_values(run / "logprobs" / "one")
    ids2, v2 = _stream_values(run / "logprobs" / "two")
    assert ids1 == ids2 and np.array_equal(np.isnan(v1), np.isnan(v2))
    np.testing.assert_allclose(v2[~np.isnan(v2)], v1[~np.isnan(v1)], atol=1e-5, rtol=0)


def test_cli_tp_worker_error_is_one_line_with_the_worst_exit_code(ckpt: Path, tmp_path: Path) -> None:
    rows = make_rows(seed=12, n_steps=1, groups=1)
    rows[2]["input_ids"][1] = 10_000
    run = write_run(tmp_path / "run", rows)
    result = CliRunner().invoke(
        cli_app(), ["logprobs", str(run), "--model", str(ckpt), "--device", "cpu", "--tp", "2"]
    )
    assert result.exit_code == 3 and "error[E208]" in result.output and "Traceback" not in result.output


def test_cli_process_exit_keeps_outputs_and_codes(ckpt: Path, tmp_path: Path) -> None:
    """`python -m pgdiag logprobs` ends through `pgdiag.cli.exit_now` (no interpreter teardown): one process and
    a self-launched ``--dp 2`` write complete streams equal to the in-process run, the JSON result reaches a piped
    stdout whole, and a refusal keeps its documented exit code (E502: the output exists, exit 2)."""
    run = write_run(tmp_path / "run", make_rows(seed=14))
    args = fp32_cpu_args(run, ckpt)
    inside = CliRunner().invoke(cli_app(), [*args, "--tag", "in"])
    assert inside.exit_code == 0, inside.output
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    ids, values = _stream_values(run / "logprobs" / "in")
    for tag, extra in (("one", []), ("dp", ["--dp", "2"])):
        done = subprocess.run(
            [sys.executable, "-m", "pgdiag", *args, "--tag", tag, "--json", *extra],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["exit_code"] == 0 and result["summary"][tag]["n_samples"] == len(ids)
        assert json.loads((run / "logprobs" / tag / "_manifest.json").read_text())["complete"] is True
        got_ids, got = _stream_values(run / "logprobs" / tag)
        assert got_ids == ids and np.array_equal(got, values, equal_nan=True)
    again = subprocess.run(
        [sys.executable, "-m", "pgdiag", *args, "--tag", "one"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 2 and "error[E502]" in again.stdout + again.stderr, again.stdout + again.stderr
