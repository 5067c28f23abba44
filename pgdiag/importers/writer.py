"""Writing imported steps as a canonical run, validated and all or nothing (docs/import.md, docs/schema.md).

`write_steps` consumes the `ImportedStep`s a preset yields, one step at a time (never the whole dump), and for
each: applies ``--shift``, derives what the source lacks (``run``, ``step``, ``prompt_len``, ``sample_id``,
``group_id`` by ``--group-by``, ``seq_hash``), nulls every stream and advantage off ``loss_mask`` ("masks,
not values"), casts to the canonical types (E103), validates every rule of docs/schema.md (an error stops the
import), writes ``rollouts/step=<S>/part-00000.parquet`` (on a background thread, while the preset reads the
next step: `PartWriter`) and reports a `StepSummary` to `progress`.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from pgdiag.atomic_files import temp_path
from pgdiag.data.flat import FlatList, RowTable, flat_list
from pgdiag.data.kept import KEPT_COLUMNS, kept_from_series
from pgdiag.data.schema import LABEL_PATTERN, RUN_SIDECAR_SCHEMA
from pgdiag.data.validate import CheckResult, Issue, check_result, validate_rows
from pgdiag.data.writing import sequence_row_group_rows, to_canonical_table, write_json, write_parquet
from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.importers.base import ImportedStep, ImportOptions
from pgdiag.importers.degenerate import DegenerateState, degenerate_holds, drop_degenerate
from pgdiag.importers.footer import step_footer
from pgdiag.importers.part_writer import PartWriter
from pgdiag.importers.step_rows import MASKED_COLUMNS_SUFFIX, finalize_rows, stream_columns, stream_of

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


def run_label(label: str | None, out: Path) -> str:
    """The run label: `label`, else OUT's name (without ``.parquet``); UsageError E503 when not a valid label."""
    name = label if label is not None else out.name.removesuffix(".parquet")
    if not LABEL_PATTERN.fullmatch(name):
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"run label {name!r} is not [A-Za-z0-9_.-]{{1,64}}", "pass --label NAME"
        )
    return name


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
    degenerate: dict[tuple[str, str], DegenerateState] = field(default_factory=dict)


def _first_error(issues: list[Issue]) -> InvalidInputError | None:
    errors = [i for i in issues if i.severity == "error"]
    if not errors:
        return None
    first = errors[0]
    more = f" (and {len(errors) - 1} more error codes)" if len(errors) > 1 else ""
    return InvalidInputError(first.code, first.message + more, first.hint)


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
    parts: PartWriter,
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
        state = totals.degenerate.setdefault(key, DegenerateState(rule))
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
    streams = stream_columns(table.column_names)
    footer = step_footer(imported, options, preset, streams)
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
        streams=tuple(stream_of(c) for c in streams),
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
            stream_of(state.rule.column): f"{state.rule.code}: {state.rule.message}; dropped"
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
    tmp = temp_path(out)
    tmp.mkdir()
    totals = _Totals(label=label)
    parts = PartWriter()
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
        dropped, said = drop_degenerate(list(totals.degenerate.values()), totals.files)
        totals.warnings.extend(said)
        for column in dropped:
            totals.streams.pop(stream_of(column), None)
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
        dropped_streams=tuple(stream_of(c) for c in dropped),
    )
