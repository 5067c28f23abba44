"""Fast-LLM preset: capture files ``capture_<step>.jsonl`` written by ``python -m pgdiag.capture fast-llm``.

Fast-LLM reads its training documents from a Redis stream and writes none to disk; the capture keeps one JSON
line per message: ``tokens`` (int64 little-endian), ``old_log_probabilities`` (float32) and ``model_version``
(int64, one per token), each standard base64 of the raw bytes or a JSON list of numbers, and ``data`` (the JSON
string the producer sent, or an object) with ``loss_masking_spans``, ``advantage`` and ``reward``.
``capture_<S>.jsonl.partial`` (an incomplete last block) is skipped.

Mapping (Fast-LLM 7d61a1ba): ids = ``tokens``; the loss mask is every position >= 1 outside every
``[begin, end)`` of ``loss_masking_spans`` (Fast-LLM masks the spans and each document's first token);
``old_log_probabilities`` -> rollout (token-aligned); ``advantage`` -> ``advantage`` and, broadcast,
``advantages``; ``reward``; ``model_version`` -> ``policy_version_tok``. Groups by prompt; sample ids
``"{step}:{line}"``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.importers.alignment import from_rows, to_series
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout
from pgdiag.importers.jsonl_lines import read_lines

_FILE_NAME = re.compile(r"^capture_(\d+)\.jsonl$")
_WIDTHS = {"tokens": ("<i8", 8), "old_log_probabilities": ("<f4", 4), "model_version": ("<i8", 8)}


def byte_field(value: Any, name: str, path: Path, line: int) -> np.ndarray:
    """A per-token field from base64 of its raw little-endian bytes, or from a JSON list of numbers."""
    dtype, width = _WIDTHS[name]
    if isinstance(value, list):
        try:
            return np.asarray(value, dtype=np.float32 if name == "old_log_probabilities" else np.int64)
        except (TypeError, ValueError) as exc:
            raise bad_layout(path, name, f"a list of numbers (line {line})") from exc
    if not isinstance(value, str):
        raise bad_layout(path, name, f"base64 text or a list of numbers (line {line})")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_layout(path, name, f"standard padded base64 (line {line})") from exc
    if len(raw) % width:
        raise bad_layout(
            path, name, f"a multiple of {width} bytes ({dtype[1:]} per token), got {len(raw)} (line {line})"
        )
    return np.frombuffer(raw, dtype=dtype)


def _data(value: Any, path: Path, line: int) -> Mapping[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_layout(path, "data", f"a JSON object string (line {line})") from exc
    if not isinstance(value, Mapping):
        raise bad_layout(path, "data", f"a JSON object (line {line})")
    return value


def _loss_mask(n: int, spans: Any, path: Path, line: int) -> np.ndarray:
    mask = np.ones(n, dtype=bool)
    mask[:1] = False  # a document's first token has no context
    for span in spans or ():
        if not isinstance(span, list | tuple) or len(span) != 2:
            raise bad_layout(path, "data.loss_masking_spans", f"[begin, end) pairs (line {line})")
        begin, end = int(span[0]), int(span[1])
        if not 0 <= begin <= end <= n:
            raise bad_layout(path, "data.loss_masking_spans", f"spans inside 0..{n} (line {line})")
        mask[begin:end] = False
    return mask


def _read_file(path: Path, step: int) -> ImportedStep:
    ids, masks, lps, versions, advantages = [], [], [], [], []
    adv_scalar: list[float | None] = []
    rewards: list[float | None] = []
    for line, message in read_lines(path):
        if not isinstance(message, Mapping) or "tokens" not in message:
            raise bad_layout(path, f"line {line}", "a captured message with tokens")
        tokens = byte_field(message["tokens"], "tokens", path, line)
        n = tokens.shape[0]
        fields = {}
        for name in ("old_log_probabilities", "model_version"):
            if message.get(name) is not None:
                fields[name] = byte_field(message[name], name, path, line)
                if fields[name].shape[0] != n:
                    raise bad_layout(
                        path,
                        name,
                        f"{n} values like tokens, got {fields[name].shape[0]} (int32-packed tokens?) (line {line})",
                    )
        data = _data(message.get("data"), path, line)
        ids.append(tokens.astype(np.int64))
        masks.append(_loss_mask(n, data.get("loss_masking_spans"), path, line))
        lps.append(fields.get("old_log_probabilities"))
        versions.append(fields.get("model_version"))
        advantage = data.get("advantage")
        adv_scalar.append(None if advantage is None else float(advantage))
        advantages.append(None if advantage is None else np.full(n, advantage, dtype=np.float32))
        rewards.append(None if data.get("reward") is None else float(data["reward"]))
    if not ids:
        raise bad_layout(path, "file", "at least one captured message")
    columns = [
        to_series("input_ids", from_rows(ids, np.int64), pl.List(pl.Int32)),
        to_series("loss_mask", from_rows(masks, bool), pl.List(pl.Boolean)),
        pl.Series("sample_id", [f"{step}:{k}" for k in range(len(ids))], dtype=pl.String),
    ]
    for name, rows, dtype, source in (
        ("rollout_logprobs", lps, pl.List(pl.Float32), "old_log_probabilities"),
        ("policy_version_tok", versions, pl.List(pl.Int64), "model_version"),
        ("advantages", advantages, pl.List(pl.Float32), "data.advantage"),
    ):
        present = [r is not None for r in rows]
        if any(present) and not all(present):
            raise bad_layout(
                path, source, f"on every message or on none (missing on line {present.index(False) + 1})"
            )
        if all(present):
            columns.append(
                to_series(
                    name, from_rows(rows, np.int64 if name == "policy_version_tok" else np.float32), dtype
                )
            )
    if any(a is not None for a in adv_scalar):
        columns.append(pl.Series("advantage", adv_scalar, dtype=pl.Float32))
    if any(r is not None for r in rewards):
        columns.append(pl.Series("reward", rewards, dtype=pl.Float32))
    return ImportedStep(
        step=step,
        rows=pl.DataFrame(columns),
        src_files=(str(path),),
        framework="fast-llm",
        default_group_by="prompt",
        stream_fields={"rollout_logprobs": "old_log_probabilities"},
    )


def _read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    files = [src] if src.is_file() else list(src.glob("capture_*.jsonl"))
    found = sorted((int(m.group(1)), p) for p in files if (m := _FILE_NAME.match(p.name)))
    if not found:
        raise bad_layout(src, "capture", "files capture_<step>.jsonl (python -m pgdiag.capture fast-llm)")
    for step, path in found:
        yield _read_file(path, step)


PRESET = Preset("fast-llm", "Fast-LLM capture files capture_<S>.jsonl", _read)
