"""`pgdiag drift` end to end: the planted jump through the CLI (`--json`, `--out`, `--plot`), `--key-style`
applied to the per-step rows, and a bad option as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pgdiag.report.report import load_report
from tests.analysis.test_drift import JUMP_AT, N_STEPS, synthetic_run


def invoke(*args: str):
    from pgdiag.cli.app import build_app

    return CliRunner().invoke(build_app(), list(args))


def test_jump_through_the_cli(tmp_path: Path):
    run = synthetic_run(tmp_path, jump=True)
    out, plot = tmp_path / "rep", tmp_path / "drift.png"
    result = invoke("drift", str(run), "--json", "--out", str(out), "--plot", str(plot))
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    assert obj["inputs"]["steps"] == list(range(N_STEPS))
    assert {cp["step"] for cp in obj["change_points"]} == {JUMP_AT}
    assert "mismatch/abs_mean" in obj["per_step"][str(JUMP_AT)]
    loaded = load_report(out / "drift.parquet")
    assert loaded.kind == "drift"
    assert loaded.meta["change_points"]["found"] == obj["change_points"]
    assert plot.stat().st_size > 1000


def test_key_style_applies_and_metric_option(tmp_path: Path):
    run = synthetic_run(tmp_path, jump=True)
    result = invoke(
        "drift", str(run), "--json", "-q", "--key-style", "verl", "--metric", "rollout_corr/k3_kl"
    )
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    keys = set(obj["per_step"]["0"])
    assert keys and all("/" in k for k in keys) and not any(k.startswith("mismatch/") for k in keys)
    assert "rollout_corr/k3_kl" in keys
    assert [(cp["metric"], cp["step"]) for cp in obj["change_points"]] == [("rollout_corr/k3_kl", JUMP_AT)]


def test_bad_threshold_exits_2(tmp_path: Path):
    run = synthetic_run(tmp_path, jump=False)
    result = invoke("drift", str(run), "--cp-threshold", "0")
    assert result.exit_code == 2
    assert "error[E503]" in result.output
