"""Preset ``canonical``: Parquet or JSONL rows in pgdiag's own column names (docs/import.md, "Your own format").

SRC is a ``.parquet`` or ``.jsonl`` file, or a folder of them (a pgdiag run directory included: its
``rollouts/`` parts are read, its footer metadata kept). ``--map SRC=DST`` renames source columns to canonical
names first. Each per-token list is token-aligned (length T = ``len(input_ids)``) or response-aligned (length
T - ``prompt_len``, placed at ``prompt_len``); ``--shift [COL=]K`` moves lists by K (``1`` for next-token
lists, which may be K shorter). Any other length is E201. Rows are read one step at a time (Parquet: a
filtered scan; JSONL: file by file), so a long run never sits in memory whole.

`canonical_step` is shared with `pgdiag.write_run`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList, flat_list
from pgdiag.data.kept import KEPT_COLUMNS
from pgdiag.data.schema import (
    BASE_STREAMS,
    ROLLOUT_ARROW_TYPES,
    ROLLOUTS_SCHEMA,
    csv_error,
    decode_footer,
    stream_column,
)
from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.importers import alignment
from pgdiag.importers.base import ImportedStep, ImportOptions, ImportWarning, Preset, bad_layout
from pgdiag.importers.step_rows import apply_shifts

_PASS_THROUGH_FOOTER = ("source", "streams", "sampling", "tokenizer", "model")


def _source_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise UsageError(Code.INPUT_NOT_FOUND, f"{src}: no such file or directory")
    base = src / "rollouts" if (src / "rollouts").is_dir() else src
    files = [
        p
        for p in sorted(base.rglob("*"))
        if p.suffix in (".parquet", ".jsonl")
        and p.is_file()
        and not any(part.startswith((".", "_")) for part in p.relative_to(base).parts)
    ]
    if not files:
        tables = sorted(p for p in base.rglob("*") if p.suffix.lower() in (".csv", ".tsv") and p.is_file())
        raise (tables and csv_error(tables[0])) or UsageError(
            Code.INPUT_NOT_FOUND, f"{src}: no .parquet or .jsonl file found"
        )
    kinds = {p.suffix for p in files}
    if len(kinds) > 1:
        raise UsageError(
            Code.AMBIGUOUS_INPUT, f"{src}: holds both .parquet and .jsonl files; point SRC at one kind"
        )
    return files


def _renamed(df: pl.DataFrame, maps: tuple[tuple[str, str], ...], source: str) -> pl.DataFrame:
    for old, _new in maps:
        if old not in df.columns:
            raise UsageError(
                Code.MISSING_SETTING,
                f"{source}: --map {old}=...: no column {old}",
                f"columns: {', '.join(df.columns)}",
            )
    return df.rename(dict(maps)) if maps else df


def _place_response_aligned(df: pl.DataFrame, shifted: set[str], source: str) -> pl.DataFrame:
    """Per-token lists of length T - prompt_len placed at prompt_len; other lengths but T are E201."""
    seq_lens = flat_list(df["input_ids"]).lengths
    prompt_len = df["prompt_len"].to_numpy().astype(np.int64) if "prompt_len" in df.columns else None
    replaced = []
    for column, dtype in df.schema.items():
        if (
            column == "input_ids"
            or column in shifted
            or not isinstance(dtype, pl.List)
            or column in KEPT_COLUMNS
        ):
            continue
        values = flat_list(df[column])
        lengths = values.lengths
        if values.row_valid is not None:
            lengths = np.where(values.row_valid, lengths, seq_lens)
        if (lengths == seq_lens).all():
            continue
        response = prompt_len is not None and (lengths == seq_lens - prompt_len).all()
        if not response:
            bad = np.flatnonzero(lengths != seq_lens)
            row = int(bad[0])
            expected = f"{seq_lens[row]}" + (
                f" or {seq_lens[row] - prompt_len[row]}" if prompt_len is not None else ""
            )
            raise InvalidInputError(
                Code.LENGTH_MISMATCH,
                f"{source}: {column}: length {lengths[row]} != input_ids {seq_lens[row]} (row {row}; expected {expected})",
                "give prompt_len for response-aligned lists, or --shift COL=K for next-token lists",
            )
        placed = alignment.response_aligned(values, prompt_len, seq_lens, source=source, field=column)
        if dtype.inner == pl.Boolean:  # type: ignore[union-attr]
            placed = FlatList(placed.offsets, placed.values & placed.valid, None, None)
        replaced.append(alignment.to_series(column, placed, dtype))
    return df.with_columns(replaced) if replaced else df


def unread_float_lists(df: pl.DataFrame, streams: Mapping[str, str]) -> list[ImportWarning]:
    """W704 for each per-token float column that is neither a stream (``*_logprobs``) nor a schema column
    (``old_log_probs``, ``logprobs``): kept, but no command reads it; the hint names the closest stream."""
    import difflib

    targets = [stream_column(s) for s in BASE_STREAMS]
    found = []
    for column, dtype in df.schema.items():
        inner = dtype.inner if isinstance(dtype, pl.List) else None  # type: ignore[union-attr]
        if inner is None or not inner.is_float() or column in streams or column in ROLLOUT_ARROW_TYPES:
            continue
        close = difflib.get_close_matches(column, targets, n=1, cutoff=0.5)
        found.append(
            ImportWarning(
                Code.UNREAD_FLOAT_LIST,
                f"{column}: per-token floats of no canonical name, kept but read as no stream; if they are "
                f"log-probs, pass --map {column}={close[0] if close else 'old_logprobs'} (docs/schema.md)",
            )
        )
    return found


def canonical_step(
    df: pl.DataFrame,
    step: int,
    options: ImportOptions,
    *,
    src_files: tuple[str, ...],
    sampling: Mapping[str, Any] | None = None,
    footer: Mapping[str, Any] | None = None,
) -> ImportedStep:
    """One step of canonical rows as an `ImportedStep`: mapped, response-aligned lists placed, shifted."""
    source = src_files[0] if src_files else "<frame>"
    df = _renamed(df, options.maps, source)
    for column in ("input_ids", "loss_mask"):
        if column not in df.columns:
            raise InvalidInputError(
                Code.MISSING_COLUMN, f"{source}: missing column {column}", f"map it with --map SRC={column}"
            )
    shifted = {c for c, _ in options.shifts if c is not None}
    if any(c is None for c, _ in options.shifts):
        shifted = {c for c, t in df.schema.items() if isinstance(t, pl.List)}
    df = _place_response_aligned(df, shifted, source)
    df = apply_shifts(df, options.shifts, source)
    streams = {c: c for c in df.columns if c.endswith("_logprobs") and c not in KEPT_COLUMNS}
    return ImportedStep(
        warnings=unread_float_lists(df, streams),
        step=step,
        rows=df,
        src_files=src_files,
        framework=str((footer or {}).get("source", {}).get("framework", "unknown")),
        default_group_by="field",
        stream_fields=streams,
        sampling=dict(sampling or {}),
        footer=dict(footer or {}),
        shifts_applied=True,
    )


def split_steps(df: pl.DataFrame, options: ImportOptions, source: str) -> Iterator[tuple[int, pl.DataFrame]]:
    """(step, rows) of `df` in step order; without a ``step`` column every row is ``options.step``."""
    step_column = next((new for old, new in options.maps if new == "step"), "step")
    mapped_from = next((old for old, new in options.maps if new == "step"), "step")
    if mapped_from not in df.columns:
        if options.step is None:
            raise InvalidInputError(
                Code.MISSING_COLUMN, f"{source}: missing column {step_column}", "pass --step N"
            )
        yield options.step, df
        return
    steps = df[mapped_from]
    if steps.null_count():
        raise InvalidInputError(
            Code.NULL_REQUIRED, f"{source}: {mapped_from} is null on {steps.null_count()} rows"
        )
    for value in sorted(steps.unique().to_list()):
        yield int(value), df.filter(pl.col(mapped_from) == value)


def _check_jsonl(path: Path) -> None:
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        if size == 0:
            return
        handle.seek(size - 1)
        if handle.read(1) != b"\n":
            raise bad_layout(path, "last line", "a newline at the end (the file was cut while written?)")


def _read_jsonl(path: Path) -> pl.DataFrame:
    _check_jsonl(path)
    try:
        return pl.read_ndjson(path, infer_schema_length=None)
    except pl.exceptions.PolarsError as exc:
        raise bad_layout(path, "line", f"one JSON object per line ({exc})") from exc


def _parquet_footer(files: list[Path]) -> dict[str, Any]:
    """The first file's pgdiag footer entries worth keeping; every file's footer must be readable (E703)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    metas = []
    for path in files:
        try:
            metas.append(pq.read_schema(path).metadata)
        except (OSError, pa.ArrowException) as exc:
            raise csv_error(path) or bad_layout(
                path, "footer", f"a complete Parquet file ({exc}); truncated?"
            ) from exc
    meta = decode_footer(metas[0])
    if meta.get("schema") != ROLLOUTS_SCHEMA:
        return {}
    return {k: meta[k] for k in _PASS_THROUGH_FOOTER if k in meta}


def read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """Yield SRC's rows step by step (see the module docstring)."""
    files = _source_files(src)
    names = tuple(str(p) for p in files)
    if files[0].suffix == ".jsonl":
        frames = [_read_jsonl(p) for p in files]
        df = pl.concat(frames, how="diagonal_relaxed") if len(frames) > 1 else frames[0]
        for step, rows in split_steps(df, options, names[0]):
            yield canonical_step(rows, step, options, src_files=names, sampling=options.sampling_fallback())
        return
    footer = _parquet_footer(files)
    sampling = footer.pop("sampling", None) or options.sampling_fallback()
    lazy = pl.scan_parquet(files, hive_partitioning=False, glob=False)
    step_source = next((old for old, new in options.maps if new == "step"), "step")
    if step_source not in lazy.collect_schema().names():
        df = lazy.collect()
        for step, rows in split_steps(df, options, names[0]):
            yield canonical_step(rows, step, options, src_files=names, sampling=sampling, footer=footer)
        return
    steps = sorted(lazy.select(pl.col(step_source).unique()).collect()[step_source].drop_nulls().to_list())
    for step in steps:
        rows = lazy.filter(pl.col(step_source) == step).collect()
        step_footer = {**footer, "sampling": sampling} if footer else {}
        yield canonical_step(rows, int(step), options, src_files=names, sampling=sampling, footer=step_footer)


PRESET = Preset("canonical", "Parquet or JSONL rows in pgdiag's own columns (--map, --shift)", read)
