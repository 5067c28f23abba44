"""Finding, scanning and loading runs: `read_run`, `parse_steps`, `read_token_batch`.

Why: every command starts from a RUN argument (a run directory, a directory of Parquet files, one file or a
quoted glob) and needs a few columns of it as flat arrays, fast. How: `read_run` resolves the files, checks
their footers (E101/E104), discovers the log-prob streams (columns ``<stream>_logprobs`` plus the recompute
tags under ``RUN/logprobs/<tag>/`` or ``--attach`` directories) and returns a `Run` whose `lazy` frame is a
polars ``scan_parquet`` (hive ``step=`` partitions, step and run filters pushed down). `read_token_batch`
selects only the needed columns, joins recompute parts on (step, sample_id, segment_idx) (E305 on a seq_hash
disagreement, E504 on an incomplete dataset), flattens list columns to numpy buffers through Arrow, validates
them (`pgdiag.data.validate`) and keeps the loss positions as float64 in a `TokenBatch`.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from pgdiag.data.batch import TokenBatch
from pgdiag.data.flat import FlatList, LossView, RowTable, flat_list, loss_view
from pgdiag.data.kept import KEPT_COLUMNS, KEPT_IDS, KEPT_OFFSETS, kept_from_series
from pgdiag.data.memory import MemoryLimits, check_piece_memory
from pgdiag.data.paths import check_input_path, readable_file
from pgdiag.data.schema import (
    BASE_STREAMS,
    INT64_MAX,
    REQUIRED_COLUMNS,
    cast_problem,
    check_logprobs_footer,
    check_rollouts_footer,
    entropy_column,
    full_logprobs_column,
    kept_mass_column,
    read_footer,
    safe_coercions,
    stream_column,
)
from pgdiag.data.validate import (
    CheckResult,
    Issue,
    MessageParts,
    RowIssues,
    as_template,
    check_result,
    missing_columns,
    raise_first_error,
    validate_rows,
)
from pgdiag.errors import InvalidInputError, UsageError

FILE_COLUMN = "__file"
RECOMPUTE_KEYS = ("step", "sample_id", "segment_idx")
_HIVE_DIR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[^/]*$")
_STEP_DIR = re.compile(r"^step=(-?\d+)$")
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class StepSpec:
    """A parsed ``--steps`` value: inclusive ranges plus the ``last`` keyword."""

    ranges: tuple[tuple[int, int], ...] = ()
    last: bool = False


def parse_steps(spec: str | Sequence[int]) -> StepSpec:
    """Parse ``N``, ``A-B`` (inclusive), comma lists and ``last`` (``"0-3,7,last"``); bad specs: UsageError E112."""
    if not isinstance(spec, str):
        return StepSpec(tuple((int(s), int(s)) for s in spec))
    ranges: list[tuple[int, int]] = []
    last = False
    for part in (p.strip() for p in spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if part == "last":
            last = True
        elif match:
            lo = int(match.group(1))
            hi = int(match.group(2)) if match.group(2) is not None else lo
            if hi < lo:
                raise UsageError(
                    "E112", f"--steps {spec!r}: range {part} is empty", "write ranges as A-B with A <= B"
                )
            ranges.append((lo, hi))
        else:
            raise UsageError(
                "E112", f"--steps {spec!r}: cannot parse {part!r}", "use N, A-B, comma lists or last"
            )
    return StepSpec(tuple(ranges), last)


@dataclass(frozen=True)
class Run:
    """One run on disk: its files, label, streams and a lazy frame over its rollouts (nothing collected)."""

    label: str
    lazy: pl.LazyFrame  # rollouts dataset, filters applied
    streams: tuple[str, ...]  # rollout, old, ref, new present as columns, then recompute tags
    entropy_streams: tuple[str, ...]  # recompute tags whose parts hold entropy
    meta: dict  # decoded pgdiag.* footer of the first file, keys without the "pgdiag." prefix
    paths: tuple[Path, ...]  # rollouts files, in read order
    root: Path | None  # the run directory when RUN is one
    recompute: Mapping[str, Path] = field(default_factory=dict)  # tag -> directory of logprobs parts
    incomplete: Mapping[str, Path] = field(
        default_factory=dict
    )  # tag -> unfinished RUN/logprobs/<tag>, unread
    hive: bool = False
    row_filter: pl.Expr | None = None
    step_subset: tuple[int, ...] | None = None  # set by `restrict_steps`: the recompute join reads only these
    widened: pl.Schema | None = None  # files of one run whose integer/float widths differ: the widest of each
    kept_tags: tuple[str, ...] = ()  # recompute tags whose parts hold kept_mass and logprobs_full (kept sets)

    def scan(self, *, with_file: bool = False) -> pl.LazyFrame:
        """A fresh scan of the rollouts with the run's filters; `with_file` adds the ``__file`` column."""
        return _scan(self.paths, self.hive, self.row_filter, with_file=with_file, widened=self.widened)

    def collect(self, columns: Sequence[str]) -> pl.DataFrame:
        """The named columns, recompute columns (``<tag>_logprobs``, ``<tag>_entropy``) joined in."""
        for tag in self.incomplete:
            if {stream_column(tag), entropy_column(tag)} & set(columns):
                raise _incomplete_error(self, tag)
        lazy = _with_recompute(self, self.lazy, columns)
        try:
            return lazy.select(list(columns)).collect()
        except pl.exceptions.PolarsError as exc:
            raise InvalidInputError(
                "E103", f"{self.label}: cannot read columns {list(columns)} ({exc})"
            ) from exc

    def display_path(self, path: str | Path) -> str:
        """`path` as messages show it: as reached from the RUN argument the user gave."""
        return str(Path(path))


def _visible(path: Path, base: Path) -> bool:
    try:
        parts = path.relative_to(base).parts
    except ValueError:
        parts = (path.name,)
    return not any(part.startswith(("_", ".")) for part in parts)


def _natural_key(path: Path) -> tuple:
    steps = [int(m.group(1)) for part in path.parts if (m := _STEP_DIR.match(part))]
    return (steps[-1] if steps else -1, str(path))


def _parquet_under(directory: Path) -> list[Path]:
    """Every visible ``*.parquet`` file below `directory`; a folder or link that cannot be read is E516.

    (``Path.rglob`` skipped an unreadable ``step=N/`` folder silently, so a command ran on part of the run.)
    """

    def refuse(error: OSError) -> None:
        raise UsageError(
            "E516",
            f"{error.filename or directory}: cannot be read ({error.strerror or error})",
            "fix its permissions or link, or move it out of the run",
        )

    found: list[Path] = []
    for folder, subfolders, names in os.walk(directory, onerror=refuse, followlinks=True):
        base = Path(folder)
        subfolders[:] = [name for name in subfolders if _visible(base / name, directory)]
        for name in names:
            path = base / name
            if not _visible(path, directory):
                continue
            if path.is_symlink() and not path.exists():  # dangling, or a loop of links
                refuse(OSError(40, "a link that leads nowhere or loops", str(path)))
            if name.endswith(".parquet"):
                found.append(readable_file(path))  # E516 for a FIFO, a device or a file it may not open
    return found


def resolve_paths(path: str | Path) -> tuple[tuple[Path, ...], Path | None]:
    """The rollouts files of a RUN argument, in read order, and the run directory if it is one (E501)."""
    text = str(path)
    candidate = Path(text)
    root: Path | None = None
    check_input_path(candidate)  # E516: too long, under a file, a loop of links, a FIFO or a device
    if candidate.is_dir():
        if (candidate / "rollouts").is_dir():
            root = candidate
            files = _parquet_under(candidate / "rollouts")
        else:
            files = _parquet_under(candidate)
    elif candidate.is_file():
        files = [readable_file(candidate)]
    elif globlib.has_magic(text):
        files = [
            Path(p)
            for p in globlib.glob(text, recursive=True)
            if Path(p).is_file() and not Path(p).name.startswith(("_", "."))
        ]
    else:
        files = []
    if not files:
        raise UsageError(
            "E501", f"nothing matched {text}", "give a run directory, a Parquet file, or a quoted glob"
        )
    return tuple(sorted(files, key=_natural_key)), root


def _scan(
    paths: Sequence[Path],
    hive: bool,
    row_filter: pl.Expr | None,
    *,
    with_file: bool = False,
    widened: pl.Schema | None = None,
) -> pl.LazyFrame:
    lazy = pl.scan_parquet(
        [str(p) for p in paths],
        schema=widened,
        cast_options=pl.ScanCastOptions(integer_cast="upcast", float_cast="upcast"),
        hive_partitioning=hive,
        glob=False,  # a path holding `[` or `?` is a name, not a pattern (globs are expanded by resolve_paths)
        include_file_paths=FILE_COLUMN if with_file else None,
        missing_columns="insert",
        extra_columns="ignore",
    )
    coercions = safe_coercions(lazy.collect_schema())  # docs/schema.md: unsigned steps, a signed seq_hash
    lazy = lazy.with_columns(coercions) if coercions else lazy
    return lazy if row_filter is None else lazy.filter(row_filter)


_WIDTHS = (
    (pl.Int8, pl.Int16, pl.Int32, pl.Int64),
    (pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64),
    (pl.Float32, pl.Float64),
)


def _wider(a: pl.DataType, b: pl.DataType) -> pl.DataType | None:
    """The wider of two integer (same signedness) or float types, also inside lists; None for other pairs."""
    if isinstance(a, pl.List) and isinstance(b, pl.List):
        inner = _wider(a.inner, b.inner)
        return None if inner is None else pl.List(inner)
    for family in _WIDTHS:
        if a in family and b in family:
            return a if family.index(a) >= family.index(b) else b
    return None


def _widened_schema(paths: Sequence[Path]) -> pl.Schema | None:
    """The first file's schema with each column widened to the widest integer/float width any file stores it
    in (int32 ids in one file, int64 in another: a lossless upcast), or None when the files agree.

    Other disagreements are left to the reader, which refuses them (E103)."""
    if len(paths) < 2:
        return None
    schemas = [pl.scan_parquet(str(p), glob=False).collect_schema() for p in paths]
    merged = dict(schemas[0])
    for schema in schemas[1:]:
        for name, dtype in schema.items():
            if name in merged and merged[name] != dtype:
                merged[name] = _wider(merged[name], dtype) or merged[name]
    return None if merged == dict(schemas[0]) else pl.Schema(merged)


def _manifest(directory: Path) -> dict[str, Any]:
    """The recompute manifest of `directory` ({} when absent or unreadable)."""
    try:
        manifest = json.loads((directory / "_manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _recompute_dirs(
    root: Path | None, attach: Sequence[str | Path]
) -> tuple[dict[str, Path], dict[str, Path]]:
    """(complete, incomplete) recompute directories by tag. Found under RUN/logprobs/, an unfinished one
    (interrupted or refused run) is set aside as incomplete; an --attach directory is always used (E504 later)."""
    found: dict[str, Path] = {}
    incomplete: dict[str, Path] = {}
    if root is not None and (root / "logprobs").is_dir():
        for sub in sorted((root / "logprobs").iterdir()):
            if sub.is_dir() and not sub.name.startswith(("_", ".")):
                if _manifest(sub).get("complete") is True:
                    found[sub.name] = sub
                else:
                    incomplete[sub.name] = sub
    for directory in attach:
        directory = Path(directory)
        if not directory.is_dir():
            raise UsageError(
                "E501", f"--attach {directory}: not a directory", "give a logprobs/<tag> directory"
            )
        tag = directory.name
        manifest = directory / "_manifest.json"
        tag = str(_manifest_object(manifest).get("tag", tag))
        found[tag] = directory
        incomplete.pop(tag, None)
    return found, incomplete


def _finish_hint(run: Run, tag: str) -> str:
    """The commands that finish (resume) or remove the unfinished recompute `tag` of `run`."""
    directory = run.incomplete[tag]
    finish = (
        _manifest(directory).get("resume_command") or f"pgdiag logprobs {run.root} --model CKPT --tag {tag}"
    )
    return f"finish it: {finish} (resumes); or remove it: rm -r {directory}"


def _incomplete_error(run: Run, tag: str) -> UsageError:
    return UsageError(
        "E504", f"{run.incomplete[tag]}: recompute {tag!r} is incomplete", _finish_hint(run, tag)
    )


def _incomplete_issues(run: Run) -> list[Issue]:
    """W504 for every unfinished recompute under RUN/logprobs/: named, with the commands that finish or remove it."""
    issues = []
    for tag, directory in run.incomplete.items():
        text = (
            f"{directory}: incomplete recompute {tag!r} (interrupted, or refused before its first part); "
            "its stream is not read"
        )
        parts = MessageParts(as_template(text), located=False, once=True)  # every piece of the run says it
        issues.append(Issue("W504", "warning", 1, text, hint=_finish_hint(run, tag), rule=text, parts=parts))
    return issues


def _manifest_object(manifest: Path) -> dict[str, Any]:
    """A recompute ``_manifest.json`` as an object; {} when it is absent, unreadable or JSON of another shape."""
    try:
        value = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _part_schema_has_entropy(directory: Path) -> bool:
    parts = _parquet_under(directory)
    return bool(parts) and "entropy" in pq.read_schema(parts[0]).names


def _part_schema_has_kept(directory: Path) -> bool:
    parts = _parquet_under(directory)
    return bool(parts) and {"kept_mass", "logprobs_full"} <= set(pq.read_schema(parts[0]).names)


def read_run(
    path: str | Path,
    *,
    label: str | None = None,
    attach: Sequence[str | Path] = (),
    steps: str | Sequence[int] | None = None,
    run: str | None = None,
) -> Run:
    """Open RUN (run directory, directory of Parquet, one file or a glob) lazily; see the module docstring.

    Raises UsageError E501 when nothing matches and E505 when the files hold several runs and `run` does not
    pick one; InvalidInputError E101/E104 on a footer that is not pgdiag.rollouts/v1 with token alignment.
    """
    paths, root = resolve_paths(path)
    metas = [read_footer(p) for p in paths]
    for meta, file in zip(metas, paths, strict=True):
        check_rollouts_footer(meta, file)
    hive = any(_HIVE_DIR.match(part) for p in paths for part in p.parent.parts)
    try:
        widened = _widened_schema(paths)
        base = _scan(paths, hive, None, widened=widened)
        schema = base.collect_schema()
    except pl.exceptions.PolarsError as exc:
        raise InvalidInputError("E101", f"{path}: cannot read the Parquet schema ({exc})") from exc
    _check_step_range(paths, hive)
    conditions: list[pl.Expr] = []
    if run is not None:
        conditions.append(pl.col("run").cast(pl.String) == run)
    labels: list[str] = []
    if "run" in schema:
        labels = _run_labels(paths)
        if labels is None:  # no usable statistics: read the one column
            labels = sorted(
                str(v)
                for v in base.select(pl.col("run").cast(pl.String).unique()).collect()["run"].to_list()
                if v is not None
            )
        if run is not None and run not in labels:
            raise UsageError(
                "E501", f"--run {run}: no rows with that run label in {path}", f"labels: {labels}"
            )
        if run is None and len(labels) > 1:
            raise UsageError("E505", f"{path} holds several runs {labels}", "pick one with --run NAME")
    if steps is not None:
        conditions.append(_step_condition(parse_steps(steps), base))
    row_filter = pl.all_horizontal(conditions) if conditions else None
    default_label = run or (labels[0] if labels else (root.name if root is not None else Path(paths[0]).stem))
    recompute, incomplete = _recompute_dirs(root, attach)
    present = [s for s in BASE_STREAMS if stream_column(s) in schema]
    return Run(
        label=label or default_label,
        lazy=_scan(paths, hive, row_filter, widened=widened),
        streams=(*present, *recompute),
        entropy_streams=tuple(tag for tag, d in recompute.items() if _part_schema_has_entropy(d)),
        kept_tags=tuple(tag for tag, d in recompute.items() if _part_schema_has_kept(d)),
        meta=metas[0],
        paths=paths,
        root=root,
        recompute=recompute,
        incomplete=incomplete,
        hive=hive,
        row_filter=row_filter,
        widened=widened,
    )


def _check_step_range(paths: Sequence[Path], hive: bool) -> None:
    """E103 naming the file when a uint64 ``step`` holds a value above int64's range (the coercion to int64 of
    docs/schema.md would fail); read only when the column is uint64."""
    raw = pl.scan_parquet(
        [str(p) for p in paths], hive_partitioning=hive, glob=False, include_file_paths=FILE_COLUMN
    )
    if raw.collect_schema().get("step") != pl.UInt64:
        return
    too_big = raw.select("step", FILE_COLUMN).filter(pl.col("step") > INT64_MAX).head(1).collect()
    if too_big.height:
        raise InvalidInputError(
            "E103",
            f"{too_big[FILE_COLUMN][0]}, column step: uint64 value {too_big['step'][0]} does not fit int64",
            "steps are int64 (docs/schema.md); re-import with pgdiag import",
        )


def _run_labels(paths: Sequence[Path]) -> list[str] | None:
    """The distinct `run` labels from the Parquet row-group statistics, without reading the column; None when a
    file lacks the column or a row group's statistics do not pin one label (min != max, nulls, none kept)."""
    labels: set[str] = set()
    for path in paths:
        metadata = pq.ParquetFile(path).metadata
        names = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
        if "run" not in names:
            return None
        column = names.index("run")
        for group in range(metadata.num_row_groups):
            stats = metadata.row_group(group).column(column).statistics
            if stats is None or not stats.has_min_max or stats.null_count or stats.min != stats.max:
                return None
            labels.add(str(stats.min.decode() if isinstance(stats.min, bytes) else stats.min))
    return sorted(labels)


def run_steps(run: Run) -> list[int]:
    """The distinct steps of `run` (its filters applied), ascending; reads the `step` column alone."""
    return [int(step) for step in step_rows(run)]


def step_rows(run: Run) -> dict[int, int]:
    """Rows per step of `run` (its filters applied), in step order; reads the `step` column alone (E103 when the
    column cannot be read as integers)."""
    try:
        frame = (
            run.lazy.select(pl.col("step").cast(pl.Int64, strict=True))
            .group_by("step")
            .len()
            .sort("step")
            .collect()
        )
    except pl.exceptions.PolarsError as exc:
        raise InvalidInputError(
            "E103", f"{run.display_path(run.paths[0])}, column step: cannot be read as integers ({exc})"
        ) from exc
    return {
        int(s): int(n)
        for s, n in zip(frame["step"].to_list(), frame["len"].to_list(), strict=True)
        if s is not None
    }


def reads_whole(run: Run) -> bool:
    """Whether `run` cannot be read step by step, so a command reads it whole, where the reader says why: a `step`
    column that is missing or not an integer (E102/E103: no piece can filter it) or rows whose `step` is null
    (E213: no piece holds them)."""
    step_type = run.lazy.collect_schema().get("step")
    if step_type is None or not step_type.is_integer():
        return True
    return bool(run.lazy.select(pl.col("step").null_count()).collect().item())


def restrict_steps(run: Run, steps: Sequence[int]) -> Run:
    """`run` limited to the rows of `steps` (one more filter on the scan; the recompute join reads those steps
    only), for commands that read a run step by step."""
    wanted = tuple(sorted({int(s) for s in steps}))
    condition = pl.col("step").is_in(list(wanted))
    row_filter = condition if run.row_filter is None else (run.row_filter & condition)
    return replace(
        run,
        lazy=_scan(run.paths, run.hive, row_filter, widened=run.widened),
        row_filter=row_filter,
        step_subset=wanted,
    )


def step_chunks(rows_per_step: Mapping[int, int], max_rows: int) -> list[tuple[int, ...]]:
    """Consecutive steps grouped so that each group holds at most `max_rows` rows; a step larger than that is a
    group of its own (memory is then bounded by the largest step)."""
    chunks: list[tuple[int, ...]] = []
    current: list[int] = []
    held = 0
    for step, n in rows_per_step.items():
        if current and held + n > max_rows:
            chunks.append(tuple(current))
            current, held = [], 0
        current.append(step)
        held += n
    if current:
        chunks.append(tuple(current))
    return chunks


def _step_condition(spec: StepSpec, base: pl.LazyFrame) -> pl.Expr:
    ranges = list(spec.ranges)
    if spec.last:
        last = base.select(pl.col("step").max()).collect().item()
        if last is not None:
            ranges.append((int(last), int(last)))
    if not ranges:
        return pl.lit(False)
    return pl.any_horizontal([pl.col("step").is_between(lo, hi) for lo, hi in ranges])


def _recompute_frame(
    run: Run, tag: str, want_logprobs: bool, want_entropy: bool, want_kept: bool = False
) -> pl.LazyFrame:
    directory = run.recompute.get(tag)
    if directory is None:
        raise UsageError(
            "E111", f"stream {tag!r} not found in {run.label}", f"streams: {', '.join(run.streams)}"
        )
    manifest = directory / "_manifest.json"
    if _manifest_object(manifest).get("complete") is not True:
        raise UsageError(
            "E504",
            f"{directory}: recompute dataset is incomplete (no _manifest.json with complete: true)",
            "rerun pgdiag logprobs to finish it",
        )
    parts = sorted(_parquet_under(directory), key=_natural_key)
    if not parts:
        raise UsageError("E504", f"{directory}: no recompute parts", "rerun pgdiag logprobs")
    for part in parts:
        check_logprobs_footer(read_footer(part), part)
    lazy = pl.scan_parquet(
        [str(p) for p in parts], hive_partitioning=False, glob=False, missing_columns="insert"
    )
    columns = [
        pl.col("step").cast(pl.Int64),
        pl.col("sample_id").cast(pl.String),
        pl.col("segment_idx").cast(pl.Int32).fill_null(0),
        pl.col("seq_hash").cast(pl.UInt64).alias(f"__{tag}_seq_hash"),
    ]
    if want_logprobs:
        columns.append(pl.col("logprobs").alias(stream_column(tag)))
    if want_entropy:
        columns.append(pl.col("entropy").alias(entropy_column(tag)))
    if want_kept:
        columns.append(pl.col("kept_mass").alias(kept_mass_column(tag)))
        columns.append(pl.col("logprobs_full").alias(full_logprobs_column(tag)))
    if run.step_subset is not None:
        lazy = lazy.filter(pl.col("step").cast(pl.Int64).is_in(list(run.step_subset)))
    return lazy.select(columns)


def _with_recompute(run: Run, lazy: pl.LazyFrame, columns: Sequence[str]) -> pl.LazyFrame:
    """`lazy` left-joined with the recompute parts that provide any of `columns` (E305 columns kept)."""
    for tag in run.recompute:
        want_lp = stream_column(tag) in columns
        want_h = entropy_column(tag) in columns
        want_kept = kept_mass_column(tag) in columns
        if not (want_lp or want_h or want_kept):
            continue
        right = _recompute_frame(run, tag, want_lp, want_h, want_kept)
        lazy = (
            lazy.with_columns(
                pl.col("sample_id").cast(pl.String).alias("__sid"),
                pl.col("segment_idx").cast(pl.Int32).fill_null(0).alias("__seg")
                if "segment_idx" in lazy.collect_schema()
                else pl.lit(0, dtype=pl.Int32).alias("__seg"),
            )
            .join(
                right,
                left_on=["step", "__sid", "__seg"],
                right_on=list(RECOMPUTE_KEYS),
                how="left",
                validate="m:1",
                maintain_order="left",
            )
            .drop("__sid", "__seg")
        )
    return lazy


@dataclass(frozen=True)
class LoadedBatch:
    """A `TokenBatch` and the warnings found while loading it."""

    batch: TokenBatch
    checks: CheckResult


@dataclass(frozen=True)
class LoadedRows:
    """Rows of a run read for validation and flattening, before any rule ran."""

    table: RowTable
    issues: list[Issue]  # E102/E103/E305 found while reading
    streams: tuple[str, ...]
    entropy: tuple[str, ...]


def _typed_issues(run: Run, schema: pl.Schema, columns: Sequence[str]) -> list[Issue]:
    issues = []
    for column in columns:
        problem = cast_problem(column, schema[column]) if column in schema else None
        if problem is not None:
            issues.append(Issue("E103", "error", 1, f"{run.display_path(run.paths[0])}: {problem}"))
    return issues


def _range_issue(column: str, values: np.ndarray, kind: str) -> Issue | None:
    if values.size == 0:
        return None
    if kind == "int32":
        lo, hi = int(values.min()), int(values.max())
        if lo < np.iinfo(np.int32).min or hi > np.iinfo(np.int32).max:
            worst = lo if lo < np.iinfo(np.int32).min else hi
            return Issue("E103", "error", 1, f"{column}: value {worst} does not fit int32")
    elif kind == "float32" and values.dtype == np.float64:
        finite = values[np.isfinite(values)]
        if finite.size and float(np.abs(finite).max()) > _F32_MAX:
            return Issue(
                "E103",
                "error",
                1,
                f"{column}: list<double> with {float(np.abs(finite).max()):.3g} does not fit float32",
            )
    return None


def load_rows(
    run: Run,
    *,
    streams: Sequence[str],
    entropy: Sequence[str] = (),
    scalars: Sequence[str] = (),
    lists: Sequence[str] = (),
    memory: MemoryLimits | None = None,
    kept: bool | None = None,
    kept_of: Sequence[str] = (),
) -> LoadedRows:
    """Collect the needed columns of `run` (recompute joined) and flatten every list column.

    Required columns are always read; missing ones are E102 issues and the rows cannot be loaded
    (an InvalidInputError is raised with the first such issue, as nothing can be validated without them).
    The kept-set columns (`pgdiag.data.kept`), when the run has them, are read and validated (E220-E223) when
    `kept` is True, or by default (None) when the rollout stream is read (its zero-fill rules skip the
    positions whose recorded set holds one token). `kept_of`: recompute tags whose ``kept_mass`` and
    ``logprobs_full`` columns are joined too (``<tag>_kept_mass``, ``<tag>_full_vocab``).
    Before the read, UsageError E518 when the columns of its steps need more memory than is left
    (`pgdiag.data.memory.check_piece_memory`; `memory` says where to read what is left).
    """
    schema = run.lazy.collect_schema()
    stream_cols = [stream_column(s) for s in streams]
    entropy_cols = [entropy_column(t) for t in entropy]
    for stream in (*streams, *entropy):
        if stream in run.incomplete:
            raise _incomplete_error(run, stream)
    for stream in streams:
        if stream not in run.streams:
            raise UsageError(
                "E111", f"{run.label}: no stream {stream!r}", f"streams: {', '.join(run.streams) or 'none'}"
            )
    for tag in entropy:
        if tag not in run.entropy_streams:
            raise UsageError(
                "E111",
                f"{run.label}: no entropy for {tag!r}",
                f"entropy: {', '.join(run.entropy_streams) or 'none'}",
            )
    read_kept = ("rollout" in streams) if kept is None else kept
    kept_cols = [c for c in KEPT_COLUMNS if c in schema] if read_kept else []
    if KEPT_IDS not in kept_cols or KEPT_OFFSETS not in kept_cols:
        kept_cols = []
    file_cols = [
        c
        for c in (*REQUIRED_COLUMNS, "segment_idx", *scalars, *lists, *stream_cols, *kept_cols)
        if c in schema
    ]
    issues = missing_columns(set(schema), REQUIRED_COLUMNS)
    if issues:
        raise InvalidInputError(
            issues[0].code, f"{run.display_path(run.paths[0])}: {issues[0].message}", issues[0].hint
        )
    issues = _typed_issues(run, schema, file_cols)
    if issues:
        raise InvalidInputError("E103", issues[0].message, "re-import with pgdiag import")
    file_cols = list(dict.fromkeys(file_cols))
    check_piece_memory(
        run.label,
        run.paths,
        {*file_cols, *stream_cols},
        run.step_subset,
        memory,
    )
    for tag in kept_of:
        if tag not in run.kept_tags:
            raise UsageError(
                "E111",
                f"{run.label}: recompute {tag!r} holds no kept sets",
                f"kept-set recomputes: {', '.join(run.kept_tags) or 'none'} (pgdiag logprobs --kept-set)",
            )
    kept_extra = [c for tag in kept_of for c in (kept_mass_column(tag), full_logprobs_column(tag))]
    lazy = _with_recompute(run, run.scan(with_file=True), [*stream_cols, *entropy_cols, *kept_extra])
    recompute_hash = [
        f"__{t}_seq_hash" for t in run.recompute if stream_column(t) in stream_cols or t in entropy
    ]
    wanted = [
        *file_cols,
        *(c for c in stream_cols if c not in file_cols),
        *entropy_cols,
        *kept_extra,
        *recompute_hash,
        FILE_COLUMN,
    ]
    try:
        fixed_size = {c for c in wanted if isinstance(schema.get(c), pl.Array)}
        frame = lazy.select(
            pl.col(c).cast(pl.List(schema[c].inner)) if c in fixed_size else pl.col(c) for c in wanted
        ).collect()
    except pl.exceptions.PolarsError as exc:
        raise InvalidInputError(
            "E103",
            f"{run.label}: cannot read the rollouts or join the recompute parts ({exc})",
            "re-import with pgdiag import, or rerun pgdiag logprobs --overwrite",
        ) from exc
    shown = {f: run.display_path(f) for f in frame[FILE_COLUMN].unique().to_list()}
    frame = frame.with_columns(pl.col(FILE_COLUMN).replace_strict(shown, return_dtype=pl.String))
    issues = [*_incomplete_issues(run), *_recompute_issues(run, frame, recompute_hash)]
    list_cols = [
        "input_ids",
        "loss_mask",
        *stream_cols,
        *entropy_cols,
        *kept_extra,
        *(c for c in lists if c in frame.columns),
    ]
    kept_sets = kept_from_series({c: frame[c] for c in kept_cols})
    frame = frame.drop(kept_cols)
    flat: dict[str, FlatList] = {}
    for column in dict.fromkeys(list_cols):
        raw = flat_list(frame[column])
        frame = frame.drop(column)  # frees polars' chunks once Arrow holds the (rechunked) buffers
        if column == "input_ids":
            problem = _range_issue(column, raw.values, "int32") if raw.values.dtype.itemsize > 4 else None
            if problem is not None:
                raise InvalidInputError("E103", problem.message, "re-import with pgdiag import")
            flat[column] = FlatList(
                raw.offsets, raw.values.astype(np.int32, copy=False), raw.valid, raw.row_valid
            )
        elif column == "loss_mask":
            flat[column] = raw
        else:
            problem = _range_issue(column, raw.values, "float32")
            if problem is not None:
                raise InvalidInputError("E103", problem.message, "re-import with pgdiag import")
            flat[column] = FlatList(
                raw.offsets, raw.values.astype(np.float32, copy=False), raw.valid, raw.row_valid
            )
    table = RowTable(frame.drop(recompute_hash), flat, tuple(stream_cols), kept_sets)
    return LoadedRows(table, issues, tuple(streams), tuple(entropy))


def _recompute_issues(run: Run, frame: pl.DataFrame, hash_columns: Sequence[str]) -> list[Issue]:
    issues = []
    for column in hash_columns:
        tag = column[2 : -len("_seq_hash")]
        stale = (frame[column].is_null() | (frame[column] != frame["seq_hash"].cast(pl.UInt64))).fill_null(
            True
        )
        n_stale = int(stale.sum())
        if n_stale:
            first = frame.filter(stale).row(0, named=True)
            parts = MessageParts(
                as_template(f"logprobs/{tag} was computed on other rollouts: ")
                + "{n} samples missing or with another seq_hash (first: {examples})",
                sums=(("n", n_stale),),
                examples=((None, f"step {first['step']}, sample {first['sample_id']}"),),
                max_examples=1,
                located=False,
            )
            issues.append(
                Issue(
                    "E305",
                    "error",
                    n_stale,
                    parts.render(0),
                    step=int(first["step"]),
                    sample_id=str(first["sample_id"]),
                    hint="rerun pgdiag logprobs --overwrite",
                    rule=parts.template,
                    parts=parts,
                )
            )
    return issues


def build_token_batch(
    run: Run,
    frame: pl.DataFrame,
    view: LossView,
    *,
    streams: Sequence[str],
    entropy: Sequence[str] = (),
    sample_row: np.ndarray | None = None,
    advantages: bool = True,
    reward: bool = True,
    env: bool = False,
    kept_of: Sequence[str] = (),
) -> TokenBatch:
    """A float64 `TokenBatch` from the scalar `frame` and the `view` of structurally sound rows.

    Needs no list buffer, so callers can drop them first (peak memory). `sample_row` (S,) maps rows back to
    the rows as read (default: identity).
    """
    offsets = view.row_start  # (S + 1,)
    n_loss = np.diff(offsets)
    n_rows = frame.height
    pos = (view.index - np.repeat(view.seq_offsets[:-1], n_loss)).astype(np.int32)  # (M,)
    group_raw = frame["group_id"].cast(pl.String).fill_null("").to_numpy().astype(object)
    group_names, group = np.unique(group_raw, return_inverse=True)
    adv: np.ndarray | None = None
    if advantages and "advantages" in view.values:
        adv = view.values["advantages"].astype(np.float64)
    elif advantages and "advantage" in frame.columns:
        adv = np.repeat(frame["advantage"].cast(pl.Float64).fill_null(np.nan).to_numpy(), n_loss)
    segment = (
        frame["segment_idx"].fill_null(0).cast(pl.Int32).to_numpy()
        if "segment_idx" in frame.columns
        else np.zeros(n_rows, dtype=np.int32)
    )
    reward_values = (
        frame["reward"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        if reward and "reward" in frame.columns
        else None
    )
    return TokenBatch(
        label=run.label,
        step=frame["step"].cast(pl.Int64).to_numpy(),
        sample_id=frame["sample_id"].cast(pl.String).to_numpy().astype(object),
        segment_idx=segment,
        group=group.astype(np.int64),
        group_names=group_names.astype(object),
        prompt_len=frame["prompt_len"].cast(pl.Int32).to_numpy(),
        seq_len=np.diff(view.seq_offsets).astype(np.int32),
        offsets=offsets,
        pos=pos,
        token_id=view.token_id,
        streams={s: view.values[stream_column(s)].astype(np.float64) for s in streams},
        entropy={t: view.values[entropy_column(t)].astype(np.float64) for t in entropy},
        advantages=adv,
        reward=reward_values,
        env=frame["env"].cast(pl.String).to_numpy().astype(object)
        if env and "env" in frame.columns
        else None,
        sample_row=np.arange(n_rows, dtype=np.int64) if sample_row is None else sample_row,
        seq_hash=frame["seq_hash"].cast(pl.UInt64).fill_null(0).to_numpy()
        if "seq_hash" in frame.columns
        else None,
        kept_size=view.kept_size,
        kept_mass={t: view.values[kept_mass_column(t)].astype(np.float64) for t in kept_of},
        full_vocab={t: view.values[full_logprobs_column(t)].astype(np.float64) for t in kept_of},
    )


def batch_inputs(rows: LoadedRows, found: RowIssues) -> tuple[pl.DataFrame, LossView, np.ndarray]:
    """The scalar frame, loss view and source row indices of the sound rows, for `build_token_batch`."""
    table = found.sound if found.sound is not None else rows.table
    view = found.loss if found.loss is not None else loss_view(table)
    n_rows = rows.table.n_rows
    keep = np.arange(n_rows, dtype=np.int64) if found.bad_rows is None else np.flatnonzero(~found.bad_rows)
    return table.frame, view, keep


def read_token_batch(
    run: Run,
    *,
    streams: Sequence[str],
    entropy: Sequence[str] = (),
    advantages: bool = True,
    reward: bool = True,
    env: bool = False,
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    piece: bool = False,
    raise_errors: bool = True,
    kept_of: Sequence[str] = (),
) -> LoadedBatch:
    """Load, validate and flatten the loss positions of `run` for the given streams.

    Raises InvalidInputError with the first error (lowest code) unless its code is in `ignore`; warnings are
    returned in `LoadedBatch.checks`. Rows with ignored structural errors are left out of the batch.
    `piece`: `run` is one piece of a run read in pieces: the errors of the rules judged over the run (E206's
    share of exact 0.0, E302 by nulls: `Issue.pooled`) do not raise but are returned in the checks with this
    piece's share of those rules (`CheckResult.pending`), for the caller to merge over the pieces
    (`merge_check_results`) and raise the run's verdict. `raise_errors` False: no error raises (the caller
    merges and raises the run's first error, as one read would).
    """
    scalars = [c for c, on in (("advantage", advantages), ("reward", reward), ("env", env)) if on]
    lists = ["advantages"] if advantages else []
    rows = load_rows(run, streams=streams, entropy=entropy, scalars=scalars, lists=lists, kept_of=kept_of)
    found = validate_rows(rows.table, ignore=ignore, max_examples=max_examples)
    issues = [i for i in (*rows.issues, *found.issues) if i.code not in set(ignore)]
    if raise_errors:
        raise_first_error([i for i in issues if not (piece and i.pooled is not None)])
    pending = found.pending
    frame, view, keep = batch_inputs(rows, found)
    kept_streams, kept_entropy = rows.streams, rows.entropy
    del rows, found  # drop the list buffers before the float64 arrays are allocated
    batch = build_token_batch(
        run,
        frame,
        view,
        streams=kept_streams,
        entropy=kept_entropy,
        sample_row=keep,
        advantages=advantages,
        reward=reward,
        env=env,
        kept_of=kept_of,
    )
    return LoadedBatch(batch, check_result(issues, pending=pending))


def run_summary(run: Run) -> dict[str, Any]:
    """Label, files, streams and entropy streams of `run` for result objects and messages."""
    return {
        "label": run.label,
        "files": [run.display_path(p) for p in run.paths],
        "streams": list(run.streams),
        "entropy_streams": list(run.entropy_streams),
    }


def sample_keys(run: Run) -> pl.DataFrame:
    """One row per sample of `run` (its filters applied), in read order: ``step`` (Int64), ``sample_id``
    (String), ``segment_idx`` (Int32, null 0) and ``seq_hash`` (UInt64, null 0), as `read_token_batch` types
    them. Reads these four columns alone (a few bytes per sample), so a command can plan which rows to read
    together before reading any token. Casts are not strict: a column the reader refuses is reported when the
    rows are read; E103 when the columns cannot be read at all."""
    names = run.lazy.collect_schema().names()
    segment = pl.col("segment_idx") if "segment_idx" in names else pl.lit(None)
    try:
        return run.lazy.select(
            pl.col("step").cast(pl.Int64, strict=False),
            pl.col("sample_id").cast(pl.String, strict=False),
            segment.cast(pl.Int32, strict=False).fill_null(0).alias("segment_idx"),
            pl.col("seq_hash").cast(pl.UInt64, strict=False).fill_null(0),
        ).collect()
    except pl.exceptions.PolarsError as exc:
        raise InvalidInputError(
            "E103", f"{run.display_path(run.paths[0])}: cannot read step, sample_id and seq_hash ({exc})"
        ) from exc


def row_keys(run: Run) -> pl.DataFrame | None:
    """`step` (Int64), `sample_id` (String) and `group_id` (String, null as "") of every row of `run` in read
    order, the order of a whole read (files in order, rows in file order, the run's filters applied): a few
    bytes per sample, for a command that must see the whole run's rows before it reads their tokens. None
    when a column cannot be read so; the whole read then reports why."""
    try:
        return run.lazy.select(
            pl.col("step").cast(pl.Int64, strict=True),
            pl.col("sample_id").cast(pl.String),
            pl.col("group_id").cast(pl.String).fill_null(""),
        ).collect()
    except pl.exceptions.PolarsError:
        return None
