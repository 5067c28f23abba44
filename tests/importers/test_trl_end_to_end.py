"""The real thing, end to end on the CPU: TRL GRPOTrainer → pgdiag.capture.trl → import → check → metrics.

A tiny random Qwen3 trains for two optimizer steps on one generation batch (`num_iterations` 2, so TRL
computes old log-probs; β 0.1, so it logs KL). TRL's step 1 evaluates the policy θ0 it sampled with, step 2
the policy θ1 after one update (its `checkpoint-1`). pgdiag recomputes both policies' log-probs and entropy
on the imported tokens (`pgdiag logprobs`, fp32) and `pgdiag metrics --key-style trl` must print what TRL
logged for each step, within float32 rounding; the imported rows must give TRL's completion-length, reward and
token-count logs exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("trl")

import pgdiag
from tests.capture.trl_run import run_grpo, save_tiny_qwen3

F32 = {"rel": 2e-6, "abs": 1e-6}  # float32 rounding of TRL's logged values


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_e2e")
    model = save_tiny_qwen3(root / "model")
    trainer = run_grpo(model, root / "out", hook_dir=root / "dump")
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    return root, logged


def _cli(*args: str) -> dict:
    from typer.testing import CliRunner

    from pgdiag.cli.app import build_app

    result = CliRunner().invoke(build_app(), [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def imported(trl_run):
    root, _ = trl_run
    run = root / "run"
    result = _cli("import", "--preset", "trl", str(root / "dump"), str(run))
    _cli("check", str(run))
    for tag, model in (("theta0", root / "model"), ("theta1", root / "out" / "checkpoint-1")):
        _cli("logprobs", str(run), "--model", str(model), "--dtype", "fp32", "--device", "cpu", "--tag", tag)
    return run, result


@pytest.mark.parametrize(("trl_step", "tag"), [(1, "theta0"), (2, "theta1")])
def test_metrics_equal_what_trl_logged(trl_run, imported, trl_step, tag):
    _, logged = trl_run
    run, _ = imported
    result = _cli("metrics", str(run), "--key-style", "trl", "--new", tag, "--entropy", tag, "--beta", "0.1")
    mine = result["per_step"]["0"]
    theirs = logged[trl_step]
    keys = [
        "loss",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    ]
    for key in keys:
        assert mine[key] == pytest.approx(theirs[key], **F32), key
    if trl_step == 1:
        assert mine["frac_reward_zero_std"] == theirs["frac_reward_zero_std"]
    else:  # after one update the policy has moved: the comparison is not a trivial one
        assert theirs["kl"] > 0.1 and theirs["clip_ratio/region_mean"] > 0.1


def test_imported_rows_give_trls_length_reward_and_token_logs(trl_run, imported):
    _, logged = trl_run
    run, result = imported
    first = logged[1]
    assert result["inputs"]["n_tokens"] == first["num_tokens"]  # prompt + completion tokens
    rows = pgdiag.read_run(run).collect(
        ["input_ids", "prompt_len", "finish_reason", "reward", "reward_components", "group_id"]
    )
    completion = rows["input_ids"].list.len() - rows["prompt_len"]
    assert completion.mean() == first["completions/mean_length"]
    assert completion.min() == first["completions/min_length"]
    assert completion.max() == first["completions/max_length"]
    truncated = (rows["finish_reason"] == "length").to_numpy()
    assert truncated.mean() == first["completions/clipped_ratio"]
    assert 0 < truncated.sum() < len(truncated)  # both kinds of completion occur
    terminated = completion.to_numpy()[~truncated]
    assert terminated.mean() == pytest.approx(first["completions/mean_terminated_length"], **F32)
    assert rows["reward"].mean() == pytest.approx(first["reward"], **F32)
    components = rows["reward_components"].to_list()
    for name in ("reward_length", "reward_w7"):
        values = np.array([row[name] for row in components])
        assert values.mean() == pytest.approx(first[f"rewards/{name}/mean"], **F32)
    assert rows["group_id"].n_unique() == 2  # 8 completions, num_generations 4
