"""Writing imported steps as a canonical run, validated and all or nothing (docs/import.md, docs/schema.md).

`write_steps` consumes the `ImportedStep`s a preset yields, one step at a time (never the whole dump), and for
each: applies ``--shift``, derives what the source lacks (``run``, ``step``, ``prompt_len``, ``sample_id``,
``group_id`` by ``--group-by``, ``seq_hash``), nulls every stream and advantage off ``loss_mask`` ("masks,
not values"), casts to the canonical types (E103), validates every rule of docs/schema.md (an error stops the
import), writes ``rollouts/step=<S>/part-00000.parquet`` (on a background thread, while the preset reads the
next step: `_PartWriter`) and reports a `StepSummary` to `progress`.
Degenerate streams (W701/W702) are judged over the whole import: a column that is zeros or a copy on every
step is dropped from every part at the end; one that is so on some steps only fails E206.

Everything is written into ``.<OUT>.tmp-<pid>-<random>`` beside OUT and renamed onto OUT at the end, with the
``pgdiag.json`` sidecar (the completion marker) last; on any error or interrupt the temp directory is removed
and OUT is untouched.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pgdiag.data.flat import FlatList, RowTable, flat_list
from pgdiag.data.kept import KEPT_COLUMNS, kept_from_series
from pgdiag.data.schema import (
    LABEL_PATTERN,
    ROLLOUTS_SCHEMA,
    RUN_SIDECAR_SCHEMA,
    decode_footer,
    stream_column,
)
from pgdiag.data.validate import CheckResult, Issue, check_result, validate_rows
from pgdiag.data.writing import (
    _with_seq_hash,
    sequence_row_group_rows,
    source_meta,
    stream_meta,
    to_canonical_table,
    write_json,
    write_parquet,
)
from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.importers import alignment, ids
from pgdiag.importers.base import DegenerateStream, ImportedStep, ImportOptions

MASKED_COLUMNS_SUFFIX = "_logprobs"  # every stream column, plus "advantages"
_PARTS = "rollouts"


@dataclass(frozen=True)
class StepSummary:
    """What one step imported: counts, streams found, and its warnings (validation and import)."""

    step: int
    n_samples: int
    n_tokens: int
    n_loss_tokens: int
    n_groups: int
    streams: tuple[str, ...]
    warnings: tuple[Issue, ...]


@dataclass(frozen=True)
class ImportResult:
    """A written run: its path, counts, per-step summaries and every warning (`issues`)."""

    path: Path
    n_samples: int
    n_tokens: int
    n_loss_tokens: int
    steps: tuple[StepSummary, ...]
    issues: CheckResult
    streams: tuple[str, ...] = ()
    dropped_streams: tuple[str, ...] = field(default_factory=tuple)


def _stream_of(column: str) -> str:
    return column[: -len(MASKED_COLUMNS_SUFFIX)]


def _masked_columns(columns: Iterable[str]) -> list[str]:
    return [
        c
        for c in columns
        if (c.endswith(MASKED_COLUMNS_SUFFIX) or c == "advantages") and c not in KEPT_COLUMNS
    ]


def _stream_columns(columns: Iterable[str]) -> list[str]:
    return [c for c in columns if c.endswith(MASKED_COLUMNS_SUFFIX) and c not in KEPT_COLUMNS]


def run_label(label: str | None, out: Path) -> str:
    """The run label: `label`, else OUT's name (without ``.parquet``); UsageError E503 when not a valid label."""
    name = label if label is not None else out.name.removesuffix(".parquet")
    if not LABEL_PATTERN.fullmatch(name):
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"run label {name!r} is not [A-Za-z0-9_.-]{{1,64}}", "pass --label NAME"
        )
    return name


def _per_token_columns(df: pl.DataFrame) -> list[str]:
    """Token-aligned list columns (the kept sets are CSR, not token-aligned: a --shift leaves them)."""
    return [
        c
        for c, t in df.schema.items()
        if isinstance(t, pl.List) and c != "input_ids" and c not in KEPT_COLUMNS
    ]


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
    if imported.requires_stream and not _stream_columns(df.columns):
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
    for column in _masked_columns(df.columns):
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


def _row_table(table: pa.Table, source: str) -> RowTable:
    lists = {}
    scalars = []
    for name in table.column_names:
        column = table.column(name)
        if name in KEPT_COLUMNS:
            continue
        if name in ("input_ids", "loss_mask") or name.endswith(MASKED_COLUMNS_SUFFIX) or name == "advantages":
            series = pl.Series(name, column)
            flat = flat_list(series)
            if name == "input_ids" and flat.values.dtype != np.int32:
                flat = FlatList(flat.offsets, flat.values.astype(np.int32), flat.valid, flat.row_valid)
            lists[name] = flat
        elif not pa.types.is_list(column.type) and not pa.types.is_map(column.type):
            scalars.append(name)
    frame = pl.from_arrow(table.select(scalars))
    assert isinstance(frame, pl.DataFrame)
    frame = frame.with_columns(pl.lit(source).alias("__file"))
    streams = tuple(c for c in lists if c.endswith(MASKED_COLUMNS_SUFFIX))
    kept = kept_from_series(
        {c: pl.Series(c, table.column(c)) for c in KEPT_COLUMNS if c in table.column_names}
    )
    return RowTable(frame, lists, streams, kept)


def _loss_values(table: RowTable, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(M,) values of `column` at the loss positions and (M,) their validity."""
    flat = table.lists[column]
    mask = table.lists["loss_mask"].values
    valid = np.ones(int(mask.sum()), dtype=bool) if flat.valid is None else flat.valid[mask]
    return flat.values[mask], valid


def degenerate_holds(table: RowTable, rule: DegenerateStream) -> bool:
    """Whether `rule` holds on every loss position of `table` (False when a column is absent)."""
    if rule.column not in table.lists:
        return False
    values, valid = _loss_values(table, rule.column)
    if values.size == 0:
        return False
    if rule.same_as is None:
        return bool(valid.all() and (values == 0.0).all())
    if rule.same_as not in table.lists:
        return False
    other, other_valid = _loss_values(table, rule.same_as)
    return bool(
        (valid == other_valid).all()
        and (
            values[valid].astype(np.float32).view(np.uint32)
            == other[valid].astype(np.float32).view(np.uint32)
        ).all()
    )


@dataclass
class _Degenerate:
    rule: DegenerateStream
    steps_holding: list[int] = field(default_factory=list)
    steps_failing: list[int] = field(default_factory=list)


@dataclass
class _Totals:
    n_samples: int = 0
    n_tokens: int = 0
    n_loss_tokens: int = 0
    steps: list[StepSummary] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    src_files: list[str] = field(default_factory=list)
    streams: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    footer: dict[str, Any] = field(default_factory=dict)
    framework: str = ""
    framework_version: str | None = None
    unsafe_load: bool = False
    retokenized: bool = False
    label: str = ""
    warnings: list[Issue] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    degenerate: dict[tuple[str, str], _Degenerate] = field(default_factory=dict)


def _first_error(issues: list[Issue]) -> InvalidInputError | None:
    errors = [i for i in issues if i.severity == "error"]
    if not errors:
        return None
    first = errors[0]
    more = f" (and {len(errors) - 1} more error codes)" if len(errors) > 1 else ""
    return InvalidInputError(first.code, first.message + more, first.hint)


def _footer(
    imported: ImportedStep, options: ImportOptions, preset: str, streams: list[str]
) -> dict[str, Any]:
    sampling = {
        **options.sampling_fallback(),
        **{k: v for k, v in imported.sampling.items() if v is not None},
    }
    footer: dict[str, Any] = {
        "schema": ROLLOUTS_SCHEMA,
        "alignment": "token",
        "created_by": _created_by(),
        "source": source_meta(
            imported.framework,
            framework_version=imported.framework_version,
            preset=preset,
            src_files=imported.src_files,
            retokenized=imported.retokenized,
            unsafe_load=imported.unsafe_load,
        ),
        "streams": {
            _stream_of(c): stream_meta(
                imported.stream_fields.get(c, c),
                tempered=sampling.get("tempered", "unknown"),
                logprobs_mode=sampling.get("logprobs_mode", "unknown"),
                engine=sampling.get("engine"),
            )
            for c in streams
        },
        "sampling": {k: v for k, v in sampling.items() if k != "tempered"},
        "import": {
            "group_by": options.group_by,
            "shift": [[c, k] for c, k in options.shifts],
            "ignored_codes": [],
        },
    }
    footer.update(imported.footer)
    if imported.unsafe_load:
        footer["source"] = {**footer["source"], "unsafe_load": True}
    return footer


def _created_by() -> str:
    from pgdiag import __version__

    return f"pgdiag {__version__}"


class _PartWriter:
    """Writes the step parts on one background thread, one part at a time, in order.

    Arrow's Parquet encoder and zstd, and the fsync after them, release the GIL, so step k is compressed and
    flushed while the preset reads step k + 1 (unpickling and JSON parsing hold the GIL: reading ahead in a
    thread would gain nothing). `submit` first waits for the part before it, so at most one table is waiting
    and a failed write is raised at the next `submit` or at `wait`, before anything is renamed onto OUT.
    """

    def __init__(self) -> None:
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgdiag-import-write")
        self._pending: futures.Future[Any] | None = None

    def submit(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.wait()
        self._pending = self._pool.submit(write, *args, **kwargs)

    def wait(self) -> None:
        """Block until the part submitted last is written; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the thread to finish (a failed write ignored: an error is already on its way)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            futures.wait([pending])
        self._pool.shutdown(wait=True)


def _write_step(
    imported: ImportedStep,
    options: ImportOptions,
    *,
    preset: str,
    label: str,
    label_forced: bool,
    tmp: Path,
    totals: _Totals,
    ignore: tuple[str, ...],
    parts: _PartWriter,
) -> StepSummary:
    source = imported.src_files[0] if imported.src_files else imported.framework
    df = finalize_rows(
        imported, options, label=label if label_forced or "run" not in imported.rows.columns else None
    )
    table = to_canonical_table(df)
    del df
    rows = _row_table(table, source)
    skip_zero_rule: set[str] = set()
    for rule in imported.degenerate:
        key = (rule.code, rule.column)
        state = totals.degenerate.setdefault(key, _Degenerate(rule))
        if degenerate_holds(rows, rule):
            state.steps_holding.append(imported.step)
            skip_zero_rule.add(rule.column)
        elif rule.column in rows.lists:
            state.steps_failing.append(imported.step)
    if skip_zero_rule:
        rows = RowTable(
            rows.frame,
            {k: v for k, v in rows.lists.items() if k not in skip_zero_rule},
            tuple(c for c in rows.stream_columns if c not in skip_zero_rule),
            rows.kept,
        )
    # a seq_hash the writer derived (finalize_rows) is the hash of these very ids: E212 cannot fire, skip the rehash
    derived_hash = "seq_hash" not in imported.rows.columns
    found = validate_rows(rows, ignore=(*ignore, Code.SEQ_HASH_MISMATCH) if derived_hash else ignore)
    error = _first_error(found.issues)
    if error is not None:
        raise error
    streams = _stream_columns(table.column_names)
    footer = _footer(imported, options, preset, streams)
    footer["import"] = {**footer.get("import", {}), "ignored_codes": sorted(ignore)}
    if imported.step in {s.step for s in totals.steps}:
        raise InvalidInputError(
            Code.BAD_DUMP_LAYOUT, f"{source}: step {imported.step} appears twice in the source"
        )
    path = tmp / _PARTS / f"step={imported.step}" / "part-00000.parquet"
    n_bytes = int(table.nbytes)
    parts.submit(
        write_parquet,
        table,
        path,
        metadata=footer,
        row_group_rows=sequence_row_group_rows(table.num_rows, n_bytes),
    )
    mask = rows.lists["loss_mask"]
    # import warnings (W70x) and notes (dropped rows, derived ids: code "note", never counted as warnings)
    said = {w.message for w in totals.warnings}  # a warning on every step (W704 on a column) is said once
    warnings = [
        Issue(w.code, "warning" if w.code.startswith("W") else "note", 1, w.message)
        for w in imported.warnings
        if w.message not in said
    ]
    warnings += [i for i in found.issues if i.severity == "warning"]
    summary = StepSummary(
        step=imported.step,
        n_samples=table.num_rows,
        n_tokens=int(rows.lists["input_ids"].offsets[-1]),
        n_loss_tokens=int(np.count_nonzero(mask.values)),
        n_groups=int(pl.Series(table.column("group_id")).n_unique()),
        streams=tuple(_stream_of(c) for c in streams),
        warnings=tuple(warnings),
    )
    totals.n_samples += summary.n_samples
    totals.n_tokens += summary.n_tokens
    totals.n_loss_tokens += summary.n_loss_tokens
    totals.steps.append(summary)
    totals.files.append(path)
    totals.src_files.extend(f for f in imported.src_files if f not in totals.src_files)
    for name, meta in footer["streams"].items():
        totals.streams.setdefault(name, meta)
    if not totals.sampling:
        totals.sampling = dict(footer.get("sampling") or {})
    for key in ("tokenizer", "model"):
        if key in footer:
            totals.footer.setdefault(key, footer[key])
    if not totals.framework:
        totals.framework = footer["source"]["framework"]
        totals.framework_version = footer["source"]["framework_version"]
        totals.footer["source"] = footer["source"]
    totals.unsafe_load |= imported.unsafe_load
    totals.retokenized |= imported.retokenized
    totals.warnings.extend(w for w in warnings if w.severity == "warning")
    totals.notes.extend(w.message for w in warnings if w.severity == "note")
    return summary


def _drop_degenerate(totals: _Totals) -> list[str]:
    """Drop every column whose degenerate rule held on all its steps; E206 when it held on some only."""
    dropped = []
    for state in totals.degenerate.values():
        if not state.steps_holding:
            continue
        rule = state.rule
        if state.steps_failing:
            raise InvalidInputError(
                Code.ZERO_FILLED,
                f"{rule.column}: {'exact 0.0' if rule.same_as is None else 'identical to ' + rule.same_as} on every "
                f"loss position of step {state.steps_holding[0]} but not of step {state.steps_failing[0]}; "
                "missing values written as 0?",
            )
        dropped.append(rule.column)
        totals.warnings.append(
            Issue(rule.code, "warning", 1, f"{rule.message}; {_stream_of(rule.column)} dropped")
        )
        stream = _stream_of(rule.column)
        totals.streams.pop(stream, None)
    if not dropped:
        return dropped
    for path in totals.files:
        table = pq.read_table(path)
        keep = [c for c in table.column_names if c not in dropped]
        meta = decode_footer(table.schema.metadata)
        meta["streams"] = {k: v for k, v in meta["streams"].items() if stream_column(k) not in dropped}
        meta["streams_dropped"] = {
            _stream_of(c): state.rule.message
            for c in dropped
            for state in totals.degenerate.values()
            if state.rule.column == c
        }
        table = table.select(keep).replace_schema_metadata({})
        write_parquet(
            table,
            path,
            metadata=meta,
            row_group_rows=sequence_row_group_rows(table.num_rows, int(table.nbytes)),
        )
    return dropped


def _sidecar(totals: _Totals, tmp: Path, dropped: list[str]) -> dict[str, Any]:
    steps = sorted(s.step for s in totals.steps)
    source = dict(totals.footer.get("source") or {})
    source["unsafe_load"] = bool(source.get("unsafe_load")) or totals.unsafe_load
    return {
        "schema": RUN_SIDECAR_SCHEMA,
        "label": totals.label,
        "source": source,
        "sampling": totals.sampling,
        "tokenizer": dict(totals.footer.get("tokenizer") or {}),
        "steps": [steps[0], steps[-1]] if steps else [],
        "n_samples": totals.n_samples,
        "n_tokens": totals.n_tokens,
        "n_loss_tokens": totals.n_loss_tokens,
        "files": [str(p.relative_to(tmp)) for p in totals.files],
        "streams": totals.streams,
        "stream_notes": {
            _stream_of(state.rule.column): f"{state.rule.code}: {state.rule.message}; dropped"
            for state in totals.degenerate.values()
            if state.rule.column in dropped
        },
        "warnings": [{"code": w.code, "message": w.message} for w in totals.warnings],
        "notes": totals.notes,
    }


def _replace_dir(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_steps(
    steps: Iterable[ImportedStep],
    out: str | Path,
    *,
    options: ImportOptions,
    preset: str,
    overwrite: bool = False,
    ignore: tuple[str, ...] = (),
    progress: Callable[[StepSummary], None] | None = None,
) -> ImportResult:
    """Validate and write every step of `steps` as the run directory `out`, all or nothing.

    Existing `out` without `overwrite` is E502 (checked before anything is read). `progress` is called once per
    step written. Any error leaves `out` as it was and no temp files behind.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise UsageError(Code.OUTPUT_EXISTS, f"{out} exists", "pass --overwrite to replace it")
    label = run_label(options.label, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    totals = _Totals(label=label)
    parts = _PartWriter()
    try:
        for imported in steps:
            summary = _write_step(
                imported,
                options,
                preset=preset,
                label=label,
                label_forced=options.label is not None,
                tmp=tmp,
                totals=totals,
                ignore=ignore,
                parts=parts,
            )
            if progress is not None:
                progress(summary)
        parts.wait()
        if not totals.steps:
            raise InvalidInputError(
                Code.BAD_DUMP_LAYOUT, f"nothing to import: no step found ({preset} preset)"
            )
        dropped = _drop_degenerate(totals)
        if len(totals.files) == 1:
            single = tmp / _PARTS / "part-00000.parquet"
            os.replace(totals.files[0], single)
            totals.files[0].parent.rmdir()
            totals.files = [single]
        write_json(_sidecar(totals, tmp, dropped), tmp / "pgdiag.json")
        _replace_dir(tmp, out)
    except BaseException:
        parts.close()  # no write may land in the temp directory after it is removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        parts.close()
    streams = tuple(totals.streams)
    return ImportResult(
        path=out,
        n_samples=totals.n_samples,
        n_tokens=totals.n_tokens,
        n_loss_tokens=totals.n_loss_tokens,
        steps=tuple(totals.steps),
        issues=check_result([w for w in totals.warnings if w.code not in ignore]),  # hides, never acts
        streams=streams,
        dropped_streams=tuple(_stream_of(c) for c in dropped),
    )
