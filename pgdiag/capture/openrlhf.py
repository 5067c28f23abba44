"""OpenRLHF hook: `install(trainer, out_dir, every=1)` records the experiences of each PPO step.

OpenRLHF writes no rollout dump. `PPOTrainer` is a Ray actor, so install inside it, e.g. in a subclass::

    class DumpingPPOTrainer(PPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import pgdiag.capture.openrlhf
            pgdiag.capture.openrlhf.install(self, "dumps/openrlhf")

It wraps two methods of that object (checked against OpenRLHF 0.11, `openrlhf/trainer/ppo_trainer.py`):
`train_step(rollout_samples, global_step)` (for the step) and `experience_maker.make_experience_batch(...)`,
whose returned `Experience` micro-batches `train_step` hands to `balance_experiences` and the replay buffer;
they are recorded before either sees them, concatenated and right-padded to the widest (pad id, masks 0,
streams 0.0: right padding keeps the next-token layout), into ``step_<global_step>.pt``.

Recorded: `sequences`, `attention_mask`, `action_mask`, `rollout_log_probs`, `action_log_probs`,
`base_action_log_probs` (each when present), `advantages`, `total_length`, `prompt_lengths` (position of the first
action token: OpenRLHF keeps no prompt length), `rewards` (`info["reward"]`, before length penalties and shaping),
`truncated`; list `index` (the sample's position in generation order); meta `n_samples_per_prompt`.
Light and inert: the standard library and torch only; results are returned unchanged; values are copied to
the CPU; an error disables the hook (logged once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pgdiag.capture.dump import HookRecorder, cpu_copy, framework_version, plain, write_hookdump

_TOKEN_FIELDS = ("sequences", "attention_mask")  # (B, T)
_ACTION_FIELDS = (
    "action_mask",
    "rollout_log_probs",
    "action_log_probs",
    "base_action_log_probs",
    "advantages",
)


def _pad_right(blocks: list[torch.Tensor], value: float | int) -> torch.Tensor:
    """Concatenate (b, w) blocks along rows, right-padding each to the widest with `value`."""
    width = max(block.shape[1] for block in blocks)
    rows = sum(block.shape[0] for block in blocks)
    out = blocks[0].new_full((rows, width), value)  # (B, W)
    row = 0
    for block in blocks:
        out[row : row + block.shape[0], : block.shape[1]] = block
        row += block.shape[0]
    return out


def _row_values(experience: Any, name: str) -> torch.Tensor | None:
    """A (b,) per-sample tensor of `experience`: the field itself, else `info[name]`."""
    value = getattr(experience, name, None)
    if value is None:
        value = (getattr(experience, "info", None) or {}).get(name)
    if value is None:
        return None
    return cpu_copy(torch.as_tensor(value)).reshape(-1)


class _OpenRlhfRecorder(HookRecorder):
    def __init__(self, trainer: Any, out_dir: Path, every: int) -> None:
        super().__init__(trainer, out_dir, every, "openrlhf")
        self.step: int | None = None

    def begin(self, global_step: int) -> None:
        self.step = int(global_step) if int(global_step) % self.every == 0 else None

    def record(self, experiences: list[Any]) -> None:
        if self.step is None or not experiences:
            return
        pad_id = getattr(getattr(self.trainer, "tokenizer", None), "pad_token_id", None)
        pad_id = 0 if pad_id is None else int(pad_id)
        tensors: dict[str, torch.Tensor] = {}
        for name in _TOKEN_FIELDS + _ACTION_FIELDS:
            blocks = [getattr(e, name, None) for e in experiences]
            if any(block is None for block in blocks):
                continue
            value = pad_id if name == "sequences" else 0
            tensors[name] = _pad_right([cpu_copy(block) for block in blocks], value)
        action_mask = tensors["action_mask"].bool()  # (B, A): column c is token c + 1
        has_action = action_mask.any(dim=1)
        first_action = torch.argmax(action_mask.to(torch.int8), dim=1) + 1  # token position
        tensors["prompt_lengths"] = torch.where(has_action, first_action, torch.zeros_like(first_action))
        for name, source in (("total_length", "total_length"), ("truncated", "truncated")):
            parts = [_row_values(e, source) for e in experiences]
            if all(part is not None for part in parts):
                tensors[name] = torch.cat(parts)  # type: ignore[arg-type]
        rewards = [_reward(e) for e in experiences]
        if all(r is not None for r in rewards):
            tensors["rewards"] = torch.cat(rewards).to(torch.float32)  # type: ignore[arg-type]
        index = [
            plain(i) for e in experiences for i in (getattr(e, "index", None) or [None] * len(e.sequences))
        ]
        args = getattr(getattr(self.trainer, "strategy", None), "args", None) or getattr(
            self.trainer, "args", None
        )
        rollout = getattr(args, "rollout", None)
        meta = {
            "n_samples_per_prompt": plain(getattr(rollout, "n_samples_per_prompt", "unknown")),
            "temperature": plain(getattr(rollout, "temperature", "unknown")),
            "top_p": plain(getattr(rollout, "top_p", "unknown")),
            "top_k": plain(getattr(rollout, "top_k", "unknown")),
            "logprobs_mode": "unknown",
            "tempered": "unknown",
        }
        write_hookdump(
            self.out_dir,
            framework="openrlhf",
            version=framework_version("openrlhf"),
            step=self.step,
            rank=0,
            world_size=1,
            tensors=tensors,
            lists={"index": index},
            meta=meta,
        )


def _reward(experience: Any) -> torch.Tensor | None:
    """`info["reward"]` (the raw reward before length penalties and shaping), else the `rewards` field."""
    info = getattr(experience, "info", None) or {}
    value = info.get("reward")
    if value is None:
        value = getattr(experience, "rewards", None)
    return None if value is None else cpu_copy(torch.as_tensor(value)).reshape(-1)


def install(trainer: Any, out_dir: str | Path, *, every: int = 1) -> None:
    """Record every `every`-th `train_step` of OpenRLHF `PPOTrainer` `trainer` into `out_dir`."""
    recorder = _OpenRlhfRecorder.for_install(trainer, out_dir, every)
    guard = recorder.guard
    train_step = trainer.train_step
    maker = trainer.experience_maker

    def _train_step(rollout_samples: Any, global_step: int) -> Any:
        guard.record(recorder.begin, global_step)
        try:
            return train_step(rollout_samples, global_step)
        finally:
            recorder.step = None

    trainer.train_step = _train_step
    maker.make_experience_batch = guard.after(maker.make_experience_batch, recorder.record)
    trainer._pgdiag_hook = recorder
