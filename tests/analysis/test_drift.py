"""`drift`: a synthetic run with a planted jump in the engine mismatch at a known step is found at that step, a
run without one finds nothing, and the per-step rows equal `metrics` on each step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pgdiag.analysis.drift import change_points, drift, robust_sigma
from pgdiag.analysis.settings import ChangePointSettings
from pgdiag.data.pieces import run_steps
from pgdiag.data.runs import read_run
from pgdiag.metrics.api import compute_metrics
from tests.rollout_factory import write_rollouts_file

N_STEPS, JUMP_AT = 24, 15


def synthetic_run(path: Path, *, jump: bool, seed: int = 0) -> Path:
    """N_STEPS steps x 2 groups x 4 samples x 12 response tokens; |rollout − old| noise 0.01, ten times
    larger from step JUMP_AT on when `jump`."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(N_STEPS):
        noise = 0.1 if (jump and step >= JUMP_AT) else 0.01
        for k in range(8):
            n = 12
            rollout = -rng.uniform(1.0, 3.0, n)  # far from 0: noise keeps log-probs < 0
            old = rollout + rng.normal(0.0, noise, n)
            new = old + rng.normal(0.0, 0.01, n)
            adv = 1.0 if k % 2 else -1.0
            rows.append(
                {
                    "step": step,
                    "sample_id": f"{step}:{k}",
                    "group_id": f"{step}:g{k // 4}",
                    "input_ids": [1, 2] + [10 + i for i in range(n)],
                    "prompt_len": 2,
                    "loss_mask": [False, False] + [True] * n,
                    "rollout_logprobs": [None, None, *rollout.tolist()],
                    "old_logprobs": [None, None, *old.tolist()],
                    "new_logprobs": [None, None, *new.tolist()],
                    "advantages": [None, None] + [adv] * n,
                }
            )
    return write_rollouts_file(path / "rollouts.parquet", rows)


def test_planted_jump_is_found_at_its_step(tmp_path: Path):
    report = drift(read_run(synthetic_run(tmp_path, jump=True)))
    found = report.meta["change_points"]["found"]
    by_metric = {cp["metric"]: cp for cp in found}
    assert "mismatch/abs_mean" in by_metric and "mismatch/kl_k3" in by_metric
    assert {cp["step"] for cp in found} == {JUMP_AT}
    cp = by_metric["mismatch/abs_mean"]
    # |N(0, σ)| has mean σ·√(2/π): 0.008 before, 0.080 after
    assert cp["before"] == pytest.approx(0.01 * np.sqrt(2 / np.pi), rel=0.2)
    assert cp["after"] == pytest.approx(0.1 * np.sqrt(2 / np.pi), rel=0.2)
    assert report.value("mismatch/abs_mean", breakdown="changepoint", bucket=str(JUMP_AT)) == pytest.approx(
        cp["jump"]
    )


def test_run_without_a_jump_finds_nothing(tmp_path: Path):
    report = drift(read_run(synthetic_run(tmp_path, jump=False)))
    assert report.meta["change_points"]["found"] == []
    assert report.summary.filter(report.summary["breakdown"] == "changepoint").height == 0


def test_per_step_rows_equal_metrics_of_the_whole_run(tmp_path: Path):
    run = read_run(synthetic_run(tmp_path, jump=True))
    assert run_steps(run) == list(range(N_STEPS))
    report = drift(run)
    whole = compute_metrics(run)
    for step in (0, JUMP_AT, N_STEPS - 1):
        for metric in ("mismatch/abs_mean", "policy/kl_k3", "loss/pg"):
            assert report.value(metric, breakdown="step", bucket=str(step)) == pytest.approx(
                whole.value(metric, breakdown="step", bucket=str(step)), rel=1e-12
            )


def test_change_points_on_plain_series():
    settings = ChangePointSettings()
    steps = np.arange(20)
    flat = np.full(20, 0.5)
    assert change_points(steps, flat, "m", settings) == []
    stepped = np.where(steps >= 7, 1.5, 0.5)
    (cp,) = change_points(steps, stepped, "m", settings)
    assert (cp.step, cp.jump, cp.before, cp.after) == (7, 1.0, 0.5, 1.5)
    # two jumps: both found, in step order
    two = stepped + np.where(steps >= 14, 3.0, 0.0)
    assert [c.step for c in change_points(steps, two, "m", settings)] == [7, 14]
    # too short a series is not searched
    assert change_points(steps[:6], stepped[:6] * 0 + (steps[:6] >= 3), "m", settings) == []
    assert robust_sigma(np.array([1.0, 2.0])) == 0.0
