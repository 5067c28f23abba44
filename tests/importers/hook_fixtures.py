"""Hook files made by the real hooks from batches laid out as each framework lays them out.

verl (legacy `RayPPOTrainer._update_actor`): a `DataProto`-shaped object whose ``batch`` is a real tensordict
`TensorDict` with verl's keys (left-padded ``prompts``, right-padded ``responses``, ``attention_mask`` over
both, ``response_mask`` with a tool token, ``rollout_log_probs`` 0.0 on tool and pad tokens, recompute
streams with real numbers everywhere, ``token_level_scores`` on the last response token) and
``non_tensor_batch`` numpy arrays (``uid``, ``data_source``, a numeric reward-extra key).

OpenRLHF (`PPOTrainer.train_step` → `experience_maker.make_experience_batch`): `Experience`-shaped records as
`SamplesGenerator._process_response_into_experience` builds them (``action_mask[c]`` = token c + 1 is an
action, ``rollout_log_probs`` likewise shifted, ``total_length`` a float sum of the attention mask) and
`split_rollout_samples` batches them (right-padded, pad id on ``sequences``, 0 elsewhere; ``index`` = the
sample's position in generation order).

`hostile_pt` / `hostile_pickle` write files whose unpickling would create `marker`.
"""

from __future__ import annotations

import builtins
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

# ---- verl ------------------------------------------------------------------------------------------------

VERL_PROMPTS = [[5, 6], [7, 8, 9], [5, 6], [7, 8, 9]]  # two prompts, n = 2, interleaved as verl repeats
VERL_RESPONSES = [[11, 12, 13], [14, 15], [16, 17, 18, 19], [20]]
VERL_TOOL = [[False, True, False], [False, False], [False, False, False, False], [False]]  # token 12: tool


def verl_batch(*, bypass: bool = False, seed: int = 0) -> SimpleNamespace:
    """The legacy trainer's DataProto at `_update_actor`, and the per-row values it was made from."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    b, wp, wr = len(VERL_PROMPTS), 3, 4
    prompts = torch.zeros(b, wp, dtype=torch.long)
    responses = torch.zeros(b, wr, dtype=torch.long)
    attention = torch.zeros(b, wp + wr, dtype=torch.long)
    response_mask = torch.zeros(b, wr, dtype=torch.long)
    for r, (p, resp, tool) in enumerate(zip(VERL_PROMPTS, VERL_RESPONSES, VERL_TOOL, strict=True)):
        prompts[r, wp - len(p) :] = torch.tensor(p)
        responses[r, : len(resp)] = torch.tensor(resp)
        attention[r, wp - len(p) : wp + len(resp)] = 1
        response_mask[r, : len(resp)] = torch.tensor([not t for t in tool], dtype=torch.long)
    rollout = -torch.rand(b, wr, generator=g) * 3 - 0.01
    rollout = rollout * response_mask  # 0.0 on tool tokens and padding, as the rollout engine leaves them
    old = rollout.clone() if bypass else -torch.rand(b, wr, generator=g) * 3 - 0.01  # real numbers everywhere
    ref = -torch.rand(b, wr, generator=g) * 3 - 0.01
    advantages = torch.randn(b, wr, generator=g)
    scores = torch.zeros(b, wr)
    for r, resp in enumerate(VERL_RESPONSES):
        scores[r, len(resp) - 1] = float(r) * 0.5 - 0.25
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "response_mask": response_mask,
        "rollout_log_probs": rollout,
        "old_log_probs": old,
        "ref_log_prob": ref,
        "advantages": advantages,
        "token_level_scores": scores,
    }
    non_tensor = {
        "uid": np.array(["u0", "u1", "u0", "u1"], dtype=object),
        "data_source": np.array(["gsm8k", "math", "gsm8k", "math"], dtype=object),
        "acc": np.array([1.0, 0.0, 0.0, 1.0]),
        "index": np.array([0, 1, 2, 3]),  # a dataset index, not a reward: kept out of reward_components
    }
    return SimpleNamespace(
        batch=TensorDict(tensors, batch_size=[b]), non_tensor_batch=non_tensor, meta_info={}
    )


def verl_trainer(step: int, *, bypass: bool = False) -> SimpleNamespace:
    config = {
        "actor_rollout_ref": {"rollout": {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "n": 2}},
        "algorithm": {"rollout_correction": {"bypass_mode": bypass}},
    }
    return SimpleNamespace(global_steps=step, config=config, _update_actor=lambda batch: {"updated": True})


def write_verl_hook_files(
    out: Path, steps: tuple[int, ...] = (3,), *, bypass: bool = False
) -> dict[int, Any]:
    """Run the verl hook over one batch per step; return the batches."""
    import pgdiag.capture.verl

    made = {}
    for step in steps:
        trainer = verl_trainer(step, bypass=bypass)
        pgdiag.capture.verl.install(trainer, out)
        made[step] = verl_batch(bypass=bypass, seed=step)
        assert trainer._update_actor(made[step]) == {"updated": True}
    return made


# ---- OpenRLHF --------------------------------------------------------------------------------------------

PAD_ID = 0


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rollout_log_probs: torch.Tensor | None = None
    action_log_probs: torch.Tensor | None = None
    base_action_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    total_length: torch.Tensor | None = None
    index: list[int] | None = None
    info: dict = field(default_factory=dict)


# (observation tokens, action ranges [start, end) over them, reward, truncated): a single turn, a multi-turn
# sample with an environment-feedback span, and short ones; n_samples_per_prompt = 2.
OPENRLHF_SAMPLES = [
    ([5, 6, 7, 21, 22, 23], [(3, 6)], 1.0, False),
    ([5, 6, 7, 24, 30, 31, 25, 26], [(3, 4), (6, 8)], 0.0, True),
    ([8, 9, 27, 28], [(2, 4)], 0.5, False),
    ([8, 9, 29], [(2, 3)], -1.0, False),
]


def _sample(
    tokens: list[int], ranges: list[tuple[int, int]], reward: float, truncated: bool, g
) -> Experience:
    n = len(tokens)
    attention = torch.ones(n, dtype=torch.long)
    mask = torch.zeros(n, dtype=torch.long)
    for start, end in ranges:
        mask[start:end] = 1
    rollout_per_token = (-torch.rand(n, generator=g) * 2 - 0.01) * mask  # engine log-probs, 0.0 off actions
    return Experience(
        sequences=torch.tensor(tokens).unsqueeze(0),
        attention_mask=attention.unsqueeze(0),
        action_mask=mask[1:].unsqueeze(0),
        rollout_log_probs=rollout_per_token[1:].unsqueeze(0),
        rewards=torch.tensor([reward]),
        truncated=torch.tensor([truncated]),
        total_length=attention.float().sum().reshape(1),
        info={"reward": torch.tensor([reward])},
    )


def _concat(samples: list[Experience]) -> Experience:
    def pad(blocks: list[torch.Tensor], value: float) -> torch.Tensor:
        width = max(b.shape[1] for b in blocks)
        return torch.cat([torch.nn.functional.pad(b, (0, width - b.shape[1]), value=value) for b in blocks])

    return Experience(
        sequences=pad([s.sequences for s in samples], PAD_ID),
        attention_mask=pad([s.attention_mask for s in samples], 0),
        action_mask=pad([s.action_mask for s in samples], 0),
        rollout_log_probs=pad([s.rollout_log_probs for s in samples], 0),
        rewards=torch.cat([s.rewards for s in samples]),
        truncated=torch.cat([s.truncated for s in samples]),
        total_length=torch.cat([s.total_length for s in samples]),
        index=[i for s in samples for i in s.index],
        info={"reward": torch.cat([s.info["reward"] for s in samples])},
    )


def openrlhf_experiences(seed: int = 0, *, micro_batch: int = 3, old_equals_rollout: bool = False) -> list:
    """`make_experience_batch`'s result: micro-batches with the actor/ref forwards and advantages filled in."""
    g = torch.Generator().manual_seed(seed)
    samples = [_sample(*spec, g) for spec in OPENRLHF_SAMPLES]
    for i, s in enumerate(samples):
        s.index = [i]
    batches = [_concat(samples[i : i + micro_batch]) for i in range(0, len(samples), micro_batch)]
    for e in batches:
        mask = e.action_mask.float()
        e.action_log_probs = (
            e.rollout_log_probs.clone()
            if old_equals_rollout
            else (-torch.rand(mask.shape, generator=g) * 2 - 0.01) * mask
        )  # the actor's forward: log_probs * action_mask
        e.base_action_log_probs = (-torch.rand(mask.shape, generator=g) * 2 - 0.01) * mask
        e.advantages = torch.randn(mask.shape, generator=g) * mask
    return batches


def write_openrlhf_hook_files(out: Path, steps: tuple[int, ...] = (0,), **kwargs: Any) -> dict[int, list]:
    import pgdiag.capture.openrlhf

    made = {}
    for step in steps:
        experiences = openrlhf_experiences(seed=step, **kwargs)
        maker = SimpleNamespace(make_experience_batch=lambda samples, e=experiences: e)
        trainer = SimpleNamespace(
            experience_maker=maker,
            tokenizer=SimpleNamespace(pad_token_id=PAD_ID),
            strategy=SimpleNamespace(args=SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2))),
        )
        trainer.train_step = lambda samples, global_step, t=trainer: (
            t.experience_maker.make_experience_batch(samples),
            global_step + 1,
        )
        pgdiag.capture.openrlhf.install(trainer, out)
        result, next_step = trainer.train_step(["raw samples"], step)
        assert result is experiences and next_step == step + 1
        made[step] = experiences
    return made


# ---- hostile files ---------------------------------------------------------------------------------------


class _CreatesFile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return builtins.open, (str(self.marker), "w")


def hostile_pt(path: Path, marker: Path, payload: dict[str, Any]) -> Path:
    """A hook file (torch.save) that also holds an object whose unpickling opens `marker` for writing."""
    torch.save({**payload, "meta": {"x": _CreatesFile(marker)}}, path)
    return path


def hostile_pickle(path: Path, marker: Path) -> Path:
    """A plain pickle (e.g. gen_batch.dp) whose unpickling opens `marker` for writing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"batch": _CreatesFile(marker)}))
    return path


# ---- TRL (a stand-in GRPOTrainer; the real one runs in test_trl_end_to_end.py) -----------------------------

TRL_PROMPTS = [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
TRL_COMPLETIONS = [[11, 1], [12, 13, 14], [15, 1], [16]]  # EOS = 1: rows 1 and 3 are truncated


def trl_output(seed: int = 0) -> dict[str, torch.Tensor]:
    """`_generate_and_score_completions`' output for TRL_PROMPTS / TRL_COMPLETIONS (vLLM on, IS correction on)."""
    g = torch.Generator().manual_seed(seed)
    b, wp, wc = len(TRL_PROMPTS), 3, 3
    prompt_ids = torch.zeros(b, wp, dtype=torch.long)
    completion_ids = torch.zeros(b, wc, dtype=torch.long)
    completion_mask = torch.zeros(b, wc, dtype=torch.long)
    for r, (p, c) in enumerate(zip(TRL_PROMPTS, TRL_COMPLETIONS, strict=True)):
        prompt_ids[r, wp - len(p) :] = torch.tensor(p)
        completion_ids[r, : len(c)] = torch.tensor(c)
        completion_mask[r, : len(c)] = 1
    stream = lambda: (-torch.rand(b, wc, generator=g) * 3 - 0.01) * completion_mask
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": (prompt_ids != 0).long(),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([0.5, -0.5, 1.0, -1.0]),
        "sampling_per_token_logps": stream(),
        "old_per_token_logps": stream(),
        "ref_per_token_logps": stream(),
    }


def trl_trainer_stub(step: int, **fields: Any) -> SimpleNamespace:
    """The attributes of a TRL GRPOTrainer the hook reads (two reward functions, groups of 2, vLLM with its IS
    correction, untruncated sampling at T = 1), at `state.global_step = step`; `fields` replace or add some."""
    base: dict[str, Any] = {
        "state": SimpleNamespace(global_step=step),
        "model": SimpleNamespace(training=True),
        "accelerator": SimpleNamespace(process_index=0, num_processes=1),
        "eos_token_ids": [1],
        "_tokenizer": SimpleNamespace(pad_token_id=0),
        "reward_weights": torch.tensor([1.0, 1.0]),
        "reward_func_names": ["correct", "format"],
        "num_generations": 2,
        "args": SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None),
        "use_vllm": True,
        "vllm_importance_sampling_correction": True,
    }
    return SimpleNamespace(**{**base, **fields})


def wire_trl_generation(trainer: SimpleNamespace, generate: Any, rewards: torch.Tensor, output: dict) -> None:
    """Give the stand-in trainer TRL's generation chain: `_generate_and_score_completions(inputs)` calls
    `_generate` (the hook records the engine's outputs there), then `_calculate_rewards` (-> `rewards`), and
    returns `output`."""
    trainer._generate = generate
    trainer._calculate_rewards = lambda inputs, prompts, completions, ids: rewards
    trainer._generate_and_score_completions = lambda inputs: (
        trainer._generate(inputs),
        trainer._calculate_rewards(inputs, inputs, None, None),
        output,
    )[-1]


def write_trl_hook_file(out: Path, step: int = 0, *, edit: Any = None) -> dict[str, torch.Tensor]:
    """Run pgdiag.capture.trl over `trl_output` at `state.global_step = step`; `edit(output)` changes it first."""
    import pgdiag.capture.trl

    output = trl_output(step)
    if edit is not None:
        edit(output)
    trainer = trl_trainer_stub(step)
    rewards = torch.tensor([[1.0, 0.5], [0.0, 0.5], [1.0, 0.0], [float("nan"), float("nan")]])
    wire_trl_generation(
        trainer,
        lambda prompts: (TRL_PROMPTS, TRL_COMPLETIONS, None, ["a"] * 4, None, {}, None, []),
        rewards,
        output,
    )
    pgdiag.capture.trl.install(trainer, out)
    trainer._generate_and_score_completions(["p"] * 4)
    return output


def rewrite_hook_file(path: Path, edit: Any) -> None:
    """Load a hook file, let `edit(payload)` change it, save it back."""
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)
