"""Atomic, spec-conformant writes of Parquet and JSON files.

Every file pgdiag writes goes through `atomic_write` (`pgdiag.atomic_files`, re-exported here): a temp file
beside the destination, fsynced and renamed onto it, so a reader never sees a half-written file and a failed
write leaves nothing behind. Parquet is always zstd level 3 with statistics on, footer values JSON-encoded under ``pgdiag.*`` keys. `write_rollouts`
writes a canonical run directory (``rollouts/step=<S>/part-00000.parquet``, or one unpartitioned part when the
data has one step, then the ``pgdiag.json`` sidecar last as the completion marker) with the canonical casts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pgdiag.atomic_files import atomic_write
from pgdiag.data.flat import flat_list
from pgdiag.data.schema import (
    ROLLOUT_ARROW_TYPES,
    ROLLOUTS_SCHEMA,
    RUN_SIDECAR_SCHEMA,
    encode_footer,
)
from pgdiag.data.seqhash import seq_hashes
from pgdiag.errors import Code, InvalidInputError, UsageError

ZSTD_LEVEL = 3
ROW_GROUP_TARGET_BYTES = 128 * 1024 * 1024
MAX_ROW_GROUP_ROWS = 1_048_576
_F32_MAX = float(np.finfo(np.float32).max)


@contextmanager
def directory_lock(directory: Path, *, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive ``flock`` on `directory` itself (no lock file), waiting for another holder to finish.

    Two processes writing one output directory take turns, so a set of files (a report's ``.parquet`` and
    ``.json``) always comes from one writer; the kernel drops the lock when its holder dies (SIGKILL leaves none).
    `wait` False: UsageError E519 at once when another process holds the lock (for writers that hold it long).
    """
    if os.name != "posix":
        yield
        return
    import fcntl

    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                Code.OUTPUT_BUSY,
                f"{directory}: another process is writing this output now",
                "wait for it to finish (or stop it), then run again; or choose another output",
            ) from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def check_destination(
    directory: str | Path,
    files: Sequence[str | Path],
    *,
    overwrite: bool,
    hint: str = "--out takes a directory (or a report file name ending in .parquet)",
) -> None:
    """Refuse an output before any work is done: UsageError E502 when a file stands where `directory` (or one
    of its parents) must be (with `hint`), or when one of `files` exists and `overwrite` is false; E517 when the
    path is too long, loops, or lies in a folder this process may not write."""
    from pgdiag.data.paths import check_output_path

    directory = Path(directory)
    check_output_path(directory)  # E517: too long, a loop of links, a folder it may not write
    for ancestor in (directory, *directory.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise UsageError(
                    Code.OUTPUT_EXISTS,
                    f"{ancestor} is a file, not a directory",
                    hint,
                )
            break
    for file in map(Path, files):
        if file.is_dir():
            raise UsageError(Code.OUTPUT_EXISTS, f"{file} is a directory, not a file", "choose another --out")
        if file.exists() and not overwrite:
            raise UsageError(Code.OUTPUT_EXISTS, f"{file} exists", "pass --overwrite to replace it")


def sequence_row_group_rows(n_rows: int, n_bytes: int) -> int:
    """Rows per row group of a sequence table: 128 MiB uncompressed per group, capped at 1,048,576."""
    if n_rows <= 0:
        return 1
    mean_row_bytes = max(1.0, n_bytes / n_rows)
    return int(max(1, min(MAX_ROW_GROUP_ROWS, ROW_GROUP_TARGET_BYTES // mean_row_bytes)))


def write_parquet(
    table: pa.Table | pl.DataFrame,
    path: str | Path,
    *,
    metadata: Mapping[str, Any],
    row_group_rows: int = MAX_ROW_GROUP_ROWS,
) -> Path:
    """Write `table` atomically as zstd-3 Parquet with statistics, `metadata` JSON-encoded as ``pgdiag.*``."""
    arrow = table.to_arrow() if isinstance(table, pl.DataFrame) else table
    existing = dict(arrow.schema.metadata or {})
    existing.pop(b"pandas", None)
    arrow = arrow.replace_schema_metadata({**existing, **encode_footer(metadata)})

    # dictionary pages only for scalar columns: float lists barely compress with them and decode slower
    dictionary_columns = [f.name for f in arrow.schema if not pa.types.is_list(f.type)]

    def write(tmp: Path) -> None:
        pq.write_table(
            arrow,
            tmp,
            compression="zstd",
            compression_level=ZSTD_LEVEL,
            write_statistics=True,
            use_dictionary=dictionary_columns,
            row_group_size=max(1, row_group_rows),
        )

    return atomic_write(path, write)


def write_json(obj: Any, path: str | Path) -> Path:
    """Write `obj` atomically as indented, key-sorted JSON with a trailing newline."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _cast_column(name: str, column: pa.ChunkedArray, target: pa.DataType) -> pa.ChunkedArray:
    if pa.types.is_dictionary(target):
        strings = pc.cast(column, pa.string())
        encoded = pc.dictionary_encode(strings.combine_chunks())
        return pa.chunked_array([encoded.cast(target)])
    source = column.type
    if pa.types.is_map(target) and _is_key_value_list(source):
        return pa.chunked_array([_as_map(chunk, target) for chunk in column.chunks], type=target)
    if (
        pa.types.is_list(target)
        and pa.types.is_floating(target.value_type)
        and pa.types.is_floating(_value_type(source))
        and _value_type(source).bit_width > target.value_type.bit_width  # only a wider float can overflow
    ):
        values = pc.list_flatten(column)
        finite_max = pc.max(pc.abs(pc.if_else(pc.is_finite(values), values, 0.0))).as_py()
        if finite_max is not None and finite_max > _F32_MAX:
            raise InvalidInputError(
                Code.LOSSY_CAST, f"{name}: {source} with {finite_max:.3g} does not fit float32"
            )
    try:
        return column.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidInputError(
            Code.LOSSY_CAST, f"{name}: {source} cannot be cast losslessly to {target} ({exc})"
        ) from exc


def _value_type(source: pa.DataType) -> pa.DataType:
    """The element type of a list type, else `source` itself."""
    is_list = pa.types.is_list(source) or pa.types.is_large_list(source)
    return source.value_type if is_list else source


def _is_key_value_list(source: pa.DataType) -> bool:
    """A list of {key, value} structs: how polars, which has no map type, holds a map column."""
    if not (pa.types.is_list(source) or pa.types.is_large_list(source)):
        return False
    item = source.value_type
    return pa.types.is_struct(item) and [item.field(i).name for i in range(item.num_fields)] == [
        "key",
        "value",
    ]


def _as_map(chunk: pa.Array, target: pa.MapType) -> pa.Array:
    """A list<struct<key, value>> chunk as a map array of `target` (keys and values cast losslessly)."""
    entries = chunk.flatten()  # (N,) struct, respecting the chunk's offset
    keys = entries.field("key").cast(target.key_type, safe=True)
    items = entries.field("value").cast(target.item_type, safe=True)
    offsets = pc.subtract(chunk.offsets, chunk.offsets[0]).cast(pa.int32())
    if chunk.null_count:
        offsets = pa.array(
            offsets.to_numpy(zero_copy_only=False),
            mask=np.append(~chunk.is_valid().to_numpy(zero_copy_only=False), False),
        )
    return pa.MapArray.from_arrays(offsets, keys, items, type=target)


def to_canonical_table(df: pl.DataFrame) -> pa.Table:
    """`df` as an Arrow table with the canonical types (unknown extra columns kept as they are); E103 when lossy."""
    arrow = df.to_arrow()
    columns = []
    for name in arrow.column_names:
        column = arrow.column(name)
        target = ROLLOUT_ARROW_TYPES.get(name)
        if target is None and (name.endswith("_logprobs") or name.endswith("_entropy")):
            target = ROLLOUT_ARROW_TYPES["old_logprobs"]
        columns.append(column if target is None else _cast_column(name, column, target))
    return pa.table(columns, names=arrow.column_names)


def _with_seq_hash(df: pl.DataFrame) -> pl.DataFrame:
    # flat_list reads the Arrow buffers with numpy: pyarrow's own to_numpy() on offsets imports pandas (0.3 s)
    ids = flat_list(df["input_ids"].cast(pl.List(pl.Int32)))
    hashes = seq_hashes(ids.values, ids.offsets)
    return df.with_columns(pl.Series("seq_hash", hashes, dtype=pl.UInt64))


def _fixed_size_as_lists(df: pl.DataFrame) -> pl.DataFrame:
    """`df` with every fixed-size `Array` column (at any depth of a list) cast to a `List` of the same
    elements: lossless (every row keeps its values, the length is then per row), so such a column is read as
    the list column it stands for."""

    def as_list(dtype: pl.DataType) -> pl.DataType:
        if isinstance(dtype, pl.Array | pl.List):
            return pl.List(as_list(dtype.inner))
        return dtype

    fixed = {c: as_list(t) for c, t in df.schema.items() if as_list(t) != t}
    return df.with_columns(pl.col(c).cast(t) for c, t in fixed.items()) if fixed else df


def _prepare_output(out: Path, *, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:
            raise UsageError(Code.OUTPUT_EXISTS, f"{out} exists", "pass --overwrite to replace it")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()


def write_rollouts(
    df: pl.DataFrame,
    out: str | Path,
    *,
    label: str,
    source: Mapping[str, Any],
    streams_meta: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    tokenizer: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    import_meta: Mapping[str, Any] | None = None,
    created_by: str = "pgdiag 0.1.0",
    overwrite: bool = False,
) -> Path:
    """Write `df` as canonical pgdiag.rollouts/v1 and return the run directory or file written.

    `out` ending in ``.parquet`` gets one file; otherwise `out` is a run directory: one part per step under
    ``rollouts/step=<S>/`` (``rollouts/part-00000.parquet`` when there is one step) and ``pgdiag.json``
    written last. `run` is set to `label` when absent, `seq_hash` computed when absent, rows are sorted by
    (step, group_id, sample_id). Existing output without `overwrite` is E502.
    """
    out = Path(out)
    missing = [
        c
        for c in ("step", "sample_id", "group_id", "input_ids", "prompt_len", "loss_mask")
        if c not in df.columns
    ]
    if missing:
        raise InvalidInputError(
            Code.MISSING_COLUMN, f"{out}: missing column {missing[0]}", "re-import with pgdiag import"
        )
    df = _fixed_size_as_lists(df)
    _prepare_output(out, overwrite=overwrite)
    if "run" not in df.columns:
        df = df.with_columns(pl.lit(label).alias("run"))
    if "seq_hash" not in df.columns:
        df = _with_seq_hash(df)
    df = df.sort(["step", "group_id", "sample_id"], maintain_order=True)
    footer: dict[str, Any] = {
        "schema": ROLLOUTS_SCHEMA,
        "alignment": "token",
        "created_by": created_by,
        "source": dict(source),
        "streams": dict(streams_meta),
    }
    for key, value in (("sampling", sampling), ("tokenizer", tokenizer), ("model", model)):
        if value is not None:
            footer[key] = dict(value)
    if import_meta is not None:
        footer["import"] = dict(import_meta)
    steps = sorted(int(s) for s in df["step"].unique().to_list())

    def write_part(part: pl.DataFrame, path: Path) -> Path:
        rows = sequence_row_group_rows(part.height, int(part.estimated_size()))
        return write_parquet(to_canonical_table(part), path, metadata=footer, row_group_rows=rows)

    if out.suffix == ".parquet":
        return write_part(df, out)
    if len(steps) == 1:
        files = [write_part(df, out / "rollouts" / "part-00000.parquet")]
    else:
        files = [
            write_part(
                df.filter(pl.col("step") == step), out / "rollouts" / f"step={step}" / "part-00000.parquet"
            )
            for step in steps
        ]
    loss_tokens = int(df["loss_mask"].list.sum().sum()) if df.height else 0
    sidecar = {
        "schema": RUN_SIDECAR_SCHEMA,
        "label": label,
        "source": dict(source),
        "sampling": dict(sampling or {}),
        "tokenizer": dict(tokenizer or {}),
        "steps": [steps[0], steps[-1]] if steps else [],
        "n_samples": df.height,
        "n_tokens": int(df["input_ids"].list.len().sum()) if df.height else 0,
        "n_loss_tokens": loss_tokens,
        "files": [str(path.relative_to(out)) for path in files],
        "streams": dict(streams_meta),
    }
    write_json(sidecar, out / "pgdiag.json")
    return out


def stream_meta(
    source_field: str,
    *,
    tempered: bool | str = "unknown",
    logprobs_mode: str = "unknown",
    engine: str | None = None,
) -> dict[str, Any]:
    """One entry of the ``pgdiag.streams`` footer."""
    return {
        "source_field": source_field,
        "tempered": tempered,
        "logprobs_mode": logprobs_mode,
        "engine": engine,
    }


def source_meta(
    framework: str,
    *,
    framework_version: str | None = None,
    preset: str = "canonical",
    src_files: Sequence[str] = (),
    retokenized: bool = False,
    unsafe_load: bool = False,
) -> dict[str, Any]:
    """The ``pgdiag.source`` footer object."""
    return {
        "framework": framework,
        "framework_version": framework_version,
        "preset": preset,
        "src_files": list(src_files),
        "retokenized": retokenized,
        "unsafe_load": unsafe_load,
    }
