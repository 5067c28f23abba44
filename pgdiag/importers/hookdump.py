"""Reading ``pgdiag.hookdump/v1`` files (written by `pgdiag.capture`), shared by the verl, trl and openrlhf presets.

SRC is one ``step_<S>[.rank<R>].pt`` file or a folder of them. Files load with ``weights_only=True`` and no
allow-list entry (tensors, str, numbers, lists and dicts only), so a pickle naming any global is E701. The files
of one step are returned in rank order; a missing rank, a mix of ``step_<S>.pt`` and rank files, an unknown
``format``, another framework, or a missing required tensor is E703 naming the file and the field. Lengths are
read from the file, never inferred.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch

from pgdiag.importers.base import ImportedStep, bad_layout
from pgdiag.importers.safe_load import load_pt

HOOKDUMP_FORMAT = "pgdiag.hookdump/v1"
_NAME = re.compile(r"^step_(\d+)(?:\.rank(\d+))?\.pt$")


@dataclass(frozen=True)
class HookFile:
    """One loaded hook file: its path and the payload's parts, checked."""

    path: Path
    step: int
    rank: int
    world_size: int
    framework_version: str
    tensors: dict[str, torch.Tensor]  # name -> CPU tensor, dim 0 = rows
    lists: dict[str, list[Any]]  # name -> one value per row
    meta: dict[str, Any]

    @property
    def n_rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0


@dataclass(frozen=True)
class HookStep:
    """The files of one step, in rank order."""

    step: int
    files: tuple[HookFile, ...]
    unsafe_load: bool


def hook_sampling(meta: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The sampling settings `keys` that a hook file's `meta` records (not None, not "unknown")."""
    return {key: meta[key] for key in keys if meta.get(key) not in (None, "unknown")}


def hook_imported_step(
    hook_step: HookStep,
    frames: Sequence[pl.DataFrame],
    streams: Mapping[str, str],
    *,
    framework: str,
    default_group_by: str,
    sampling: Mapping[str, Any],
) -> ImportedStep:
    """One hook step as an `ImportedStep`: its rank files' rows (`frames`, in rank order) concatenated, with only
    the streams (`streams`: hook field -> canonical column) that every rank recorded."""
    present = [c for c in streams.values() if all(c in f.columns for f in frames)]
    kept = [f.select([c for c in f.columns if c not in streams.values() or c in present]) for f in frames]
    files = hook_step.files
    return ImportedStep(
        step=hook_step.step,
        rows=pl.concat(kept, how="vertical"),
        src_files=tuple(str(f.path) for f in files),
        framework=framework,
        framework_version=files[0].framework_version,
        default_group_by=default_group_by,
        stream_fields={column: field for field, column in streams.items() if column in present},
        sampling=dict(sampling),
        unsafe_load=hook_step.unsafe_load,
    )


def hook_file_groups(src: Path) -> dict[int, list[tuple[int | None, Path]]]:
    """step -> [(rank or None, path)] for every hook file name in `src` (a file or a folder)."""
    paths = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    groups: dict[int, list[tuple[int | None, Path]]] = {}
    for path in paths:
        match = _NAME.match(path.name)
        if match is None:
            if src.is_file():
                raise bad_layout(path, "file name", "step_<S>.pt or step_<S>.rank<R>.pt")
            continue
        rank = None if match.group(2) is None else int(match.group(2))
        groups.setdefault(int(match.group(1)), []).append((rank, path))
    if not groups:
        raise bad_layout(src, "files", "hook files step_<S>.pt or step_<S>.rank<R>.pt (pgdiag.capture)")
    return groups


def read_hook_steps(
    src: Path, framework: str, required: Sequence[str], *, allow_unsafe: bool = False
) -> Iterator[HookStep]:
    """Yield each step's checked hook files in step order, loading one step at a time."""
    groups = hook_file_groups(src)
    for step in sorted(groups):
        entries = groups[step]
        ranks = [rank for rank, _ in entries]
        if None in ranks and len(entries) > 1:
            raise bad_layout(entries[0][1], "file name", f"either step_{step}.pt or rank files, not both")
        files = []
        unsafe = False
        for rank, path in sorted(entries, key=lambda entry: entry[0] or 0):
            loaded = load_pt(path, allow_unsafe=allow_unsafe)
            unsafe = unsafe or loaded.unsafe_load
            files.append(_checked(path, loaded.value, framework, required, step, rank))
        world = files[0].world_size
        found = [f.rank for f in files]
        if found != list(range(world)):
            missing = sorted(set(range(world)) - set(found))
            raise bad_layout(
                files[0].path,
                "rank",
                f"ranks 0..{world - 1} of step {step} (world_size {world}); missing {missing or found}",
            )
        yield HookStep(step, tuple(files), unsafe)


def _checked(
    path: Path, payload: Any, framework: str, required: Sequence[str], step: int, rank: int | None
) -> HookFile:
    if not isinstance(payload, dict):
        raise bad_layout(path, "payload", f"a dict in format {HOOKDUMP_FORMAT}")
    if payload.get("format") != HOOKDUMP_FORMAT:
        raise bad_layout(path, "format", f"{HOOKDUMP_FORMAT!r}, got {payload.get('format')!r}")
    if payload.get("framework") != framework:
        raise bad_layout(
            path, "framework", f"{framework!r} (preset {framework}), got {payload.get('framework')!r}"
        )
    if payload.get("step") != step:
        raise bad_layout(path, "step", f"{step} (the file name's step), got {payload.get('step')!r}")
    tensors, lists, meta = payload.get("tensors"), payload.get("lists", {}), payload.get("meta", {})
    if not isinstance(tensors, dict) or not isinstance(lists, dict) or not isinstance(meta, dict):
        raise bad_layout(path, "tensors/lists/meta", "dicts")
    for name in required:
        if not isinstance(tensors.get(name), torch.Tensor):
            raise bad_layout(path, f"tensors.{name}", "a tensor (the hook always records it)")
    rows = {name: t.shape[0] if t.dim() else -1 for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    rows.update({f"lists.{name}": len(v) if isinstance(v, list) else -1 for name, v in lists.items()})
    n_rows = rows.get(required[0], 0) if required else 0
    for name, count in rows.items():
        if count != n_rows:
            raise bad_layout(path, name if "." in name else f"tensors.{name}", f"{n_rows} rows, got {count}")
    world_size = payload.get("world_size", 1)
    file_rank = payload.get("rank", 0)
    if rank is not None and file_rank != rank:
        raise bad_layout(path, "rank", f"{rank} (the file name's rank), got {file_rank!r}")
    if rank is None and world_size != 1:
        raise bad_layout(path, "world_size", f"1 for a file without .rank<R>, got {world_size!r}")
    return HookFile(
        path=path,
        step=step,
        rank=int(file_rank),
        world_size=int(world_size),
        framework_version=str(payload.get("framework_version", "unknown")),
        tensors=tensors,
        lists=lists,
        meta=meta,
    )


def int_lengths(file: HookFile, name: str, limit: int) -> Any:
    """Recorded row lengths `name` as int64, each in [0, limit], else E703."""
    import numpy as np

    lengths = file.tensors[name].numpy().astype(np.int64)
    bad = np.flatnonzero((lengths < 0) | (lengths > limit))
    if bad.size:
        r = int(bad[0])
        raise bad_layout(file.path, f"tensors.{name}", f"a length in 0..{limit}, got {lengths[r]}", row=r)
    return lengths


def hook_kept_sets(
    file: HookFile, prompt_lens: Any, completion_lens: Any
) -> tuple[list[list[int]], list[list[int]], list[list[float]] | None] | None:
    """The kept sets a hook recorded (`pgdiag.capture.kept`: lists ``sampling_kept_ids`` and
    ``sampling_kept_counts``, one count per generated token, optional ``sampling_kept_logprobs``) as
    ``sampling_kept_ids`` / ``sampling_kept_offsets`` rows over the whole sequence (prompt positions empty; a row
    without sets: both empty), and the kept log-probs; None when the file records none. Counts of another
    length than the completion, or ids / log-probs of another total, are E703 naming the row."""
    ids_rows, count_rows = file.lists.get("sampling_kept_ids"), file.lists.get("sampling_kept_counts")
    if ids_rows is None or count_rows is None:
        return None
    logprob_rows = file.lists.get("sampling_kept_logprobs")
    out_ids: list[list[int]] = []
    out_offsets: list[list[int]] = []
    for r, (ids, counts) in enumerate(zip(ids_rows, count_rows, strict=True)):
        if not counts and not ids:
            out_ids.append([])
            out_offsets.append([])
            continue
        if len(counts) != int(completion_lens[r]) or sum(int(c) for c in counts) != len(ids):
            expected = f"{int(completion_lens[r])} counts summing to len(sampling_kept_ids) ({len(ids)})"
            raise bad_layout(file.path, "lists.sampling_kept_counts", expected, row=r)
        if logprob_rows is not None and len(logprob_rows[r]) != len(ids):
            raise bad_layout(file.path, "lists.sampling_kept_logprobs", f"{len(ids)} values", row=r)
        offsets = [0] * (int(prompt_lens[r]) + 1)
        for count in counts:
            offsets.append(offsets[-1] + int(count))
        out_ids.append([int(t) for t in ids])
        out_offsets.append(offsets)
    logprobs = None if logprob_rows is None else [[float(v) for v in row] for row in logprob_rows]
    return out_ids, out_offsets, logprobs
