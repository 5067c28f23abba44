"""Preset ``verl``: files written by `pgdiag.capture.verl`, or RolloutSkip's ``gen_batch.dp`` (verl 0.9.1).

Hook files: prompt = the `prompt_lengths` last tokens of left-padded `prompts`, response = the first
`response_lengths` columns of `responses`; `response_mask` → loss_mask; `rollout_log_probs` → rollout,
`old_log_probs` → old (W702: dropped when it is a copy of rollout, as bypass mode writes it),
`ref_log_prob` → ref, `advantages` (response-aligned); reward = row sum of `token_level_scores`;
``extra.<key>`` lists → reward_components; `data_source` → env; `min_global_steps` → policy_version. Ids:
group = `uid`; the v1 `key` ``{uid}_{session_id}_{index}`` gives sample ``{uid}_{session_id}`` and
segment_idx `index`; else `request_id`; else ``"{step}:{row}"``.

RolloutSkip (``skip.rollout.enable=true``, legacy trainer): ``<step>/gen_batch.dp`` + ``meta.json`` anywhere
under SRC. ``DataProto.save_to_disk`` is a plain pickle; it is read with an allow-list of pgdiag shims
(``verl.protocol.DataProto`` as a record of its state ``(batch bytes, non_tensor_batch, meta_info)``, numpy's
array globals) and the batch bytes with ``weights_only=True`` plus one shim for tensordict's consolidated
storage, which cuts the single uint8 storage by its ``leaves`` table. Generation output only: ids,
`response_mask`, rollout; no old, ref, advantages or reward.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.errors import Code
from pgdiag.importers import alignment
from pgdiag.importers.base import (
    DegenerateStream,
    ImportedStep,
    ImportOptions,
    Preset,
    bad_layout,
    unsafe_global,
)
from pgdiag.importers.hookdump import HookFile, hook_sampling, int_lengths, read_hook_steps
from pgdiag.importers.safe_load import load_pickle, numpy_allow_list, record_shim
from pgdiag.importers.step_rows import field_or_prompt

REQUIRED = ("prompts", "responses", "response_mask", "prompt_lengths", "response_lengths")
STREAMS = {
    "rollout_log_probs": "rollout_logprobs",
    "old_log_probs": "old_logprobs",
    "ref_log_prob": "ref_logprobs",
}
GEN_BATCH = "gen_batch.dp"
TENSORDICT_REBUILD = "tensordict._reductions._rebuild_tensordict_files_consolidated"
_BYPASS = DegenerateStream(
    Code.STREAM_COPIED,
    "old_logprobs",
    "rollout_logprobs",
    "old_log_probs is a copy of rollout_log_probs on every loss position "
    "(algorithm.rollout_correction.bypass_mode); old dropped",
)


def read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """Yield one `ImportedStep` per step: hook files, or RolloutSkip ``gen_batch.dp`` dumps."""
    gen_batches = [src] if src.name == GEN_BATCH else sorted(src.rglob(GEN_BATCH)) if src.is_dir() else []
    if gen_batches:
        yield from _read_gen_batches(gen_batches, options)
        return
    if src.is_dir() and any(src.rglob("tq_batch.pt")):
        raise bad_layout(
            src, "tq_batch.pt", "hook files or gen_batch.dp (the v1 skip.rollout_tq dump is not read)"
        )
    for hook_step in read_hook_steps(src, "verl", REQUIRED, allow_unsafe=options.allow_unsafe_pickle):
        files = hook_step.files
        frames = [_hook_rows(file, hook_step.step) for file in files]
        columns = set.intersection(*(set(f.columns) for f in frames))
        frames = [f.select([c for c in f.columns if c in columns]) for f in frames]
        rows = pl.concat(frames, how="vertical")
        meta = files[0].meta
        yield ImportedStep(
            step=hook_step.step,
            rows=rows,
            src_files=tuple(str(f.path) for f in files),
            framework="verl",
            framework_version=files[0].framework_version,
            default_group_by=field_or_prompt(rows),
            stream_fields={c: f for f, c in STREAMS.items() if c in rows.columns},
            sampling=hook_sampling(meta, ("temperature", "top_p", "top_k", "logprobs_mode", "tempered")),
            unsafe_load=hook_step.unsafe_load,
            degenerate=(_BYPASS,) if {"old_logprobs", "rollout_logprobs"} <= set(rows.columns) else (),
        )


def _prompt_and_response(
    source: str,
    prompts: np.ndarray,
    responses: np.ndarray,
    prompt_lens: np.ndarray,
    response_lens: np.ndarray,
) -> tuple[FlatList, np.ndarray]:
    """Full rows of ids (left-padded prompts + right-padded responses) and their lengths T."""
    seq_lens = prompt_lens + response_lens
    prompt = alignment.from_padded(
        prompts, prompt_lens, start=prompts.shape[1] - prompt_lens, source=source, field="prompts"
    )
    response = alignment.from_padded(responses, response_lens, source=source, field="responses")
    head = alignment.response_aligned(prompt, np.zeros_like(prompt_lens), seq_lens)
    tail = alignment.response_aligned(response, prompt_lens, seq_lens)
    assert head.valid is not None
    return FlatList(head.offsets, np.where(head.valid, head.values, tail.values), None, None), seq_lens


def _response_column(
    source: str, block: np.ndarray, name: str, prompt_lens: np.ndarray, response_lens: np.ndarray, width: int
) -> FlatList:
    if block.ndim != 2 or block.shape != (len(prompt_lens), width):
        raise bad_layout(source, name, f"shape {(len(prompt_lens), width)} like responses, got {block.shape}")
    cut = alignment.from_padded(block, response_lens, source=source, field=name)
    return alignment.response_aligned(
        cut, prompt_lens, prompt_lens + response_lens, source=source, field=name
    )


def _base_columns(
    source: str, blocks: dict[str, np.ndarray], prompt_lens: np.ndarray, response_lens: np.ndarray
) -> tuple[dict[str, pl.Series], FlatList, np.ndarray]:
    """ids, loss_mask, prompt_len and the streams present in `blocks` (numpy arrays by verl field name)."""
    prompts, responses = blocks["prompts"], blocks["responses"]
    input_ids, seq_lens = _prompt_and_response(source, prompts, responses, prompt_lens, response_lens)
    width = responses.shape[1]
    mask = _response_column(
        source, blocks["response_mask"].astype(bool), "response_mask", prompt_lens, response_lens, width
    )
    assert mask.valid is not None
    loss_mask = FlatList(mask.offsets, mask.values & mask.valid, None, None)
    out = alignment.sequence_columns(input_ids, loss_mask, prompt_lens)
    for name, column in (*STREAMS.items(), ("advantages", "advantages")):
        if name in blocks:
            values = _response_column(
                source, blocks[name].astype(np.float32), name, prompt_lens, response_lens, width
            )
            out[column] = alignment.to_series(
                column, alignment.null_off_mask(values, loss_mask), pl.List(pl.Float32)
            )
    return out, loss_mask, seq_lens


def _hook_rows(file: HookFile, step: int) -> pl.DataFrame:
    source = str(file.path)
    blocks = {name: tensor.numpy() for name, tensor in file.tensors.items()}
    prompt_lens = int_lengths(file, "prompt_lengths", blocks["prompts"].shape[1])
    response_lens = int_lengths(file, "response_lengths", blocks["responses"].shape[1])
    out, _, _ = _base_columns(source, blocks, prompt_lens, response_lens)
    if "token_level_scores" in blocks:
        scores = blocks["token_level_scores"].astype(np.float64)
        cols = np.arange(scores.shape[1])
        in_response = cols[None, :] < response_lens[:, None]
        out["reward"] = pl.Series("reward", np.where(in_response, scores, 0.0).sum(axis=1), dtype=pl.Float32)
    lists = file.lists
    extra = sorted(name for name in lists if name.startswith("extra."))
    if extra:
        rows = [
            [{"key": name.removeprefix("extra."), "value": float(lists[name][r])} for name in extra]
            for r in range(len(prompt_lens))
        ]
        out["reward_components"] = pl.Series(
            "reward_components", rows, dtype=pl.List(pl.Struct({"key": pl.String, "value": pl.Float32}))
        )
    if "data_source" in lists:
        out["env"] = pl.Series("env", [str(v) for v in lists["data_source"]], dtype=pl.String)
    if "min_global_steps" in lists:
        out["policy_version"] = pl.Series("policy_version", lists["min_global_steps"], dtype=pl.Int64)
    if "uid" in lists:
        out["group_id"] = pl.Series("group_id", [str(v) for v in lists["uid"]], dtype=pl.String)
    if "key" in lists:
        sample, segment = [], []
        for r, key in enumerate(lists["key"]):
            head, _, index = str(key).rpartition("_")
            if not head or not index.isdigit():
                raise bad_layout(file.path, "lists.key", "{uid}_{session_id}_{index}", row=r)
            sample.append(head)
            segment.append(int(index))
        out["sample_id"] = pl.Series("sample_id", sample, dtype=pl.String)
        out["segment_idx"] = pl.Series("segment_idx", segment, dtype=pl.Int32)
    elif "request_id" in lists and all(v is not None for v in lists["request_id"]):
        out["sample_id"] = pl.Series("sample_id", [str(v) for v in lists["request_id"]], dtype=pl.String)
    return pl.DataFrame(list(out.values()))


# ---- RolloutSkip gen_batch.dp ----------------------------------------------------------------------------


def _rebuild_consolidated(source: str) -> Any:
    """Shim for tensordict's consolidated rebuild: a plain {name: tensor} cut from the one uint8 storage."""
    import torch

    def rebuild(metadata: Any, storage: Any) -> dict[str, Any]:
        if (
            not isinstance(metadata, dict)
            or not isinstance(storage, torch.Tensor)
            or storage.dtype != torch.uint8
        ):
            raise bad_layout(source, "batch", "a consolidated TensorDict (metadata, uint8 storage)")
        leaves = metadata.get("leaves")
        others = set(metadata) - {"cls", "non_tensors", "leaves", "cls_metadata", "size"}
        if not isinstance(leaves, dict) or metadata.get("non_tensors") or others:
            raise bad_layout(
                source, "batch", "a flat TensorDict of tensors (no nested or non-tensor entries)"
            )
        out = {}
        for name, leaf in leaves.items():
            if not isinstance(name, str) or name.startswith("<NJT") or len(leaf) != 5:
                raise bad_layout(
                    source, f"batch.{name}", "a dense tensor leaf (dtype, shape, start, end, pad)"
                )
            dtype_name, shape, start, end, pad = leaf
            dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise bad_layout(source, f"batch.{name}", f"a torch dtype, got {dtype_name!r}")
            numel = int(np.prod(shape)) if len(shape) else 1
            value = storage[start:end].view(dtype)
            if pad:
                value = value[:numel]
            if value.numel() != numel:
                raise bad_layout(source, f"batch.{name}", f"{numel} elements of {dtype_name}")
            out[name] = value.view(tuple(shape))
        return out

    return rebuild


def _load_batch(source: str, data: bytes) -> dict[str, Any]:
    """The batch bytes of a DataProto state, read with ``weights_only`` and the consolidated-storage shim."""
    import torch

    buffer = io.BytesIO(data)
    try:
        with torch.serialization.safe_globals([(_rebuild_consolidated(source), TENSORDICT_REBUILD)]):
            return torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
        outside = [n for n in names if n != TENSORDICT_REBUILD]
        if outside:
            raise unsafe_global(f"{source}: batch", outside[0]) from exc
        raise bad_layout(source, "batch", f"a readable torch.save archive ({exc})") from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise bad_layout(source, "batch", f"a complete torch.save archive ({type(exc).__name__})") from exc


def _read_gen_batches(paths: list[Path], options: ImportOptions) -> Iterator[ImportedStep]:
    allow = {
        **numpy_allow_list(),
        "verl.protocol.DataProto": record_shim("verl.protocol.DataProto"),
        "torch.Size": tuple,
    }
    steps = []
    for path in paths:
        meta_path = path.parent / "meta.json"
        try:
            step = int(json.loads(meta_path.read_text())["global_steps"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise bad_layout(
                meta_path, "global_steps", "meta.json beside gen_batch.dp with an int global_steps"
            ) from exc
        steps.append((step, path))
    for step, path in sorted(steps):
        loaded = load_pickle(path, allow, allow_unsafe=options.allow_unsafe_pickle)
        state = getattr(loaded.value, "state", None)
        if loaded.unsafe_load:
            proto = loaded.value
            batch = {name: proto.batch[name] for name in proto.batch.keys()}  # noqa: SIM118 (a TensorDict)
            non_tensor, meta_info = proto.non_tensor_batch, proto.meta_info
        else:
            if not isinstance(state, tuple) or len(state) != 3 or not isinstance(state[0], bytes):
                raise bad_layout(path, "DataProto", "state (batch bytes, non_tensor_batch, meta_info)")
            batch = _load_batch(str(path), state[0])
            non_tensor, meta_info = state[1], state[2]
        yield _gen_batch_step(path, step, batch, non_tensor or {}, meta_info or {}, loaded.unsafe_load)


def _gen_batch_step(
    path: Path,
    step: int,
    batch: dict[str, Any],
    non_tensor: dict[str, Any],
    meta_info: dict[str, Any],
    unsafe: bool,
) -> ImportedStep:
    for name in ("prompts", "responses", "response_mask", "attention_mask"):
        if name not in batch:
            raise bad_layout(path, f"batch.{name}", "a tensor (verl generation output)")
    blocks = {
        name: value.numpy()
        for name, value in batch.items()
        if name in (*REQUIRED, *STREAMS, "attention_mask")
    }
    width_p = blocks["prompts"].shape[1]
    attention = blocks["attention_mask"].astype(np.int64)  # (B, P + R)
    if attention.shape != (blocks["prompts"].shape[0], width_p + blocks["responses"].shape[1]):
        raise bad_layout(path, "batch.attention_mask", "shape (B, prompt width + response width)")
    prompt_lens = attention[:, :width_p].sum(axis=1)
    response_lens = attention[:, width_p:].sum(axis=1)
    out, _, _ = _base_columns(str(path), blocks, prompt_lens, response_lens)
    uid = non_tensor.get("uid")
    if uid is not None:
        out["group_id"] = pl.Series("group_id", [str(v) for v in uid.tolist()], dtype=pl.String)
    if "data_source" in non_tensor:
        out["env"] = pl.Series("env", [str(v) for v in non_tensor["data_source"].tolist()], dtype=pl.String)
    rows = pl.DataFrame(list(out.values()))
    sampling = {k: meta_info[k] for k in ("temperature",) if isinstance(meta_info.get(k), int | float)}
    return ImportedStep(
        step=step,
        rows=rows,
        src_files=(str(path),),
        framework="verl",
        default_group_by=field_or_prompt(rows),
        stream_fields={c: f for f, c in STREAMS.items() if c in rows.columns},
        sampling=sampling,
        unsafe_load=unsafe,
    )


PRESET = Preset("verl", "verl hook files step_<S>.pt, or RolloutSkip gen_batch.dp", read)
