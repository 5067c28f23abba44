"""miles preset: ``--dump-details D`` writes ``D/rollout_data/<id>.pt``, ``D/train_data/<id>_<rank>.pt`` and,
when polars is installed, ``D/dashboard_columns/rollout_<id>.parquet``.

The rollout dump is slime's (`pgdiag.importers.slime`) plus a ``metadata`` dict; samples may carry
``AdapterRef`` and ``RewardSpec`` frozen dataclasses, read as records. Every rank writes its own train file:
``rollout_data`` is column-oriented (one list entry per sample of that DP shard) with ``sample_indices``
(``Sample.index``), ``log_probs`` (old, present only when recomputed), ``ref_log_probs`` and ``advantages``,
response-aligned. TP peers repeat the same rows and non-last pipeline stages lack ``log_probs``, so rows are
de-duplicated on ``sample_indices`` (peers that disagree: E703). Context parallelism (``cp_size`` > 1) keeps
each rank's slice only: E703. SRC may also be ``dashboard_columns/`` alone: tokens, loss mask and rollout
log-probs, no reward, status or groups (grouped by prompt).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.importers.alignment import from_rows
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout
from pgdiag.importers.pt_reader import load_pt_lists
from pgdiag.importers.safe_load import numpy_allow_list, record_shim
from pgdiag.importers.slime import (
    RolloutSamples,
    base_rows,
    float_row,
    read_rollout_samples,
    rollout_files,
    rollout_id_of,
)
from pgdiag.importers.step_rows import field_or_prompt

_TRAIN_NAME = re.compile(r"^(\d+)_(\d+)\.pt$")
_DASHBOARD_NAME = re.compile(r"^rollout_(\d+)\.parquet$")
_TRAIN_STREAMS = {"log_probs": "old_logprobs", "ref_log_probs": "ref_logprobs", "advantages": "advantages"}
_FIELDS = {
    "rollout_logprobs": "rollout_log_probs",
    "old_logprobs": "log_probs",
    "ref_logprobs": "ref_log_probs",
}


def allow_list() -> dict[str, Any]:
    """numpy (routing replay arrays) plus miles' two frozen dataclasses, read as records."""
    return {
        **numpy_allow_list(),
        "miles.utils.types.AdapterRef": record_shim("miles.utils.types.AdapterRef"),
        "miles.utils.types.RewardSpec": record_shim("miles.utils.types.RewardSpec"),
    }


def _values_equal(a: Any, b: Any) -> bool:
    return np.array_equal(
        np.asarray(a.float() if hasattr(a, "float") else a),
        np.asarray(b.float() if hasattr(b, "float") else b),
    )


def _train_rows(
    samples: RolloutSamples, paths: list[Path], options: ImportOptions
) -> tuple[dict[str, FlatList], list[Any] | None, bool]:
    """{canonical column: response-aligned rows} from every rank file of one rollout, de-duplicated; the
    batch-global ``raw_reward`` when recorded; whether a file went through the unsafe escape."""
    index_to_row = {int(s): r for r, s in enumerate(samples.frame["sample_id"].to_list())}
    found: dict[str, dict[int, tuple[Any, Path]]] = {key: {} for key in _TRAIN_STREAMS}
    unsafe = False
    raw_reward = None
    for path in paths:
        loaded = load_pt_lists(path, allow_list(), allow_unsafe=options.allow_unsafe_pickle)
        unsafe = unsafe or loaded.unsafe_load
        payload = loaded.value
        data = payload.get("rollout_data") if isinstance(payload, Mapping) else None
        if not isinstance(data, Mapping) or "sample_indices" not in data:
            raise bad_layout(path, "rollout_data", "a dict of per-sample columns with sample_indices")
        if int(payload.get("cp_size", 1) or 1) > 1:
            raise bad_layout(
                path,
                "cp_size",
                "1 (each context-parallel rank keeps a slice); re-dump without context parallelism",
            )
        indices = [int(i) for i in np.asarray(data["sample_indices"]).reshape(-1).tolist()]
        if isinstance(data.get("raw_reward"), list | tuple) and len(data["raw_reward"]) == len(index_to_row):
            raw_reward = list(data["raw_reward"])  # batch-global, in rollout-dump order
        for key in _TRAIN_STREAMS:
            column = data.get(key)
            if column is None:
                continue
            if len(column) != len(indices):
                raise bad_layout(path, key, f"{len(indices)} entries (one per sample_indices)")
            for k, (index, value) in enumerate(zip(indices, column, strict=True)):
                if index not in index_to_row:
                    raise bad_layout(
                        path, "sample_indices", "the index of a sample in the rollout dump", row=k
                    )
                seen = found[key].get(index)
                if seen is not None and not _values_equal(seen[0], value):
                    raise bad_layout(
                        path, key, f"the same values as {seen[1].name} for sample_index {index}", row=k
                    )
                found[key][index] = (value, path)
    flats: dict[str, FlatList] = {}
    n_rows = samples.response_lens.shape[0]
    for key, by_index in found.items():
        if not by_index:
            continue
        rows: list[np.ndarray] = []
        valid: list[np.ndarray] = []
        for r in range(n_rows):
            n_resp = int(samples.response_lens[r])
            index = int(samples.frame["sample_id"][r])
            if index in by_index:
                value, path = by_index[index]
                rows.append(float_row(value, n_resp, path, key, r))
                valid.append(np.ones(n_resp, dtype=bool))
            else:
                rows.append(np.zeros(n_resp, dtype=np.float32))
                valid.append(np.zeros(n_resp, dtype=bool))
        flat = from_rows(rows)
        mask = np.concatenate(valid) if valid else np.zeros(0, dtype=bool)
        flats[_TRAIN_STREAMS[key]] = FlatList(flat.offsets, flat.values, None if mask.all() else mask, None)
    return flats, raw_reward, unsafe


def _read_pt(dump_dir: Path, files: list[tuple[int, Path]], options: ImportOptions) -> Iterator[ImportedStep]:
    for file_id, path in files:
        loaded = load_pt_lists(path, allow_list(), allow_unsafe=options.allow_unsafe_pickle)
        step = rollout_id_of(loaded.value, path, file_id)
        samples = read_rollout_samples(path, loaded.value, step)
        train_paths = sorted(
            (p for p in (dump_dir / "train_data").glob(f"{file_id}_*.pt") if _TRAIN_NAME.match(p.name)),
            key=lambda p: int(_TRAIN_NAME.match(p.name).group(2)),  # type: ignore[union-attr]
        )
        streams: dict[str, FlatList] = {}
        raw_reward = None
        unsafe = loaded.unsafe_load
        if train_paths:
            if "sample_id" not in samples.frame.columns:
                raise bad_layout(path, "index", "Sample.index on every sample, to join the train files")
            streams, raw_reward, train_unsafe = _train_rows(samples, train_paths, options)
            unsafe = unsafe or train_unsafe
        rows = base_rows(samples, streams)
        if samples.dict_rewards and raw_reward is not None:  # the reward miles trained on
            values = [float(v) if isinstance(v, bool | int | float) else None for v in raw_reward]
            rows = rows.with_columns(pl.Series("reward", values, dtype=pl.Float32))
        yield ImportedStep(
            step=step,
            rows=rows,
            src_files=(str(path), *(str(p) for p in train_paths)),
            framework="miles",
            default_group_by=field_or_prompt(rows),
            stream_fields={k: v for k, v in _FIELDS.items() if k in rows.columns},
            unsafe_load=unsafe,
        )


def _read_dashboard(folder: Path) -> Iterator[ImportedStep]:
    files = sorted(
        (int(m.group(1)), p) for p in folder.glob("*.parquet") if (m := _DASHBOARD_NAME.match(p.name))
    )
    if not files:
        raise bad_layout(folder, "dashboard_columns", "files rollout_<id>.parquet")
    for step, path in files:
        try:
            frame = pl.read_parquet(path)
        except Exception as exc:  # pyarrow/polars raise several types for a torn file
            raise bad_layout(path, "file", f"a complete Parquet file ({type(exc).__name__})") from exc
        needed = ("sample_index", "response_length", "tokens", "loss_mask", "rollout_log_probs")
        missing = [c for c in needed if c not in frame.columns]
        if missing:
            raise bad_layout(path, missing[0], "a dashboard_columns column")
        tokens = frame["tokens"].to_list()
        n_resp = frame["response_length"].to_list()
        records = []
        for r in range(frame.height):
            mask = frame["loss_mask"][r]
            lps = frame["rollout_log_probs"][r]
            records.append(
                {
                    "index": frame["sample_index"][r],
                    "group_index": None,
                    "tokens": tokens[r],
                    "response_length": n_resp[r],
                    "loss_mask": None if mask is None else mask.to_list(),
                    "rollout_log_probs": None if lps is None else lps.to_list(),
                }
            )
        samples = read_rollout_samples(path, {"samples": records}, step)
        # the Parquet mirror has ids only: no group, reward, status or version columns
        samples = dataclasses.replace(samples, frame=samples.frame.select(pl.col("^sample_id$")))
        rows = base_rows(samples, {})
        yield ImportedStep(
            step=step,
            rows=rows,
            src_files=(str(path),),
            framework="miles",
            default_group_by="prompt",
            stream_fields={"rollout_logprobs": "rollout_log_probs"},
        )


def _read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    if src.is_dir() and not (src / "rollout_data").is_dir():
        dashboard = src / "dashboard_columns" if (src / "dashboard_columns").is_dir() else src
        if any(_DASHBOARD_NAME.match(p.name) for p in dashboard.glob("*.parquet")):
            yield from _read_dashboard(dashboard)
            return
    dump_dir, files = rollout_files(src)
    yield from _read_pt(dump_dir, files, options)


PRESET = Preset("miles", "miles rollout_data/, train_data/ .pt or dashboard_columns/", _read)
