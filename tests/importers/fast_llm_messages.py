"""Fast-LLM stream messages as its producer side encodes them (ServiceNow/Fast-LLM 7d61a1ba
``RedisStreamingDocumentData.to_message``): ``tokens`` int64 bytes, ``old_log_probabilities`` float32 bytes,
``model_version`` int64 bytes, and ``data`` the ``json.dumps`` of the spans, advantage and reward."""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def to_message(
    tokens: list[int],
    old_log_probabilities: list[float] | None = None,
    model_version: list[int] | None = None,
    *,
    loss_masking_spans: list[tuple[int, int]] | None = None,
    advantage: float | None = None,
    reward: float | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"tokens": np.asarray(tokens, dtype=np.int64).tobytes()}
    if old_log_probabilities is not None:
        message["old_log_probabilities"] = np.asarray(old_log_probabilities, dtype=np.float32).tobytes()
    if model_version is not None:
        message["model_version"] = np.asarray(model_version, dtype=np.int64).tobytes()
    data: dict[str, Any] = {}
    if loss_masking_spans is not None:
        data["loss_masking_spans"] = [list(s) for s in loss_masking_spans]
    if advantage is not None:
        data["advantage"] = advantage
    if reward is not None:
        data["reward"] = reward
    if data:
        message["data"] = json.dumps(data)
    return message


# four documents: prompt span [0, P) masked, GRPO fields set
DOCS = [
    dict(tokens=[5, 6, 7, 100, 101], lps=[0.0, -9.0, -8.0, -0.5, -0.25], version=[3, 3, 3, 3, 3], spans=[(0, 3)], adv=0.5, reward=1.0),
    dict(tokens=[5, 6, 7, 102, 103, 104], lps=[0.0, -9.0, -8.0, -1.0, -0.125, -2.0], version=[3] * 6, spans=[(0, 3)], adv=-0.5, reward=0.0),
    dict(tokens=[8, 9, 110], lps=[0.0, -7.0, -0.0625], version=[4, 4, 4], spans=[(0, 2)], adv=0.25, reward=0.75),
    dict(tokens=[8, 9, 111, 112], lps=[0.0, -7.0, -3.0, -0.75], version=[4, 4, 4, 5], spans=[(0, 2)], adv=-0.25, reward=0.25),
]  # fmt: skip


def doc_messages() -> list[dict[str, Any]]:
    return [
        to_message(
            d["tokens"],
            d["lps"],
            d["version"],
            loss_masking_spans=d["spans"],
            advantage=d["adv"],
            reward=d["reward"],
        )
        for d in DOCS
    ]
