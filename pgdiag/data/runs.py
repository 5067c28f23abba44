"""Opening a run: `read_run`, `restrict_steps`, and the `Run` they return (``--steps`` is `pgdiag.data.steps`).

Why: every command starts from a RUN argument (a run directory, a directory of Parquet files, one file or a
quoted glob). How: `read_run` resolves the files (`pgdiag.data.discover`), checks their footers (E101/E104),
discovers the log-prob streams (columns ``<stream>_logprobs`` plus the recompute tags under
``RUN/logprobs/<tag>/`` or ``--attach`` directories) and returns a `Run` whose `lazy` frame is a polars
``scan_parquet`` (hive ``step=`` partitions, step and run filters pushed down); `with_recompute` joins the
recompute parts to it. Reading rows is `pgdiag.data.load`; planning pieces of whole steps is
`pgdiag.data.pieces`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from pgdiag.data.discover import (
    manifest_object,
    natural_key,
    parquet_under,
    part_schema_has_entropy,
    part_schema_has_kept,
    recompute_dirs,
    recompute_manifest,
    resolve_paths,
)
from pgdiag.data.schema import (
    BASE_STREAMS,
    INT64_MAX,
    check_logprobs_footer,
    check_rollouts_footer,
    entropy_column,
    full_logprobs_column,
    kept_kl_column,
    kept_mass_column,
    read_footer,
    safe_coercions,
    stream_column,
)
from pgdiag.data.steps import check_steps_present, parse_steps, step_condition
from pgdiag.data.validate import Issue, MessageParts, as_template
from pgdiag.errors import Code, InvalidInputError, UsageError

FILE_COLUMN = "__file"
RECOMPUTE_KEYS = ("step", "sample_id", "segment_idx")
_HIVE_DIR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[^/]*$")


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
                raise incomplete_error(self, tag)
        lazy = with_recompute(self, self.lazy, columns)
        try:
            return lazy.select(list(columns)).collect()
        except pl.exceptions.PolarsError as exc:
            raise InvalidInputError(
                Code.LOSSY_CAST, f"{self.label}: cannot read columns {list(columns)} ({exc})"
            ) from exc

    def display_path(self, path: str | Path) -> str:
        """`path` as messages show it: as reached from the RUN argument the user gave."""
        return str(Path(path))


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

    A data column named like the reader's own file-path column (``__file``) is left out of the schema: an
    unknown extra column is ignored (docs/schema.md), where it collided with the path column (exit 101).
    Other disagreements are left to the reader, which refuses them (E103)."""
    schemas = [pl.scan_parquet(str(p), glob=False).collect_schema() for p in paths]
    merged = dict(schemas[0])
    for schema in schemas[1:]:
        for name, dtype in schema.items():
            if name in merged and merged[name] != dtype:
                merged[name] = _wider(merged[name], dtype) or merged[name]
    if any(FILE_COLUMN in schema for schema in schemas):
        merged.pop(FILE_COLUMN, None)
        return pl.Schema(merged)
    return None if merged == dict(schemas[0]) else pl.Schema(merged)


def _finish_hint(run: Run, tag: str) -> str:
    """The commands that finish (resume) or remove the unfinished recompute `tag` of `run`."""
    directory = run.incomplete[tag]
    finish = (
        recompute_manifest(directory).get("resume_command")
        or f"pgdiag logprobs {run.root} --model CKPT --tag {tag}"
    )
    return f"finish it: {finish} (resumes); or remove it: rm -r {directory}"


def incomplete_error(run: Run, tag: str) -> UsageError:
    return UsageError(
        Code.INCOMPLETE_RECOMPUTE,
        f"{run.incomplete[tag]}: recompute {tag!r} is incomplete",
        _finish_hint(run, tag),
    )


def incomplete_issues(run: Run) -> list[Issue]:
    """W504 for every unfinished recompute under RUN/logprobs/: named, with the commands that finish or remove it."""
    issues = []
    for tag, directory in run.incomplete.items():
        text = (
            f"{directory}: incomplete recompute {tag!r} (interrupted, or refused before its first part); "
            "its stream is not read"
        )
        parts = MessageParts(as_template(text), located=False, once=True)  # every piece of the run says it
        issues.append(
            Issue(
                Code.UNFINISHED_RECOMPUTE,
                "warning",
                1,
                text,
                hint=_finish_hint(run, tag),
                rule=text,
                parts=parts,
            )
        )
    return issues


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
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE, f"{path}: cannot read the Parquet schema ({exc})"
        ) from exc
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
                Code.INPUT_NOT_FOUND,
                f"--run {run}: no rows with that run label in {path}",
                f"labels: {labels}",
            )
        if run is None and len(labels) > 1:
            raise UsageError(
                Code.AMBIGUOUS_INPUT, f"{path} holds several runs {labels}", "pick one with --run NAME"
            )
    if steps is not None:  # the steps present and `last` are those of the run picked by --run
        spec = parse_steps(steps)
        scoped = base.filter(conditions[0]) if run is not None else base
        check_steps_present(spec, scoped, steps)
        conditions.append(step_condition(spec, scoped))
    row_filter = pl.all_horizontal(conditions) if conditions else None
    default_label = run or (labels[0] if labels else (root.name if root is not None else Path(paths[0]).stem))
    recompute, incomplete = recompute_dirs(root, attach)
    present = [s for s in BASE_STREAMS if stream_column(s) in schema]
    return Run(
        label=label or default_label,
        lazy=_scan(paths, hive, row_filter, widened=widened),
        streams=(*present, *recompute),
        entropy_streams=tuple(tag for tag, d in recompute.items() if part_schema_has_entropy(d)),
        kept_tags=tuple(tag for tag, d in recompute.items() if part_schema_has_kept(d)),
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
    files = [str(p) for p in paths]
    if pl.scan_parquet(files, hive_partitioning=hive, glob=False).collect_schema().get("step") != pl.UInt64:
        return
    raw = pl.scan_parquet(  # `step` alone: a data column named __file would collide with the path column
        files,
        schema=pl.Schema({"step": pl.UInt64}),
        hive_partitioning=hive,
        glob=False,
        include_file_paths=FILE_COLUMN,
        missing_columns="insert",
        extra_columns="ignore",
    )
    too_big = raw.select("step", FILE_COLUMN).filter(pl.col("step") > INT64_MAX).head(1).collect()
    if too_big.height:
        raise InvalidInputError(
            Code.LOSSY_CAST,
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


def _recompute_frame(
    run: Run, tag: str, want_logprobs: bool, want_entropy: bool, want_kept: bool = False
) -> pl.LazyFrame:
    directory = run.recompute.get(tag)
    if directory is None:
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"stream {tag!r} not found in {run.label}",
            f"streams: {', '.join(run.streams)}",
        )
    manifest = directory / "_manifest.json"
    if manifest_object(manifest).get("complete") is not True:
        raise UsageError(
            Code.INCOMPLETE_RECOMPUTE,
            f"{directory}: recompute dataset is incomplete (no _manifest.json with complete: true)",
            "rerun pgdiag logprobs to finish it",
        )
    parts = sorted(parquet_under(directory), key=natural_key)
    if not parts:
        raise UsageError(
            Code.INCOMPLETE_RECOMPUTE, f"{directory}: no recompute parts", "rerun pgdiag logprobs"
        )
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
        if "kept_kl" in lazy.collect_schema():  # written with the engine's kept log-probs
            columns.append(pl.col("kept_kl").alias(kept_kl_column(tag)))
    if run.step_subset is not None:
        lazy = lazy.filter(pl.col("step").cast(pl.Int64).is_in(list(run.step_subset)))
    return lazy.select(columns)


def with_recompute(run: Run, lazy: pl.LazyFrame, columns: Sequence[str]) -> pl.LazyFrame:
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
            Code.LOSSY_CAST,
            f"{run.display_path(run.paths[0])}: cannot read step, sample_id and seq_hash ({exc})",
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
