"""NeMo-RL ``train_data_step<N>.jsonl`` files written the way NVIDIA-NeMo/RL 7ea279ab writes them.

``grpo.py`` builds ``log_data`` from the training batch (``.tolist()`` of torch tensors, right-padded rows with
``input_lengths``) and ``Logger.log_batched_dict_as_jsonl`` writes one ``json.dumps({**sample, "idx": i},
default=str)`` line per micro-batch of size 1 (``BatchedDataDict.slice``: ``value[i:i + 1]``). This module
rebuilds exactly that: the same field order, the same slicing, the same ``json.dumps`` call, so the preset reads
what NeMo-RL writes byte for byte. The values that went in are returned for the assertions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class NemoSample:
    prompt: list[int]
    response: list[int]  # generated assistant tokens
    tool: list[int]  # observation tokens after the response (loss 0), may be empty
    reward: float
    sample_mask: float = 1.0


def _pad_to(length: int, divisible_by: int) -> int:
    return length if length % divisible_by == 0 else (length // divisible_by + 1) * divisible_by


def write_train_data(
    path: Path,
    samples: list[NemoSample],
    *,
    seed: int = 0,
    pad_id: int = 0,
    divisible_by: int = 8,
    force_on_policy_ratio: bool = False,
    dynamic_sampling: bool = False,
) -> dict[str, torch.Tensor]:
    """Write one step file; returns the padded tensors (float32) the values came from."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [len(s.prompt) + len(s.response) + len(s.tool) for s in samples]
    width = _pad_to(max(lengths), divisible_by)
    n = len(samples)
    token_ids = torch.full((n, width), pad_id, dtype=torch.int64)
    token_loss_mask = torch.zeros(
        (n, width), dtype=torch.int64
    )  # torch.ones_like(token_ids) on assistant tokens
    generation_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for r, s in enumerate(samples):
        ids = s.prompt + s.response + s.tool
        token_ids[r, : len(ids)] = torch.tensor(ids)
        lo, hi = len(s.prompt), len(s.prompt) + len(s.response)
        token_loss_mask[r, lo:hi] = 1
        generation_logprobs[r, lo:hi] = -torch.rand(hi - lo, generator=gen) * 3 - 1e-3
    # the trainer's recompute carries real numbers on every position, prompt and padding included
    prev_logprobs = generation_logprobs + torch.randn((n, width), generator=gen) * 0.01 - 0.02
    prev_logprobs = torch.where(prev_logprobs > 0, -prev_logprobs, prev_logprobs)
    if force_on_policy_ratio:
        prev_logprobs = torch.zeros_like(generation_logprobs)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    advantages = (rewards - rewards.mean()).unsqueeze(1).expand(n, width).contiguous()
    sample_mask = torch.tensor([s.sample_mask for s in samples], dtype=torch.float32)
    input_lengths = torch.tensor(lengths, dtype=torch.int32)

    log_data: dict = {}
    log_data["content"] = [[f"prompt {r}", f"answer {r}"] for r in range(n)]
    log_data["rewards"] = rewards.tolist()
    if dynamic_sampling:
        log_data["filtered_rewards"] = rewards.tolist()
        log_data["rewards"] = (
            rewards + 10.0
        ).tolist()  # repeated_batch["total_reward"]: the unfiltered total
    log_data["input_lengths"] = input_lengths.tolist()
    log_data["token_ids"] = token_ids.tolist()
    log_data["token_loss_mask"] = token_loss_mask.tolist()
    log_data["sample_loss_mask"] = sample_mask.tolist()
    log_data["advantages"] = advantages.tolist()
    log_data["generation_logprobs"] = generation_logprobs.tolist()
    log_data["prev_logprobs"] = prev_logprobs.tolist()

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:  # Logger.log_batched_dict_as_jsonl
        for i in range(n):
            sample = {key: value[i : i + 1] for key, value in log_data.items()}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
    return {
        "token_ids": token_ids,
        "token_loss_mask": token_loss_mask,
        "generation_logprobs": generation_logprobs,
        "prev_logprobs": prev_logprobs,
        "advantages": advantages,
        "rewards": rewards,
        "input_lengths": input_lengths,
        "sample_mask": sample_mask,
    }


def group_samples(step: int) -> list[NemoSample]:
    """Two prompts x two generations, one with a tool span, one masked out by its sample mask."""
    p1, p2 = [11, 12, 13], [21, 22]
    return [
        NemoSample(p1, [101, 102, 103], [], 1.0),
        NemoSample(p1, [104, 105], [7, 7], 0.0),
        NemoSample(p2, [106, 107, 108, 109], [], 1.0 + step),
        NemoSample(p2, [110], [], 0.0, sample_mask=0.0),
    ]
