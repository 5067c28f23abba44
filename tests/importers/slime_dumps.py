"""slime / miles dump files as the frameworks write them (checked against THUDM/slime 624b824a and
radixark/miles 31f1ca96), for the preset tests.

Neither framework is on PyPI, so the records are rebuilt field for field: `sample_record` is what
``Sample.to_dict()`` returns (every dataclass field, ``status`` as its string value, ``spec_info`` and
``prefix_cache_info`` as dicts), `slime_train_payload` is what ``_build_dump_payload`` makes of the gathered
DP shards, and files are written with ``torch.save`` as both frameworks do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def sample_record(
    *,
    index: int,
    group_index: int,
    tokens: list[int],
    response_length: int,
    rollout_log_probs: list[float] | None,
    loss_mask: list[int] | None = None,
    reward: Any = 1.0,
    status: str = "completed",
    weight_versions: tuple[str, ...] = ("3",),
    remove_sample: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``Sample.to_dict()`` of slime 624b824a (miles adds ``adapter``, ``reward_spec`` via `extra`)."""
    record = {
        "group_index": group_index,
        "index": index,
        "rollout_id": None,
        "prompt": "question?",
        "tokens": list(tokens),
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {},
        "response": "answer",
        "response_length": response_length,
        "label": "42",
        "reward": reward,
        "loss_mask": loss_mask,
        "weight_versions": list(weight_versions),
        "rollout_log_probs": rollout_log_probs,
        "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None,
        "rollout_routed_experts": None,
        "remove_sample": remove_sample,
        "teacher_log_probs": None,
        "status": status,
        "metadata": {},
        "generate_function_path": None,
        "custom_rm_path": None,
        "train_metadata": None,
        "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": {
            "spec_accept_token_num": 0,
            "spec_draft_token_num": 0,
            "spec_verify_ct": 0,
            "completion_token_num": 0,
        },
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
    }
    record.update(extra or {})
    return record


def write_rollout_dump(path: Path, rollout_id: int, samples: list[dict[str, Any]], **top: Any) -> Path:
    """``torch.save({"rollout_id": id, "samples": [...]})`` (miles adds ``metadata`` through `top`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rollout_id, **top, "samples": samples}, path)
    return path


def slime_train_payload(
    rollout_id: int, shards: list[dict[str, Any]], *, raw_reward: list[Any] | None = None
) -> dict[str, Any]:
    """The ``format_version`` 2 train dump built from per-DP-rank ``rollout_data`` dicts.

    Each shard's ``rollout_data`` holds per-sample lists (``tokens``, ``response_lengths``, ``log_probs``, ...),
    ``partition`` (positions in the rollout dump) and ``sample_indices`` (``Sample.index``) plus layout keys
    (``micro_batch_indices``, ``num_microbatches``, ``global_batch_sizes``). As slime does, per-sample columns
    are transposed into one dict per sample, sorted by rollout position; layout keys stay in ``dp_shards``.
    """
    samples: list[dict[str, Any]] = []
    layout: list[dict[str, Any]] = []
    for dp_rank, data in enumerate(shards):
        n_local = len(data["response_lengths"])
        shard = {
            "rank": dp_rank * 2,
            "data_parallel_rank": dp_rank,
            "sample_indices": list(data["sample_indices"]),
            "partition": list(data["partition"]),
        }
        columns = {}
        for key, value in data.items():
            if key in ("sample_indices", "partition"):
                continue
            if key in ("micro_batch_indices", "num_microbatches", "global_batch_sizes"):
                shard[key] = value
            elif isinstance(value, list) and len(value) == n_local:
                columns[key] = value
            else:
                shard[key] = value
        for i in range(n_local):
            sample = {
                "data_parallel_rank": dp_rank,
                "sample_index": data["sample_indices"][i],
                "rollout_position": data["partition"][i],
            }
            sample.update({key: column[i] for key, column in columns.items()})
            samples.append(sample)
        layout.append(shard)
    samples.sort(key=lambda s: s["rollout_position"])
    payload = {
        "format_version": 2,
        "rollout_id": rollout_id,
        "rank": 0,
        "samples": samples,
        "dp_shards": layout,
    }
    if raw_reward is not None:
        payload["raw_reward"] = raw_reward
    return payload


def tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


class Hostile:
    """A pickled object whose ``__reduce__`` would create `marker` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def top_p_tape(spans: list[list[int] | int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rollout_top_p_token_ids, rollout_top_p_token_offsets)`` as slime 624b824a builds them (int32
    tensors): each list is the kept set SGLang returned for one generated token (``top_p_token_ids`` /
    ``_offsets`` meta info, appended turn by turn), each int a run of that many tool tokens, given empty
    spans (slime's ``_pad_rollout_top_p_offsets``). Offsets: one per response token, plus one."""
    ids: list[int] = []
    offsets = [0]
    for span in spans:
        if isinstance(span, int):
            offsets += [offsets[-1]] * span
            continue
        ids += span
        offsets.append(offsets[-1] + len(span))
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32)
