"""The canonical rows of one imported step: derived columns, ``--shift``, streams nulled off the loss mask.

What: `finalize_rows(imported, options, label=...)` takes the rows a preset yields for one step and returns what
gets cast, validated and written (docs/import.md): it checks ``input_ids``/``loss_mask`` and a log-prob stream
are there (E101), applies ``--shift [COL=]K`` (`apply_shifts`), fills ``run`` and ``step``, nulls every stream
and advantage off ``loss_mask`` ("masks, not values"), derives ``prompt_len``, ``sample_id``, ``group_id`` (by
``--group-by``: the source's field, the prompt, or contiguous groups of N) and ``seq_hash``, and sorts by
(step, group_id, sample_id).

Why apart: the rules that make every preset's rows the same canonical rows; `pgdiag.importers.writer` validates
and writes them, and `pgdiag.importers.canonical` applies the same shifts to a canonical file.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList, flat_list
from pgdiag.data.kept import KEPT_COLUMNS
from pgdiag.data.writing import _with_seq_hash
from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.importers import alignment, ids
from pgdiag.importers.base import ImportedStep, ImportOptions

MASKED_COLUMNS_SUFFIX = "_logprobs"  # every stream column, plus "advantages"


def stream_of(column: str) -> str:
    return column[: -len(MASKED_COLUMNS_SUFFIX)]


def masked_columns(columns: Iterable[str]) -> list[str]:
    return [
        c
        for c in columns
        if (c.endswith(MASKED_COLUMNS_SUFFIX) or c == "advantages") and c not in KEPT_COLUMNS
    ]


def stream_columns(columns: Iterable[str]) -> list[str]:
    return [c for c in columns if c.endswith(MASKED_COLUMNS_SUFFIX) and c not in KEPT_COLUMNS]


def _per_token_columns(df: pl.DataFrame) -> list[str]:
    """Token-aligned list columns (the kept sets are CSR, not token-aligned: a --shift leaves them)."""
    return [
        c
        for c, t in df.schema.items()
        if isinstance(t, pl.List) and c != "input_ids" and c not in KEPT_COLUMNS
    ]


def field_or_prompt(rows: pl.DataFrame) -> str:
    """The group rule of a preset whose source may record groups: ``"field"`` when `rows` has ``group_id``,
    else ``"prompt"``."""
    return "field" if "group_id" in rows.columns else "prompt"


def apply_shifts(df: pl.DataFrame, shifts: Iterable[tuple[str | None, int]], source: str) -> pl.DataFrame:
    """Move per-token columns by ``--shift [COL=]K`` (column None: every per-token column but input_ids)."""
    shifts = list(shifts)
    if not shifts:
        return df
    seq_lens = flat_list(df["input_ids"]).lengths
    columns = _per_token_columns(df)
    replaced = {}
    for column, k in shifts:
        targets = columns if column is None else [column]
        for target in targets:
            if target not in df.columns:
                raise UsageError(
                    Code.MISSING_SETTING,
                    f"--shift {target}={k}: no column {target}",
                    f"columns: {', '.join(columns)}",
                )
            dtype = df.schema[target]
            moved = alignment.shift(flat_list(df[target]), seq_lens, k, source=source, field=target)
            if dtype.inner == pl.Boolean:  # type: ignore[union-attr]
                moved = FlatList(moved.offsets, moved.values & moved.valid, None, None)
            replaced[target] = alignment.to_series(target, moved, dtype)
    return df.with_columns(list(replaced.values()))


def _group_ids(df: pl.DataFrame, group_by: str, step: int, prompt_len: np.ndarray, source: str) -> pl.Series:
    if group_by == "field":
        if "group_id" not in df.columns:
            raise UsageError(
                Code.MISSING_SETTING,
                f"{source}: --group-by field, but the source has no group ids",
                "pass --group-by prompt or --group-by contiguous:N",
            )
        return df["group_id"].cast(pl.String)
    if group_by == "prompt":
        return ids.prompt_group_ids(flat_list(df["input_ids"]), prompt_len)
    size = int(group_by.partition(":")[2])
    return ids.contiguous_group_ids(step, df.height, size)


def finalize_rows(imported: ImportedStep, options: ImportOptions, *, label: str | None) -> pl.DataFrame:
    """The step's rows with every derived column, masked, sorted: what gets cast, validated and written."""
    df = imported.rows
    source = imported.src_files[0] if imported.src_files else imported.framework
    for column in ("input_ids", "loss_mask"):
        if column not in df.columns:
            raise InvalidInputError(
                Code.MISSING_COLUMN, f"{source}: missing column {column}", "map it with --map SRC=" + column
            )
    if imported.requires_stream and not stream_columns(df.columns):
        raise InvalidInputError(
            Code.MISSING_COLUMN,
            f"{source}: no log-prob stream (rollout_logprobs, old_logprobs, ref_logprobs or new_logprobs)",
            "map one with --map SRC=rollout_logprobs",
        )
    if "step" in df.columns:
        wrong = df["step"].cast(pl.Int64, strict=False) != imported.step
        if wrong.any():
            raise InvalidInputError(
                Code.BAD_DUMP_LAYOUT, f"{source}: step: expected {imported.step} on every row of the step"
            )
    else:
        df = df.with_columns(pl.lit(imported.step, dtype=pl.Int64).alias("step"))
    if label is not None or "run" not in df.columns:
        df = df.with_columns(pl.lit(label).alias("run"))
    if not imported.shifts_applied:
        df = apply_shifts(df, options.shifts, source)
    ids_flat = flat_list(df["input_ids"])
    mask = flat_list(df["loss_mask"])
    if mask.lengths.shape != ids_flat.lengths.shape or (mask.lengths != ids_flat.lengths).any():
        row = int(np.flatnonzero(mask.lengths != ids_flat.lengths)[0])
        raise InvalidInputError(
            Code.LENGTH_MISMATCH,
            f"{source}: loss_mask: length {mask.lengths[row]} != input_ids {ids_flat.lengths[row]} (row {row})",
        )
    mask_values = mask.values if mask.valid is None else mask.values & mask.valid
    mask = FlatList(mask.offsets, mask_values, None, None)
    masked = []
    for column in masked_columns(df.columns):
        values = flat_list(df[column])
        if values.lengths.shape == mask.lengths.shape and (values.lengths == mask.lengths).all():
            masked.append(
                alignment.to_series(column, alignment.null_off_mask(values, mask), df.schema[column])
            )
    if masked:
        df = df.with_columns(masked)
    if "prompt_len" not in df.columns:
        df = df.with_columns(pl.Series("prompt_len", ids.first_loss_positions(mask), dtype=pl.Int32))
    if "sample_id" not in df.columns:
        df = df.with_columns(ids.row_sample_ids(imported.step, df.height))
    group_by = options.group_by
    if group_by == "auto":
        group_by = (
            "field"
            if "group_id" in df.columns and imported.default_group_by == "field"
            else imported.default_group_by
        )
        if group_by == "field" and "group_id" not in df.columns:
            group_by = "prompt"
    prompt_len = df["prompt_len"].fill_null(0).to_numpy().astype(np.int64)
    prompt_len = np.clip(prompt_len, 0, ids_flat.lengths)
    df = df.with_columns(_group_ids(df, group_by, imported.step, prompt_len, source))
    if "seq_hash" not in df.columns:
        df = _with_seq_hash(df)
    return df.sort(["step", "group_id", "sample_id"], maintain_order=True)
