"""PipelineRL preset: the actor stream ``<exp>/streams/actor/<instance>/<partition>/0.jsonl`` (default files
backend) or the preprocessor output ``<exp>/streams/training_data/<instance>/<trainer>/0.jsonl``.

**Actor** lines are JSON arrays holding every ``TrainingText`` of one group (its rollouts, shuffled; a
multi-turn or tool rollout gives one TrainingText per LLM call, each with the whole context as prompt):
``input_ids``, ``labels`` (-100 on the prompt), ``logprobs`` of the completion only (response-aligned at the
first label), ``reward``, ``finished``, ``group_id`` and ``metadata`` (``model_version``, ``rollout_index``,
``step_index``). The step is the smallest ``model_version`` in the line (a group may span two versions; it
stays whole and each row keeps its own as ``policy_version``).

**training_data** lines are packed micro-batches (``PipelineBatchEncoding``): ``[1, total]`` arrays cut by
``seq_boundaries``; ``old_logprobs`` (the engine's, zero-filled in front) is the rollout stream,
``ref_logprobs`` the reference (a copy of it without a reference model: W702), ``advantages``, ``rewards``
(read at each sequence's first token). ``sentinel`` batches are skipped, and a batch with ``padding`` > 0 ends
with a synthetic example that is dropped. No ids are kept: groups by prompt. PipelineRL runs vLLM with
processed log-probs by default, so ``logprobs_mode`` defaults to ``processed``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.errors import Code
from pgdiag.importers.alignment import from_rows, response_aligned, to_series
from pgdiag.importers.base import DegenerateStream, ImportedStep, ImportOptions, Preset, bad_layout
from pgdiag.importers.jsonl_lines import read_lines
from pgdiag.importers.step_rows import field_or_prompt

MASKED = -100
_SAMPLING = {"logprobs_mode": "processed", "engine": "vllm"}
_W702 = DegenerateStream(
    Code.STREAM_COPIED,
    "ref_logprobs",
    "rollout_logprobs",
    "ref_logprobs is bit-identical to old_logprobs on every loss position (no reference model): ref dropped",
)


def _files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    streams = src / "streams" if (src / "streams").is_dir() else src
    root = streams / "actor" if (streams / "actor").is_dir() else streams
    files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    if not files:
        raise bad_layout(src, "streams", "actor or training_data stream files <...>/0.jsonl (files backend)")
    return files


def _int_list(value: Any, path: Path, field: str, line: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise bad_layout(path, field, f"a list of ints (line {line})")
    return array.astype(np.int64)


def _float_list(value: Any, length: int, path: Path, field: str, line: int) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise bad_layout(path, field, f"a list of numbers (line {line})") from exc
    if array.ndim != 1 or array.shape[0] != length:
        raise bad_layout(
            path,
            field,
            f"{length} values, got {array.shape[0] if array.ndim == 1 else array.shape} (line {line})",
        )
    return array


# ------------------------------------------------------------------------------------------------- actor


def _actor_steps(files: list[Path]) -> Iterator[ImportedStep]:
    by_step: dict[int, list[tuple[Path, int, Mapping[str, Any]]]] = defaultdict(list)
    for path in files:
        for line, texts in read_lines(path):
            if not isinstance(texts, list) or not texts or not all(isinstance(t, Mapping) for t in texts):
                raise bad_layout(path, f"line {line}", "a JSON array of TrainingText objects (one group)")
            versions = [t.get("metadata", {}).get("model_version") for t in texts]
            if any(not isinstance(v, int) for v in versions):
                raise bad_layout(
                    path, "metadata.model_version", f"an int on every TrainingText (line {line})"
                )
            step = min(versions)
            by_step[step].extend((path, line, t) for t in texts)
    for step in sorted(by_step):
        yield _actor_step(step, by_step[step])


def _actor_step(step: int, texts: list[tuple[Path, int, Mapping[str, Any]]]) -> ImportedStep:
    ids, masks, lps, refs = [], [], [], []
    prompt_lens, records = [], []
    for path, line, t in texts:
        tokens = _int_list(t.get("input_ids"), path, "input_ids", line)
        labels = _int_list(t.get("labels"), path, "labels", line)
        if labels.shape != tokens.shape:
            raise bad_layout(path, "labels", f"{tokens.shape[0]} labels like input_ids (line {line})")
        mask = labels != MASKED
        first = int(np.argmax(mask)) if mask.any() else tokens.shape[0]
        if mask.any() and not mask[first:].all():
            raise bad_layout(path, "labels", f"-100 on the prompt only, then the completion (line {line})")
        n_resp = tokens.shape[0] - first
        lps.append(_float_list(t.get("logprobs"), n_resp, path, "logprobs", line))
        ref = t.get("ref_logprobs") or []
        refs.append(_float_list(ref, n_resp, path, "ref_logprobs", line) if len(ref) else None)
        ids.append(tokens)
        masks.append(mask)
        prompt_lens.append(first)
        meta = t.get("metadata") or {}
        group = t.get("group_id")
        records.append(
            {
                "sample_id": f"{group}/{meta.get('rollout_index')}",
                "segment_idx": meta.get("step_index"),
                "group_id": None if group is None else str(group),
                "reward": t.get("reward"),
                "finish_reason": "stop" if t.get("finished") else "length",
                "policy_version": meta.get("model_version"),
            }
        )
    input_ids = from_rows(ids, np.int64)
    seq_lens, p_lens = input_ids.lengths, np.array(prompt_lens, dtype=np.int64)
    rollout = response_aligned(from_rows(lps), p_lens, seq_lens)
    frame = pl.DataFrame(
        records,
        schema={
            "sample_id": pl.String,
            "segment_idx": pl.Int32,
            "group_id": pl.String,
            "reward": pl.Float32,
            "finish_reason": pl.String,
            "policy_version": pl.Int64,
        },
    )
    columns = [
        to_series("input_ids", input_ids, pl.List(pl.Int32)),
        to_series("loss_mask", from_rows(masks, bool), pl.List(pl.Boolean)),
        pl.Series("prompt_len", p_lens, dtype=pl.Int32),
        to_series("rollout_logprobs", rollout, pl.List(pl.Float32)),
    ]
    fields = {"rollout_logprobs": "logprobs"}
    if all(r is not None for r in refs):
        columns.append(
            to_series(
                "ref_logprobs", response_aligned(from_rows(refs), p_lens, seq_lens), pl.List(pl.Float32)
            )
        )  # type: ignore[arg-type]
        fields["ref_logprobs"] = "ref_logprobs"
    rows = pl.DataFrame(columns).hstack(frame)
    if rows["group_id"].null_count():
        rows = rows.drop("group_id")
    return ImportedStep(
        step=step,
        rows=rows,
        src_files=tuple(sorted({str(p) for p, _, _ in texts})),
        framework="pipelinerl",
        default_group_by=field_or_prompt(rows),
        stream_fields=fields,
        sampling=_SAMPLING,
    )


# ----------------------------------------------------------------------------------------- training_data


def _row(value: Any, path: Path, field: str, line: int) -> list:
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], list):
        raise bad_layout(path, field, f"a [1, total] array (line {line})")
    return value[0]


def _training_steps(files: list[Path]) -> Iterator[ImportedStep]:
    by_step: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    sources: dict[int, set[str]] = defaultdict(set)
    for path in files:
        for line, batch in read_lines(path):
            if not isinstance(batch, Mapping) or "seq_boundaries" not in batch:
                raise bad_layout(path, f"line {line}", "a packed micro-batch with seq_boundaries")
            if batch.get("sentinel"):
                continue
            step = batch.get("model_version")
            if not isinstance(step, int):
                raise bad_layout(path, "model_version", f"an int (line {line})")
            ids = _int_list(_row(batch.get("input_ids"), path, "input_ids", line), path, "input_ids", line)
            total = ids.shape[0]
            labels = _int_list(_row(batch.get("labels"), path, "labels", line), path, "labels", line)
            if labels.shape[0] != total:
                raise bad_layout(path, "labels", f"{total} values like input_ids (line {line})")
            values = {
                name: _float_list(_row(batch.get(name), path, name, line), total, path, name, line)
                for name in ("old_logprobs", "ref_logprobs", "advantages", "rewards")
            }
            bounds = _int_list(batch["seq_boundaries"], path, "seq_boundaries", line)
            if bounds.size < 2 or bounds[0] != 0 or bounds[-1] != total or np.any(np.diff(bounds) < 0):
                raise bad_layout(path, "seq_boundaries", f"rising offsets from 0 to {total} (line {line})")
            spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
            if int(batch.get("padding") or 0) > 0:
                spans.pop()  # the synthetic example collate_packed appends to reach a multiple of seq_parallel
            out = by_step[step]
            for s, e in spans:
                out["ids"].append(ids[s:e])
                out["mask"].append(labels[s:e] != MASKED)
                for name in ("old_logprobs", "ref_logprobs", "advantages"):
                    out[name].append(values[name][s:e])
                out["reward"].append(float(values["rewards"][s]))
            sources[step].add(str(path))
    for step in sorted(by_step):
        out = by_step[step]
        n = len(out["ids"])
        columns = [
            to_series("input_ids", from_rows(out["ids"], np.int64), pl.List(pl.Int32)),
            to_series("loss_mask", from_rows(out["mask"], bool), pl.List(pl.Boolean)),
            to_series("rollout_logprobs", from_rows(out["old_logprobs"]), pl.List(pl.Float32)),
            to_series("ref_logprobs", from_rows(out["ref_logprobs"]), pl.List(pl.Float32)),
            to_series("advantages", from_rows(out["advantages"]), pl.List(pl.Float32)),
            pl.Series("reward", out["reward"], dtype=pl.Float32),
            pl.Series("sample_id", [f"{step}:{k}" for k in range(n)], dtype=pl.String),
        ]
        yield ImportedStep(
            step=step,
            rows=pl.DataFrame(columns),
            src_files=tuple(sorted(sources[step])),
            framework="pipelinerl",
            default_group_by="prompt",
            stream_fields={"rollout_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs"},
            sampling=_SAMPLING,
            degenerate=(_W702,),
        )


def _first_value(path: Path) -> Any:
    for _, value in read_lines(path):
        return value
    return None


def _read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    files = [p for p in _files(src) if p.stat().st_size > 0]
    if not files:
        raise bad_layout(src, "streams", "a non-empty stream file")
    kinds = {type(_first_value(p)) is list for p in files}
    if len(kinds) > 1:
        raise bad_layout(src, "streams", "actor files or training_data files, not both")
    yield from (_actor_steps(files) if kinds.pop() else _training_steps(files))


PRESET = Preset("pipelinerl", "PipelineRL actor or training_data streams (JSONL)", _read)
