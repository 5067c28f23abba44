"""`--to-tensorboard`: the event files read back with tensorboard's own reader to the report's per-step values
(float32, as TensorBoard stores scalars), under the chosen key style, from `metrics` and `drift`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pgdiag.report.export import step_scalars
from pgdiag.report.report import load_report
from tests.analysis.test_drift import N_STEPS, synthetic_run

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data"


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
