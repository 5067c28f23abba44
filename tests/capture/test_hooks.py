"""The hooks are light (no heavy imports), inert (results, inputs and RNG untouched) and fail safe."""

from __future__ import annotations

import copy
import logging
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pgdiag.capture.dump import HOOKDUMP_FORMAT


def test_hook_modules_import_no_heavy_package():
    code = (
        "import sys\n"
        "import pgdiag.capture.trl, pgdiag.capture.verl, pgdiag.capture.openrlhf\n"
        "heavy = {'polars', 'pyarrow', 'rich', 'triton', 'typer', 'matplotlib', 'trl', 'transformers',\n"
        "         'verl', 'openrlhf', 'transfer_queue', 'tensordict', 'ray'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- a stand-in GRPOTrainer: its methods return fixed values and draw nothing, so any RNG draw is the hook's.


def _fake_trl_trainer() -> Any:
    prompt_ids = [[5, 6], [7, 8, 9]]
    completion_ids = [[11, 1], [12, 13, 14]]
    output = {
        "prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[11, 1, 0], [12, 13, 14]]),
        "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "advantages": torch.tensor([0.5, -0.5]),
        "old_per_token_logps": torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]], dtype=torch.bfloat16),
    }
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=4),
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(process_index=0, num_processes=1),
        eos_token_ids=[1],
        _tokenizer=SimpleNamespace(pad_token_id=0),
        reward_weights=torch.tensor([1.0, 2.0]),
        reward_func_names=["a", "b"],
        num_generations=2,
        args=SimpleNamespace(temperature=0.7, top_p=1.0, top_k=0, min_p=None),
        use_vllm=False,
    )

    def _generate(prompts: list[Any]) -> tuple[Any, ...]:
        return prompt_ids, completion_ids, None, ["x", "y"], None, {}, None, []

    def _calculate_rewards(
        inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> torch.Tensor:
        return torch.tensor([[1.0, 0.5], [float("nan"), float("nan")]])

    def _generate_and_score_completions(inputs: list[dict[str, Any]]) -> dict[str, Any]:
        result = trainer._generate(["p", "q"])
        trainer._calculate_rewards(inputs, ["p", "q"], result[3], result[1])
        return output

    trainer._generate = _generate
    trainer._calculate_rewards = _calculate_rewards
    trainer._generate_and_score_completions = _generate_and_score_completions
    return trainer, output


def _rng_states() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def test_trl_hook_is_inert_and_writes_a_weights_only_file(tmp_path: Path):
    import pgdiag.capture.trl

    trainer, output = _fake_trl_trainer()
    pgdiag.capture.trl.install(trainer, tmp_path)
    inputs = [{"prompt": "p"}, {"prompt": "q"}]
    inputs_before = copy.deepcopy(inputs)
    output_before = {k: v.clone() for k, v in output.items()}
    rng_before = _rng_states()
    result = trainer._generate_and_score_completions(inputs)
    rng_after = _rng_states()
    assert result is output and inputs == inputs_before
    assert all(torch.equal(output[k], output_before[k]) for k in output)
    assert torch.equal(rng_before[0], rng_after[0]) and rng_before[1] == rng_after[1]
    assert np.array_equal(rng_before[2], rng_after[2])

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4.pt"]  # no temp file left
    dump = torch.load(tmp_path / "step_4.pt", weights_only=True)
    assert dump["format"] == HOOKDUMP_FORMAT and dump["framework"] == "trl" and dump["step"] == 4
    t = dump["tensors"]
    assert t["prompt_lengths"].tolist() == [2, 3] and t["completion_lengths"].tolist() == [2, 3]
    assert t["truncated"].tolist() == [False, True]  # ends in EOS 1; ends in 14
    assert t["old_per_token_logps"].dtype == torch.float32  # bf16 widened (exact)
    assert torch.equal(t["old_per_token_logps"], output["old_per_token_logps"].float())
    assert torch.equal(t["tool_mask"], torch.ones(2, 3, dtype=torch.int64))  # absent = ones
    # rewards = Σ w_f r_f, NaN where every function returned None (TRL's unscorable mark)
    assert t["rewards"][0].item() == pytest.approx(2.0) and torch.isnan(t["rewards"][1])
    assert dump["meta"]["reward_func_names"] == ["a", "b"] and dump["meta"]["temperature"] == 0.7


def test_trl_hook_records_nothing_in_eval_mode_or_off_schedule(tmp_path: Path):
    import pgdiag.capture.trl

    trainer, _ = _fake_trl_trainer()
    pgdiag.capture.trl.install(trainer, tmp_path, every=3)
    trainer._generate_and_score_completions([{}])  # step 4: not a multiple of 3
    trainer.state.global_step = 6
    trainer.model.training = False
    trainer._generate_and_score_completions([{}])  # evaluation
    assert list(tmp_path.iterdir()) == []
    trainer.model.training = True
    trainer._generate_and_score_completions([{}])
    assert [p.name for p in tmp_path.iterdir()] == ["step_6.pt"]


def test_a_failing_hook_disables_itself_logs_once_and_never_reaches_training(tmp_path: Path, caplog):
    import pgdiag.capture.trl

    trainer, output = _fake_trl_trainer()
    del trainer.reward_weights  # the hook needs it: every recording now raises inside the hook
    pgdiag.capture.trl.install(trainer, tmp_path)
    with caplog.at_level(logging.ERROR, logger="pgdiag.capture"):
        for _ in range(3):
            assert trainer._generate_and_score_completions([{}]) is output
    errors = [r for r in caplog.records if r.name == "pgdiag.capture"]
    assert len(errors) == 1 and "disabled" in errors[0].getMessage()
    assert trainer._pgdiag_hook.guard.enabled is False
    assert list(tmp_path.iterdir()) == []


def test_training_errors_pass_through_the_hook_unchanged(tmp_path: Path):
    import pgdiag.capture.trl

    trainer, _ = _fake_trl_trainer()

    def broken(inputs: Any) -> Any:
        raise KeyError("from the trainer")

    trainer._generate_and_score_completions = broken
    pgdiag.capture.trl.install(trainer, tmp_path)
    with pytest.raises(KeyError, match="from the trainer"):
        trainer._generate_and_score_completions([{}])
    assert trainer._pgdiag_hook.guard.enabled is True


def test_install_twice_and_bad_every_are_refused(tmp_path: Path):
    import pgdiag.capture.trl

    trainer, _ = _fake_trl_trainer()
    with pytest.raises(ValueError, match="every"):
        pgdiag.capture.trl.install(trainer, tmp_path, every=0)
    pgdiag.capture.trl.install(trainer, tmp_path)
    with pytest.raises(ValueError, match="already installed"):
        pgdiag.capture.trl.install(trainer, tmp_path)


def test_verl_and_openrlhf_hooks_are_inert(tmp_path: Path):
    pytest.importorskip("tensordict")
    import pgdiag.capture.openrlhf
    import pgdiag.capture.verl
    from tests.importers.hook_fixtures import openrlhf_experiences, verl_batch, verl_trainer

    trainer = verl_trainer(2)
    pgdiag.capture.verl.install(trainer, tmp_path / "verl", every=2)
    batch = verl_batch()
    before = {k: v.clone() for k, v in batch.batch.items()}
    rng = _rng_states()
    assert trainer._update_actor(batch) == {"updated": True}
    after = _rng_states()
    assert torch.equal(rng[0], after[0]) and rng[1] == after[1] and np.array_equal(rng[2], after[2])
    assert all(torch.equal(before[k], batch.batch[k]) for k in before)
    trainer.global_steps = 3  # not a multiple of every=2: nothing written
    trainer._update_actor(batch)
    assert [p.name for p in (tmp_path / "verl").iterdir()] == ["step_2.pt"]

    experiences = openrlhf_experiences()
    snapshot = [e.sequences.clone() for e in experiences]
    orl = SimpleNamespace(
        experience_maker=SimpleNamespace(make_experience_batch=lambda samples: experiences),
        strategy=SimpleNamespace(args=SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2))),
    )
    orl.train_step = lambda samples, step: (orl.experience_maker.make_experience_batch(samples), step + 1)
    pgdiag.capture.openrlhf.install(orl, tmp_path / "orl")
    rng = _rng_states()
    result, next_step = orl.train_step(["x"], 9)
    after = _rng_states()
    assert result is experiences and next_step == 10
    assert torch.equal(rng[0], after[0]) and rng[1] == after[1] and np.array_equal(rng[2], after[2])
    assert all(torch.equal(a, e.sequences) for a, e in zip(snapshot, experiences, strict=True))
    dump = torch.load(tmp_path / "orl" / "step_9.pt", weights_only=True)
    assert dump["lists"]["index"] == [0, 1, 2, 3] and dump["meta"]["n_samples_per_prompt"] == 2
    # the experience maker called outside train_step (e.g. evaluation) records nothing
    orl.experience_maker.make_experience_batch(["y"])
    assert [p.name for p in (tmp_path / "orl").iterdir()] == ["step_9.pt"]
