"""PipelineRL stream files as PipelineRL 58d39345 writes them (files backend), for the preset tests.

`training_text` is ``TrainingText.model_dump()`` of ``make_training_text`` (labels -100 on the prompt, the
completion's log-probs only, ``metadata`` stamped by the actor with ``model_version``, ``rollout_index`` and
``step_index``); an actor line is the JSON array of one group's dumps. `packed_batch` is
``PipelineBatchEncoding.model_dump()`` of ``collate_packed`` over examples from ``prepare_rl_fields``
(``old_logprobs`` and ``ref_logprobs`` zero-filled in front, ``rewards`` on every token, the first label of
every packed sequence after the first set to -100, a synthetic padding example when the total is not a
multiple of ``seq_parallel``). Lines are written compact with a trailing newline, as orjson does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def training_text(
    prompt: list[int],
    completion: list[int],
    logprobs: list[float],
    *,
    reward: float,
    finished: bool,
    group_id: str,
    model_version: int,
    rollout_index: int,
    step_index: int = 0,
) -> dict[str, Any]:
    return {
        "text": "<prompt><completion>",
        "n_predicted": 12,
        "reward": reward,
        "logprobs": logprobs,
        "ref_logprobs": [],
        "input_ids": prompt + completion,
        "labels": [-100] * len(prompt) + completion,
        "group_id": group_id,
        "finished": finished,
        "prompt_tokens": len(prompt),
        "output_tokens": len(completion),
        "visual_features": None,
        "metadata": {
            "model_version": model_version,
            "rollout_index": rollout_index,
            "step_index": step_index,
        },
    }


def rl_example(
    prompt: list[int],
    completion: list[int],
    old: list[float],
    ref: list[float],
    *,
    reward: float,
    adv: float,
    version: int,
) -> dict[str, Any]:
    n = len(prompt) + len(completion)
    labels = [-100] * len(prompt) + completion
    return {
        "input_ids": prompt + completion,
        "labels": labels,
        "rewards": [reward] * n,
        "advantages": [adv if lab != -100 else 0.0 for lab in labels],
        "old_logprobs": [0] * len(prompt) + old,
        "ref_logprobs": [0] * len(prompt) + ref,
        "overflow": [0] * n,
        "group_tokens": [float(n)] * n,
        "num_labels": [1 if lab != -100 else 0 for lab in labels],
        "model_version": version,
    }


def packed_batch(
    examples: list[dict[str, Any]], *, seq_parallel: int = 1, sentinel: bool = False
) -> dict[str, Any]:
    total = sum(len(e["input_ids"]) for e in examples)
    padding = -total % seq_parallel
    if padding:
        examples = [
            *examples,
            {  # create_sentinel_example: EOS tokens, labels -100
                "input_ids": [2] * padding,
                "labels": [-100] * padding,
                **{
                    k: [0.0] * padding
                    for k in ("rewards", "advantages", "old_logprobs", "ref_logprobs", "overflow")
                },
                "group_tokens": [1.0] * padding,
                "num_labels": [1.0] * padding,
                "model_version": max(e["model_version"] for e in examples),
            },
        ]
    bounds = [0]
    for e in examples:
        bounds.append(bounds[-1] + len(e["input_ids"]))
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    extra = (
        "rewards",
        "advantages",
        "ref_logprobs",
        "old_logprobs",
        "group_tokens",
        "num_labels",
        "overflow",
    )
    for key in extra:
        out[key] = []
    for i, e in enumerate(examples):
        labels = list(e["labels"])
        if i > 0 and labels:
            labels[0] = -100
        out["input_ids"] += e["input_ids"]
        out["labels"] += labels
        out["position_ids"] += list(range(len(e["input_ids"])))
        out["segment_ids"] += [i] * len(e["input_ids"])
        for key in extra:
            out[key] += [float(v) for v in e[key]]
    return {
        **{k: [v] for k, v in out.items()},
        "attention_mask": [[1] * len(out["input_ids"])],
        "model_version": min(e["model_version"] for e in examples),
        "sentinel": sentinel,
        "padding": padding,
        "is_packed": True,
        "seq_boundaries": bounds,
        "pixel_values": None,
        "image_grid_thw": None,
    }


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    return path
