"""`pgdiag.capture.trl` on a real TRL GRPOTrainer run (CPU): training is bit-for-bit the same with the hook."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from trl_run import run_grpo, save_tiny_qwen3


def _logged(trainer) -> list[dict]:
    return [
        {k: v for k, v in entry.items() if "time" not in k and "per_second" not in k}
        for entry in trainer.state.log_history
    ]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def plain_run(model_dir, tmp_path_factory):
    trainer = run_grpo(model_dir, tmp_path_factory.mktemp("plain"), save_strategy="no")
    return _logged(trainer), _weights(trainer)


def test_hooked_training_equals_unhooked_training(model_dir, plain_run, tmp_path):
    trainer = run_grpo(model_dir, tmp_path / "out", hook_dir=tmp_path / "dump", save_strategy="no")
    logged, weights = plain_run
    assert _logged(trainer) == logged
    assert all(torch.equal(weights[k], v) for k, v in _weights(trainer).items())
    assert [p.name for p in (tmp_path / "dump").iterdir()] == ["step_0.pt"]
    dump = torch.load(tmp_path / "dump" / "step_0.pt", weights_only=True)
    t = dump["tensors"]
    assert t["completion_ids"].shape[0] == 8 and dump["meta"]["n_samples_per_prompt"] == 4
    # the lengths TRL logged for step 1 are the recorded ones
    lengths = t["completion_lengths"].float()
    assert lengths.mean().item() == logged[0]["completions/mean_length"]
    assert lengths.max().item() == logged[0]["completions/max_length"]
    assert t["truncated"].float().mean().item() == logged[0]["completions/clipped_ratio"]


def test_a_broken_hook_leaves_training_untouched(model_dir, plain_run, tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the dump folder should go")  # every write fails
    with caplog.at_level(logging.ERROR, logger="pgdiag.capture"):
        trainer = run_grpo(model_dir, tmp_path / "out", hook_dir=blocker, save_strategy="no", max_steps=4)
    assert len([r for r in caplog.records if r.name == "pgdiag.capture"]) == 1  # two generations, one message
    logged, _ = plain_run
    assert _logged(trainer)[:2] == logged[:2]
    assert blocker.read_text().startswith("a file")
