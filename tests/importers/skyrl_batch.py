"""SkyRL ``TrainingInputBatch`` dump files as SkyRL a9564572 writes them, for the preset tests.

SkyRL does not import on Python 3.11 without its heavy dependencies, so its pickle is rebuilt here: a module
registered as ``skyrl.backends.skyrl_train.training_batch`` whose ``TrainingInputBatch`` (a dict subclass)
pickles through ``__reduce__`` -> ``(_rebuild_tensor_batch, (cls, state))`` with every tensor serialized as a
``{format: "numpy", data, shape, dtype}`` record (``torch.save`` bytes under ``format: "torch"`` for bf16),
``device`` a ``torch.device`` and ``metadata`` a dict, and ``save`` is ``pickle.dump``. The tensors are laid
out as ``convert_prompts_responses_to_batch_tensors`` does (left-padded sequences, right-aligned response
block) and padded as ``pad_training_input_batch`` does (copies of row 0, loss mask 0, ``pad_size``).
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import torch

MODULE = "skyrl.backends.skyrl_train.training_batch"


def _serialize(value: torch.Tensor) -> dict[str, Any]:
    try:
        array = value.numpy()
        return {"format": "numpy", "data": array.tobytes(), "shape": array.shape, "dtype": str(array.dtype)}
    except TypeError:  # bf16 has no numpy dtype
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"format": "torch", "data": buffer.getvalue()}


def _rebuild_tensor_batch(cls: type, state: dict[str, Any]) -> Any:  # pragma: no cover - never unpickled here
    obj = dict.__new__(cls)
    obj.update(state["batch_dict"])
    obj.metadata = state["metadata"]
    return obj


class TrainingInputBatch(dict):
    metadata: dict[str, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        state = {
            "batch_dict": {k: None if v is None else _serialize(v) for k, v in self.items()},
            "batch_size": len(self["sequences"]),
            "device": torch.device("cpu"),
            "metadata": self.metadata,
        }
        return (_rebuild_tensor_batch, (type(self), state))

    def save(self, path: Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f)


def install_module() -> types.ModuleType:
    """Register the module under SkyRL's name so pickle writes SkyRL's global names."""
    module = types.ModuleType(MODULE)
    for obj in (_rebuild_tensor_batch, TrainingInputBatch):
        obj.__module__ = MODULE
        setattr(module, obj.__name__, obj)
    for name in ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[MODULE] = module
    return module


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    loss_masks: list[list[int]],
    streams: dict[str, list[list[float]]],
    *,
    uids: list[str],
    dp_size: int,
    pad_token_id: int = 0,
    bf16: tuple[str, ...] = (),
) -> TrainingInputBatch:
    """A padded TrainingInputBatch as the trainer dumps it (``rewards`` and ``uids`` already popped)."""
    n = len(prompts)
    max_total = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    max_resp = max(len(r) for r in responses)
    sequences = torch.full((n, max_total), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((n, max_total), dtype=torch.int64)
    response_mask = torch.zeros((n, max_resp), dtype=torch.int64)
    loss = torch.zeros((n, max_resp), dtype=torch.float32)
    blocks = {k: torch.zeros((n, max_resp), dtype=torch.float32) for k in streams}
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        start = max_total - len(p) - len(r)
        sequences[i, start:] = torch.tensor(p + r)
        attention[i, start:] = 1
        response_mask[i, max_resp - len(r) :] = 1
        loss[i, max_resp - len(r) :] = torch.tensor(loss_masks[i], dtype=torch.float32)
        for k, rows in streams.items():
            blocks[k][i, max_resp - len(r) :] = torch.tensor(rows[i])
    tensors: dict[str, torch.Tensor | None] = {
        "sequences": sequences,
        "attention_mask": attention,
        "response_mask": response_mask,
        "loss_mask": loss,
        **{k: (v.to(torch.bfloat16) if k in bf16 else v) for k, v in blocks.items()},
        "values": None,
        "rollout_expert_indices": None,
        "router_padding_mask": None,
        "pixel_values": None,
        "image_grid_thw": None,
    }
    boundaries = []
    start = 0
    for i in range(1, n + 1):
        if i == n or uids[i] != uids[i - 1]:
            boundaries.append((start, i))
            start = i
    pad_size = -n % dp_size
    for key, value in tensors.items():
        if value is None:
            continue
        if key == "loss_mask":
            tensors[key] = torch.cat([value, torch.zeros((pad_size, *value.shape[1:]), dtype=value.dtype)])
        else:
            tensors[key] = torch.cat([value, value[[0] * pad_size]])
    batch = TrainingInputBatch(tensors)
    batch.metadata = {
        "policy_mini_batch_boundaries": [(0, n)],
        "policy_prompt_boundaries": boundaries,
        "response_length": max_resp,
        "avg_response_length": sum(len(r) for r in responses) / n,
        "pad_size": pad_size,
    }
    return batch
