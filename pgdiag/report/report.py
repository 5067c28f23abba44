"""`Report`: the result of `metrics` and `compare`, as tidy long tables (docs/compare.md, docs/notebook.md).

A report is one tidy long `summary` table (one row per pair, scope, breakdown, bucket and metric) plus the checks
that ran, optional worst-K tables, and a `meta` dict with the settings and inputs. The same object is what the
Python API returns, what `--json` prints (`to_json_dict`), and what `--out` writes: ``<name>.parquet`` (the
summary, `pgdiag.report/v1`), ``<name>.json`` (the `--json` object) and ``<name>.worst_tokens.parquet`` /
``<name>.worst_seqs.parquet``. `load_report` reads them back, so notebooks get exactly what the CLI computed.

Usage::

    report = pgdiag.load_report("run/reports/metrics.parquet")
    report.wide()                       # one row per (pair, scope, breakdown, bucket), one column per metric
    report.value("policy/kl_k3")        # a single number, None when not computable
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pgdiag.data.issues import ISSUE_SCHEMA
from pgdiag.data.schema import decode_footer
from pgdiag.errors import Code, InvalidInputError, UsageError

REPORT_SCHEMA_ID = "pgdiag.report/v1"

REPORT_SCHEMA: dict[str, pl.DataType] = {
    "pair": pl.String(),
    "scope": pl.String(),
    "breakdown": pl.String(),
    "bucket": pl.String(),
    "bucket_lo": pl.Float64(),
    "bucket_hi": pl.Float64(),
    "metric": pl.String(),
    "value": pl.Float64(),
    "unit": pl.String(),
    "reduction": pl.String(),
    "n": pl.Int64(),
}
CATEGORICAL_COLUMNS = ("pair", "scope", "breakdown", "metric", "unit", "reduction")

CHECKS_SCHEMA = ISSUE_SCHEMA  # a report's checks table is the issue model's (`data.issues.issues_frame`)


@dataclass(frozen=True)
class ReportRow:
    """One cell of the tidy report. `value` None = not computable (never NaN)."""

    pair: str
    scope: str
    breakdown: str
    bucket: str
    metric: str
    value: float | None
    unit: str
    reduction: str
    n: int
    bucket_lo: float | None = None
    bucket_hi: float | None = None

    @classmethod
    def overall(
        cls, pair: str, metric: str, value: float | None, unit: str, reduction: str, n: int
    ) -> ReportRow:
        """The row of `metric` over all tokens of `pair` (scope ``token``, breakdown and bucket ``all``)."""
        return cls(pair, "token", "all", "all", metric, value, unit, reduction, n)


def _clean(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def summary_frame(rows: Iterable[ReportRow]) -> pl.DataFrame:
    """The tidy summary table of `rows` with the report's column types."""
    rows = list(rows)
    columns: dict[str, list[Any]] = {name: [] for name in REPORT_SCHEMA}
    for row in rows:
        columns["pair"].append(row.pair)
        columns["scope"].append(row.scope)
        columns["breakdown"].append(row.breakdown)
        columns["bucket"].append(row.bucket)
        columns["bucket_lo"].append(_clean(row.bucket_lo))
        columns["bucket_hi"].append(_clean(row.bucket_hi))
        columns["metric"].append(row.metric)
        columns["value"].append(_clean(row.value))
        columns["unit"].append(row.unit)
        columns["reduction"].append(row.reduction)
        columns["n"].append(int(row.n))
    return pl.DataFrame(columns, schema=REPORT_SCHEMA)


def empty_checks() -> pl.DataFrame:
    """A checks table with no rows."""
    return pl.DataFrame(schema=CHECKS_SCHEMA)


def json_number(value: float | None) -> float | str | None:
    """A float for JSON: None stays null, infinities become the strings "inf" / "-inf" (JSON has none)."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return json_number(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _jsonable(obj.item())
    return obj


@dataclass(frozen=True)
class ReportFiles:
    """Paths written by `Report.write`."""

    report: Path
    json: Path
    worst_tokens: Path | None = None
    worst_seqs: Path | None = None

    def as_dict(self) -> dict[str, str]:
        """{role: path} of the files written (the `files` of the `--json` object)."""
        return {k: str(v) for k, v in self.__dict__.items() if v is not None}


def report_files(path: str | Path, kind: str, *, worst: bool = True) -> ReportFiles:
    """Where `Report.write(path)` puts a `kind` report: ``<dir>/<kind>.*`` or ``<name>.parquet`` and its siblings
    (`worst`: with the worst-K tables). Pure path arithmetic: nothing is read or written."""
    path = Path(path)
    directory, name = (path.parent, path.stem) if path.suffix == ".parquet" else (path, kind)
    return ReportFiles(
        directory / f"{name}.parquet",
        directory / f"{name}.json",
        directory / f"{name}.worst_tokens.parquet" if worst else None,
        directory / f"{name}.worst_seqs.parquet" if worst else None,
    )


@dataclass(frozen=True)
class Report:
    """Result of `compute_metrics` / `compare_runs`: tidy summary, checks, worst-K tables, settings."""

    kind: str  # "metrics" | "compare"
    summary: pl.DataFrame  # REPORT_SCHEMA columns
    meta: dict[str, Any] = field(default_factory=dict)
    checks: pl.DataFrame = field(default_factory=empty_checks)
    worst_tokens: pl.DataFrame | None = None
    worst_seqs: pl.DataFrame | None = None

    def with_meta(self, **fields: Any) -> Report:
        """This report with `fields` added to its `meta` (e.g. the verdict before it is saved)."""
        return replace(self, meta={**self.meta, **fields})

    def wide(self) -> pl.DataFrame:
        """One row per (pair, scope, breakdown, bucket), one column per metric."""
        keys = ["pair", "scope", "breakdown", "bucket"]
        return self.summary.pivot(on="metric", index=keys, values="value", aggregate_function="first")

    def value(
        self,
        metric: str,
        *,
        pair: str | None = None,
        scope: str | None = None,
        breakdown: str = "all",
        bucket: str = "all",
    ) -> float | None:
        """The value of `metric` in one cell; None when absent or not computable."""
        frame = self.summary.filter(
            (pl.col("metric") == metric) & (pl.col("breakdown") == breakdown) & (pl.col("bucket") == bucket)
        )
        if pair is not None:
            frame = frame.filter(pl.col("pair") == pair)
        if scope is not None:
            frame = frame.filter(pl.col("scope") == scope)
        if frame.height == 0:
            return None
        return frame["value"][0]

    def metric_names(self) -> list[str]:
        """Metric keys in first-appearance order."""
        return self.summary["metric"].unique(maintain_order=True).to_list()

    def to_json_dict(self) -> dict[str, Any]:
        """The `summary` block of the `--json` object: {pair: {metric: value}} on `breakdown = all` rows,
        plus per-step values and the checks; the command layer adds status, gates, timing."""
        summary: dict[str, dict[str, Any]] = {}
        all_rows = self.summary.filter(pl.col("breakdown") == "all")
        for pair, metric, scope, value in all_rows.select("pair", "metric", "scope", "value").iter_rows():
            key = metric if scope in ("token", "batch") else f"{scope}.{metric}"
            summary.setdefault(pair, {})[key] = json_number(value)
        by_bucket: dict[str, dict[str, dict[str, Any]]] = {}
        other = self.summary.filter(pl.col("breakdown") != "all")
        for breakdown, bucket, metric, value in other.select(
            "breakdown", "bucket", "metric", "value"
        ).iter_rows():
            by_bucket.setdefault(breakdown, {}).setdefault(bucket, {})[metric] = json_number(value)
        return {
            "kind": self.kind,
            "summary": summary,
            "breakdowns": by_bucket,
            "checks": _jsonable(self.checks.to_dicts()),
            "meta": _jsonable(self.meta),
        }

    def write(
        self, path: str | Path, *, overwrite: bool = False, result: Mapping[str, Any] | None = None
    ) -> ReportFiles:
        """Write the report as ``<name>.parquet`` + ``<name>.json`` (+ worst-K tables), atomically.

        `path` is a directory (files ``<dir>/<kind>.*``) or a ``.parquet`` file name. `result` is the command's
        `--json` object, stored as ``<name>.json`` (default: `to_json_dict()`), its ``files`` completed with the
        files written here. UsageError E502 when a file exists (without `overwrite`) or a file
        stands where the directory must be.
        """
        from pgdiag.data.writing import check_destination, directory_lock, write_json, write_parquet

        planned = report_files(path, self.kind)
        report_path, json_path = planned.report, planned.json
        worst_tokens_path = planned.worst_tokens if self.worst_tokens is not None else None
        worst_seqs_path = planned.worst_seqs if self.worst_seqs is not None else None
        targets = [p for p in (report_path, json_path, worst_tokens_path, worst_seqs_path) if p is not None]
        check_destination(report_path.parent, targets, overwrite=overwrite)
        report_path.parent.mkdir(parents=True, exist_ok=True)
        # a second writer waits, then finds the first report (E502) or, with overwrite, replaces it whole
        with directory_lock(report_path.parent):
            check_destination(report_path.parent, targets, overwrite=overwrite)
            written = ReportFiles(report_path, json_path, worst_tokens_path, worst_seqs_path)
            if result is not None:
                result = {**result, "files": {**written.as_dict(), **(result.get("files") or {})}}
            metadata = {
                "pgdiag.schema": REPORT_SCHEMA_ID,
                "pgdiag.report": {"kind": self.kind, "meta": _jsonable(self.meta)},
                "pgdiag.checks": _jsonable(self.checks.to_dicts()),
            }
            table = self.summary.to_arrow()
            for name_ in CATEGORICAL_COLUMNS:
                index = table.schema.get_field_index(name_)
                table = table.set_column(index, name_, table.column(name_).dictionary_encode())
            if worst_tokens_path is not None:
                write_parquet(
                    self.worst_tokens, worst_tokens_path, metadata={"pgdiag.schema": REPORT_SCHEMA_ID}
                )
            if worst_seqs_path is not None:
                write_parquet(self.worst_seqs, worst_seqs_path, metadata={"pgdiag.schema": REPORT_SCHEMA_ID})
            write_parquet(table, report_path, metadata=metadata)
            write_json(_jsonable(result if result is not None else self.to_json_dict()), json_path)
        return written


REPORT_KINDS = ("metrics", "compare", "whatif", "drift", "explain")

# Documented shapes of the `meta` entries a saved report is read back through (docs/report.md): a key absent is
# fine, a key present must hold this JSON type (lists: of this item type), else E105.
_META_SHAPES: dict[str, tuple[type, type | None]] = {
    "pairs": (list, str),
    "notices": (list, str),
    "steps": (list, dict),
    "verdict": (dict, None),
    "settings": (dict, None),
    "gate_policy": (dict, None),
    "change_points": (dict, None),
    "labels": (dict, None),
    "inputs": (dict, None),
}
_NESTED_SHAPES: dict[tuple[str, str], tuple[type | tuple[type, ...], type | None]] = {
    ("verdict", "findings"): (list, dict),
    ("verdict", "line"): (str, None),
    ("gate_policy", "fail_on"): (list, str),
    ("gate_policy", "known_metrics"): (list, str),
    ("gate_policy", "default_family"): ((str, type(None)), None),
    ("gate_policy", "default_profile"): ((str, type(None)), None),
    ("change_points", "found"): (list, dict),
}


def _shape_error(path: Path, entry: str, expected: str, value: Any) -> InvalidInputError:
    return InvalidInputError(
        Code.BAD_FOOTER_SHAPE,
        f"{path}: footer {entry} is a {type(value).__name__}, not {expected}",
        "rewrite the report with pgdiag metrics/compare --out --overwrite",
    )


def _checked_shape(path: Path, entry: str, value: Any, shape: tuple[Any, type | None]) -> None:
    outer, item = shape
    names = {list: "a JSON list", dict: "a JSON object", str: "a string"}
    if not isinstance(value, outer):
        raise _shape_error(path, entry, names.get(outer, "a string or null"), value)
    if item is not None and not all(isinstance(v, item) for v in value):
        bad = next(v for v in value if not isinstance(v, item))
        raise _shape_error(path, f"{entry}[...]", names[item], bad)


def _checked_footer(
    footer: Mapping[str, Any], path: Path
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(kind, meta, checks rows) of a report footer; E101 for an unknown kind, E105 for a shape not documented."""
    header = footer.get("report", {})
    if not isinstance(header, dict):
        raise _shape_error(path, "pgdiag.report", "a JSON object", header)
    kind = header.get("kind", "metrics")
    if kind not in REPORT_KINDS:
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE,
            f"{path}: not a pgdiag report of a known kind (kind={kind!r})",
            f"kinds: {', '.join(REPORT_KINDS)}",
        )
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise _shape_error(path, "pgdiag.report.meta", "a JSON object", meta)
    for key, shape in _META_SHAPES.items():
        if key in meta:
            _checked_shape(path, f"pgdiag.report.meta.{key}", meta[key], shape)
    for (outer, key), shape in _NESTED_SHAPES.items():
        if key in meta.get(outer, {}):
            _checked_shape(path, f"pgdiag.report.meta.{outer}.{key}", meta[outer][key], shape)
    checks = footer.get("checks", [])
    _checked_shape(path, "pgdiag.checks", checks, (list, dict))
    return str(kind), meta, checks


def _checks_frame(rows: list[dict[str, Any]], path: Path) -> pl.DataFrame:
    if not rows:
        return empty_checks()
    try:
        return pl.DataFrame(
            [{name: row.get(name) for name in CHECKS_SCHEMA} for row in rows],
            schema=CHECKS_SCHEMA,
            strict=True,
        )
    except (pl.exceptions.PolarsError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidInputError(
            Code.BAD_FOOTER_SHAPE,
            f"{path}: footer pgdiag.checks rows do not hold the documented fields ({exc})",
            "rewrite the report with pgdiag metrics/compare --out --overwrite",
        ) from None


def _summary_frame(table: pa.Table, path: Path) -> pl.DataFrame:
    """The summary columns cast to `REPORT_SCHEMA` (E102 a column missing, E103 one of another type); NaN values
    read as null (a report's "not computable"), infinities kept."""
    for name in REPORT_SCHEMA:
        if name not in table.column_names:
            raise InvalidInputError(
                Code.MISSING_COLUMN,
                f"{path}: required column {name} is missing",
                "rewrite the report with pgdiag metrics/compare --out --overwrite",
            )
    frame = pl.from_arrow(table.select(list(REPORT_SCHEMA)))
    assert isinstance(frame, pl.DataFrame)
    for name, dtype in REPORT_SCHEMA.items():
        try:
            if dtype.is_numeric() and not frame.schema[name].is_numeric():
                raise pl.exceptions.InvalidOperationError(name)  # numbers are never parsed from text
            frame = frame.with_columns(pl.col(name).cast(dtype, strict=True))
        except pl.exceptions.PolarsError:
            raise InvalidInputError(
                Code.LOSSY_CAST,
                f"{path}, column {name}: type {frame.schema[name]} cannot be cast losslessly to {dtype}",
                "rewrite the report with pgdiag metrics/compare --out --overwrite",
            ) from None
    return frame.with_columns(pl.col("value").fill_nan(None))


def _side_table(path: Path) -> pl.DataFrame | None:
    """A worst-K table beside a report, None when absent; E101 when it is not readable Parquet."""
    if not path.exists():
        return None
    return read_table_file(path)


def read_table_file(path: str | Path, *, finite: Iterable[str] = ()) -> pl.DataFrame:
    """A Parquet table pgdiag wrote beside a report (a token table, a worst trace, a worst-K table).

    E516 for a path that is not a readable regular file, E101 for a file that is not Parquet, E103 for a
    `finite` column that does not cast to float64, E207 for a null, NaN or ±inf in one (named with its row).
    """
    from pgdiag.data.paths import readable_file

    path = readable_file(path)
    try:
        frame = pl.read_parquet(path, glob=False)
    except (OSError, pl.exceptions.PolarsError, pa.ArrowException) as exc:
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE, f"{path}: not a readable Parquet file ({one_line_text(exc)})"
        ) from None
    for name in finite:
        if name not in frame.columns:
            continue
        try:
            if not frame.schema[name].is_numeric():
                raise pl.exceptions.InvalidOperationError(name)
            values = frame[name].cast(pl.Float64, strict=True)
        except pl.exceptions.PolarsError:
            raise InvalidInputError(
                Code.LOSSY_CAST,
                f"{path}, column {name}: type {frame.schema[name]} cannot be cast losslessly to Float64",
            ) from None
        bad = ~values.is_finite().fill_null(False)
        if bool(bad.any()):
            row = int(bad.arg_max() or 0)
            raise InvalidInputError(
                Code.NON_FINITE,
                f"{path}, row {row}, column {name}: {values[row]} ({int(bad.sum())} null, NaN or ±inf values)",
                "rewrite it with pgdiag compare --tokens-out --overwrite",
            )
        frame = frame.with_columns(values)
    return frame


def one_line_text(exc: BaseException) -> str:
    """The first line of an exception's text (library messages carry multi-line advice)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def load_report(path: str | Path) -> Report:
    """Read a report written by `Report.write` (the ``.parquet`` file, or a directory holding one report).

    UsageError E501 when nothing is found; InvalidInputError E101 for a file that is not a pgdiag report (not
    Parquet, another schema, an unknown kind), E102/E103 for a summary column missing or of another type, E105
    for a footer entry not of its documented shape.
    """
    from pgdiag.data.paths import check_input_path, readable_file

    path = Path(path)
    if check_input_path(path) is None:
        raise UsageError(Code.INPUT_NOT_FOUND, f"{path}: no such report")
    if path.is_dir():
        candidates = sorted(p for p in path.glob("*.parquet") if ".worst_" not in p.name)
        if len(candidates) != 1:
            raise UsageError(
                Code.INPUT_NOT_FOUND, f"{path}: expected one report .parquet, found {len(candidates)}"
            )
        path = candidates[0]
    readable_file(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE, f"{path}: not a readable Parquet file ({one_line_text(exc)})"
        ) from None
    footer = decode_footer(table.schema.metadata)
    if footer.get("schema") != REPORT_SCHEMA_ID:
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE, f"{path}: not a pgdiag report (schema={footer.get('schema')!r})"
        )
    kind, meta, checks_rows = _checked_footer(footer, path)
    summary = _summary_frame(table, path)
    checks = _checks_frame(checks_rows, path)
    stem = path.name[: -len(".parquet")] if path.name.endswith(".parquet") else path.stem
    return Report(
        kind=kind,
        summary=summary,
        meta=meta,
        checks=checks,
        worst_tokens=_side_table(path.with_name(f"{stem}.worst_tokens.parquet")),
        worst_seqs=_side_table(path.with_name(f"{stem}.worst_seqs.parquet")),
    )
