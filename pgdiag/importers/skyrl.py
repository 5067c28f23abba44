"""SkyRL preset: ``trainer.dump_data_batch=true`` writes
``<export_path>/dumped_data/global_step_<N>_training_input.pkl``, a plain pickle of ``TrainingInputBatch``.

The pickle names three globals (``_rebuild_tensor_batch``, ``TrainingInputBatch``, ``torch.device``); pgdiag
maps them to shims that keep the state: ``batch_dict`` (every tensor a ``{format: "numpy", data, shape,
dtype}`` record, or ``torch.save`` bytes for bf16) and ``metadata``. Layout: ``sequences`` and
``attention_mask`` (B, S) are left-padded; the response tensors (B, A) are right-aligned, the response of a row
in its last R columns, R = row sum of ``response_mask``. The last ``metadata["pad_size"]`` rows are copies of
row 0 with loss mask 0 (DP padding) and are dropped. ``rewards`` and ``uids`` are popped before the dump, so
there is no reward, and groups are the ``policy_prompt_boundaries`` row ranges.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.importers.alignment import from_padded, right_aligned_block, to_series
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout, count_note
from pgdiag.importers.ids import range_group_ids
from pgdiag.importers.safe_load import load_pickle

_MODULE = "skyrl.backends.skyrl_train.training_batch"
_FILE_NAME = re.compile(r"^global_step_(\d+)_training_input\.pkl$")
_STREAMS = {
    "rollout_logprobs": "rollout_logprobs",
    "action_log_probs": "old_logprobs",
    "base_action_log_probs": "ref_logprobs",
    "advantages": "advantages",
}


class _BatchState:
    """What ``_rebuild_tensor_batch(cls, state)`` rebuilds: the pickled state, no SkyRL code."""

    def __init__(self, cls: Any, state: Any) -> None:
        self.cls = cls
        self.state = state


class _TrainingInputBatch:
    """Stand-in for the class argument of ``_rebuild_tensor_batch``; never instantiated."""


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


def allow_list() -> dict[str, Any]:
    return {
        f"{_MODULE}._rebuild_tensor_batch": _BatchState,
        f"{_MODULE}.TrainingInputBatch": _TrainingInputBatch,
        "torch.device": _device,
    }


def _tensor(record: Any, path: Path, key: str) -> np.ndarray:
    """One serialized tensor record as a numpy array (bf16 ``torch.save`` bytes widened to float32)."""
    if not isinstance(record, Mapping):
        raise bad_layout(path, key, "a serialized tensor record")
    if record.get("format") == "torch":
        import torch

        try:
            value = torch.load(io.BytesIO(record["data"]), weights_only=True, map_location="cpu")
        except Exception as exc:  # torch raises several types for a bad archive
            raise bad_layout(path, key, f"torch.save bytes of a tensor ({type(exc).__name__})") from exc
        return value.float().numpy() if value.is_floating_point() else value.numpy()
    try:
        array = np.frombuffer(record["data"], dtype=np.dtype(record["dtype"]))
        return array.reshape(tuple(record["shape"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise bad_layout(path, key, "a {format: numpy, data, shape, dtype} record of matching size") from exc


def _unpack(path: Path, options: ImportOptions) -> tuple[dict[str, np.ndarray | None], dict[str, Any], bool]:
    loaded = load_pickle(path, allow_list(), allow_unsafe=options.allow_unsafe_pickle)
    value = loaded.value
    if loaded.unsafe_load:  # the real TrainingInputBatch: a dict of tensors with .metadata
        arrays = {
            k: None if v is None else v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in value.items()
            if hasattr(v, "numpy") or v is None
        }
        return arrays, dict(value.metadata or {}), True
    if not isinstance(value, _BatchState) or not isinstance(value.state, Mapping):
        raise bad_layout(path, "pickle", "a TrainingInputBatch")
    batch = value.state.get("batch_dict")
    if not isinstance(batch, Mapping):
        raise bad_layout(path, "batch_dict", "a dict of serialized tensors")
    arrays: dict[str, np.ndarray | None] = {}
    for key, record in batch.items():
        if record is None:
            arrays[key] = None
        elif isinstance(record, Mapping) and record.get("format") == "tensor_list":
            continue  # multimodal inputs (pixel_values): not per-token data
        else:
            arrays[key] = _tensor(record, path, key)
    return arrays, dict(value.state.get("metadata") or {}), False


def _require(arrays: Mapping[str, np.ndarray | None], key: str, path: Path, ndim: int = 2) -> np.ndarray:
    value = arrays.get(key)
    if value is None or value.ndim != ndim:
        raise bad_layout(path, key, f"a {ndim}-D tensor")
    return value


def _read_file(path: Path, step: int, options: ImportOptions) -> ImportedStep:
    arrays, metadata, unsafe = _unpack(path, options)
    sequences = _require(arrays, "sequences", path)
    attention = _require(arrays, "attention_mask", path)
    response_mask = _require(arrays, "response_mask", path)
    loss_block = _require(arrays, "loss_mask", path)
    n_rows, width = sequences.shape
    if attention.shape != sequences.shape:
        raise bad_layout(path, "attention_mask", f"shape {sequences.shape} like sequences")
    resp_width = response_mask.shape[1]
    for key in ("loss_mask", *_STREAMS):
        value = arrays.get(key)
        if value is not None and value.shape != (n_rows, resp_width):
            raise bad_layout(
                path, key, f"shape ({n_rows}, {resp_width}) like response_mask, got {value.shape}"
            )
    pad_size = int(metadata.get("pad_size", 0) or 0)
    if not 0 <= pad_size < n_rows:
        raise bad_layout(path, "metadata.pad_size", f"0 <= pad_size < {n_rows} rows")
    kept = n_rows - pad_size
    seq_lens = attention[:kept].astype(bool).sum(axis=1).astype(np.int64)  # (B,) T
    resp_lens = response_mask[:kept].astype(bool).sum(axis=1).astype(np.int64)  # (B,) R
    # left padding: the real tokens are the last T columns, the response the last R response columns
    cols = np.arange(width)[None, :]
    if not np.array_equal(attention[:kept].astype(bool), cols >= (width - seq_lens)[:, None]):
        bad = int(
            np.flatnonzero((attention[:kept].astype(bool) != (cols >= (width - seq_lens)[:, None])).any(1))[0]
        )
        raise bad_layout(
            path, "attention_mask", "left padding (zeros, then ones to the last column)", row=bad
        )
    rcols = np.arange(resp_width)[None, :]
    if not np.array_equal(response_mask[:kept].astype(bool), rcols >= (resp_width - resp_lens)[:, None]):
        bad = int(
            np.flatnonzero(
                (response_mask[:kept].astype(bool) != (rcols >= (resp_width - resp_lens)[:, None])).any(1)
            )[0]
        )
        raise bad_layout(path, "response_mask", "a right-aligned block of ones", row=bad)
    if np.any(resp_lens >= seq_lens):
        bad = int(np.flatnonzero(resp_lens >= seq_lens)[0])
        raise bad_layout(path, "response_mask", "fewer response tokens than sequence tokens", row=bad)
    prompt_lens = seq_lens - resp_lens
    ids = from_padded(sequences[:kept], seq_lens, start=width - seq_lens, source=str(path), field="sequences")
    mask = right_aligned_block(loss_block[:kept] != 0, prompt_lens, resp_lens, seq_lens)
    columns = [
        to_series("input_ids", ids, pl.List(pl.Int32)),
        to_series(
            "loss_mask", FlatList(mask.offsets, mask.values & mask.valid, None, None), pl.List(pl.Boolean)
        ),
        pl.Series("prompt_len", prompt_lens, dtype=pl.Int32),
    ]
    fields: dict[str, str] = {}
    for key, column in _STREAMS.items():
        block = arrays.get(key)
        if block is None:
            continue
        if key == "rollout_logprobs" and np.any(block[:kept][rcols < (resp_width - resp_lens)[:, None]] != 0):
            # SkyRL fills the rollout block from zeros: a value left of the block is a shifted stream
            bad = int(
                np.flatnonzero(((block[:kept] != 0) & (rcols < (resp_width - resp_lens)[:, None])).any(1))[0]
            )
            raise bad_layout(
                path, key, "0.0 left of the row's last R response columns (shifted stream?)", row=bad
            )
        flat = right_aligned_block(block[:kept].astype(np.float32), prompt_lens, resp_lens, seq_lens)
        columns.append(to_series(column, flat, pl.List(pl.Float32)))
        if column != "advantages":
            fields[column] = key
    boundaries = metadata.get("policy_prompt_boundaries")
    group_by = "prompt"
    if boundaries:
        starts = [int(b[0]) for b in boundaries]
        ends = [int(b[1]) for b in boundaries]
        if starts[0] != 0 or ends[-1] != kept or starts[1:] != ends[:-1]:
            raise bad_layout(
                path, "metadata.policy_prompt_boundaries", f"contiguous row ranges covering 0..{kept}"
            )
        columns.append(range_group_ids(step, np.array([0, *ends])))
        group_by = "field"
    warnings = count_note(step, pad_size, "padding rows dropped (pad_size)")
    return ImportedStep(
        step=step,
        rows=pl.DataFrame(columns),
        src_files=(str(path),),
        framework="skyrl",
        default_group_by=group_by,
        stream_fields=fields,
        unsafe_load=unsafe,
        warnings=warnings,
    )


def _read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    if src.is_file():
        files = [src]
    else:
        folder = src / "dumped_data" if (src / "dumped_data").is_dir() else src
        files = list(folder.glob("global_step_*_training_input.pkl"))
    found = sorted((int(m.group(1)), p) for p in files if (m := _FILE_NAME.match(p.name)))
    if not found:
        raise bad_layout(
            src, "dumped_data", "files global_step_<N>_training_input.pkl (trainer.dump_data_batch=true)"
        )
    for step, path in found:
        yield _read_file(path, step, options)


PRESET = Preset("skyrl", "SkyRL dumped_data/global_step_<N>_training_input.pkl", _read)
