"""Malformed reports and token tables for `pgdiag plot` and `pgdiag report` (docs/reliability.md).

An explicit corpus of the cases the reliability campaign found (a degenerate report, a report missing a column,
a file that is not Parquet, a footer of the wrong shape or kind, an absurd `--dpi`), then hypothesis-driven
damage of a valid report: each ends in a plot (exit 0) or one ``error[CODE]`` line with the code's exit code,
and a refused command leaves no figure in `--out`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from clean_error import error_code, files_under, run_cli
from hypothesis import given
from hypothesis import strategies as st
from sample_paths import SAMPLE_DATA
from test_fuzz_inputs import fuzz_settings

from pgdiag.report import plots
from pgdiag.report.report import REPORT_SCHEMA, load_report

SAMPLE = SAMPLE_DATA
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A metrics report, a compare report (with its worst trace) and a token table of the sample runs."""
    root = tmp_path_factory.mktemp("reports")
    for args in (
        ["metrics", SAMPLE / "run_a", "--out", root / "m"],
        [
            "compare",
            SAMPLE / "run_a",
            SAMPLE / "run_b",
            "--out",
            root / "c",
            "--tokens-out",
            root / "tok.parquet",
        ],
    ):
        result = run_cli(args)
        assert result.exit_code == 0, result.output
    return {
        "metrics": root / "m" / "metrics.parquet",
        "compare": root / "c" / "compare.parquet",
        "tokens": root / "tok.parquet",
    }


def _rewrite(source: Path, target: Path, table: pa.Table) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(source).metadata), target)
    return target


def _with_values(table: pa.Table, value) -> pa.Table:
    index = table.schema.get_field_index("value")
    values = [None if v is None else value(v) for v in table.column("value").to_pylist()]
    return table.set_column(index, "value", pa.array(values, pa.float64()))


def _plot(report: Path, out: Path, *extra: str):
    return run_cli(["plot", report, "--out", out, *extra])


def _refused(result, out: Path, code: str) -> None:
    assert error_code(result) == code, result.output
    assert files_under(out) == set(), result.output


@pytest.mark.parametrize("kind", ["metrics", "compare"])
@pytest.mark.parametrize(
    "value",
    [lambda v: -abs(v) - 1.0, lambda v: 0.0, lambda v: float("nan"), lambda v: float("inf"), lambda v: 1e308],
)
def test_degenerate_values_still_plot(saved: dict[str, Path], tmp_path: Path, kind: str, value) -> None:
    # all values <= 0 on a log axis ("Data cannot be log-scaled"), NaN or inf in every cell: a plot, not exit 101
    report = _rewrite(
        saved[kind], tmp_path / "r" / f"{kind}.parquet", _with_values(pq.read_table(saved[kind]), value)
    )
    shutil.copy(
        saved["compare"].with_name("compare.worst_trace.parquet"),
        report.with_name(f"{kind}.worst_trace.parquet"),
    )
    result = _plot(report, tmp_path / "plots")
    assert result.exit_code == 0, result.output
    figures = sorted((tmp_path / "plots").glob("*.png"))
    kinds = plots.TREND_KINDS if kind == "metrics" else plots.COMPARE_KINDS
    drawn_or_said = {f.stem for f in figures} | {k for k in kinds if f"skipped {k}: " in result.output}
    assert drawn_or_said == set(kinds), result.output  # NaN reads as "not computable": skipped, with why
    assert figures or value(1.0) != value(1.0), result.output  # only all-NaN leaves nothing to draw
    assert all(f.read_bytes()[:8] == PNG_MAGIC for f in figures)


def test_histogram_with_no_positive_count_falls_back_to_a_linear_axis(saved: dict[str, Path]) -> None:
    report = load_report(saved["compare"])
    zeroed = report.summary.with_columns(
        pl.when(pl.col("breakdown") == "dlogp").then(0.0).otherwise(pl.col("value")).alias("value")
    )
    from dataclasses import replace

    ax = plots.plot_dlogp_hist(replace(report, summary=zeroed)).axes[0]
    assert ax.get_yscale() == "linear"
    assert "no positive count" in ax.get_ylabel()
    assert plots.plot_dlogp_hist(report).axes[0].get_yscale() == "log"


@pytest.mark.parametrize("column", sorted(REPORT_SCHEMA))
def test_report_missing_a_column_is_e102(saved: dict[str, Path], tmp_path: Path, column: str) -> None:
    report = _rewrite(
        saved["compare"], tmp_path / "r" / "compare.parquet", pq.read_table(saved["compare"]).drop([column])
    )
    for result in (_plot(report, tmp_path / "plots"), run_cli(["report", report])):
        _refused(result, tmp_path / "plots", "E102")
        assert f"column {column}" in result.output


def test_report_column_of_another_type_is_e103(saved: dict[str, Path], tmp_path: Path) -> None:
    table = pq.read_table(saved["metrics"])
    index = table.schema.get_field_index("value")
    strings = pa.array([str(v) for v in table.column("value").to_pylist()])
    report = _rewrite(
        saved["metrics"], tmp_path / "r" / "metrics.parquet", table.set_column(index, "value", strings)
    )
    for result in (_plot(report, tmp_path / "plots"), run_cli(["report", report])):
        _refused(result, tmp_path / "plots", "E103")
        assert "value" in result.output


@pytest.mark.parametrize("content", [b"", b"PAR1", b'{"a": 1}', b"\x00" * 4096])
def test_report_that_is_not_parquet_is_e101(tmp_path: Path, content: bytes) -> None:
    report = tmp_path / "metrics.parquet"
    report.write_bytes(content)
    for result in (_plot(report, tmp_path / "plots"), run_cli(["report", report])):
        _refused(result, tmp_path / "plots", "E101")


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        ("pgdiag.report", [1], "E105"),
        ("pgdiag.report", {"kind": "metrics", "meta": [1]}, "E105"),
        ("pgdiag.report", {"kind": "zzz", "meta": {}}, "E101"),
        ("pgdiag.report", {"kind": 7, "meta": {}}, "E101"),
        ("pgdiag.checks", {"a": 1}, "E105"),
        ("pgdiag.checks", [{"code": 5, "count": "x"}], "E105"),
        ("pgdiag.checks", [1, 2], "E105"),
    ],
)
def test_report_footer_of_another_shape_or_kind(
    saved: dict[str, Path], tmp_path: Path, key: str, value, code: str
) -> None:
    table = pq.read_table(saved["metrics"])
    metadata = {**table.schema.metadata, key.encode(): json.dumps(value).encode()}
    report = tmp_path / "r" / "metrics.parquet"
    report.parent.mkdir()
    pq.write_table(table.replace_schema_metadata(metadata), report)
    for result in (_plot(report, tmp_path / "plots"), run_cli(["report", report])):
        _refused(result, tmp_path / "plots", code)


def test_empty_report_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    # issue 22: a report with zero rows was accepted (exit 0, every plot skipped); it is E511 now
    report = _rewrite(
        saved["metrics"], tmp_path / "r" / "metrics.parquet", pq.read_table(saved["metrics"]).slice(0, 0)
    )
    for extra in ((), ("--kind", "trend-kl")):
        result = _plot(report, tmp_path / "plots", *extra)
        _refused(result, tmp_path / "plots", "E511")
        assert "the report has no rows to plot" in result.output


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (lambda t: t.with_columns(lp_a=pl.lit(float("nan"))), "E207"),
        (lambda t: t.with_columns(lp_b=pl.lit(float("-inf"))), "E207"),
        (lambda t: t.with_columns(lp_a=pl.lit(None, pl.Float64)), "E207"),
        (lambda t: t.with_columns(lp_a=pl.col("lp_a").cast(pl.String)), "E103"),
        (lambda t: t.drop("lp_b"), "E511"),
    ],
)
def test_damaged_token_table(saved: dict[str, Path], tmp_path: Path, change, code: str) -> None:
    table = change(pl.read_parquet(saved["tokens"])).to_arrow()
    tokens = _rewrite(saved["tokens"], tmp_path / "tok.parquet", table)
    for kind in ("all", "hexbin", "dlogp-vs-logprob", "dlogp-hist"):
        _refused(_plot(tokens, tmp_path / "plots", "--kind", kind), tmp_path / "plots", code)


@pytest.mark.parametrize("dpi", ["100000", "5000"])
def test_dpi_past_the_pixel_limit_is_e503_and_writes_nothing(
    saved: dict[str, Path], tmp_path: Path, dpi: str
) -> None:
    result = _plot(saved["metrics"], tmp_path / "plots", "--dpi", dpi)
    _refused(result, tmp_path / "plots", "E503")
    assert f"{plots.MAX_FIGURE_PIXELS:,} pixels" in result.output


@pytest.mark.parametrize("dpi", ["0", "-3", "9", "1e9", "x"])
def test_dpi_out_of_range_is_one_error_line(saved: dict[str, Path], tmp_path: Path, dpi: str) -> None:
    from pgdiag.cli import run

    assert run(["plot", str(saved["metrics"]), "--out", str(tmp_path / "plots"), "--dpi", dpi]) == 2
    assert files_under(tmp_path / "plots") == set()


def test_largest_dpi_inside_the_limit_draws(saved: dict[str, Path], tmp_path: Path) -> None:
    # the pixel limit is on the figure, so the largest dpi allowed depends on the figure's size in inches
    dpi = int(np.sqrt(plots.MAX_FIGURE_PIXELS / (plots.FIGSIZE[0] * plots.FIGSIZE[1])))
    result = _plot(saved["compare"], tmp_path / "plots", "--kind", "by-prob", "--dpi", str(dpi))
    assert result.exit_code == 0, result.output
    from PIL import Image

    with Image.open(tmp_path / "plots" / "by-prob.png") as image:
        assert image.size[0] * image.size[1] <= plots.MAX_FIGURE_PIXELS


def _contract(report: Path, out: Path) -> None:
    """plot and report on `report`: exit 0/1, or one error line with its code's exit code and no figure."""
    for args in (["plot", report, "--out", out], ["report", report]):
        shutil.rmtree(out, ignore_errors=True)
        result = run_cli(args)
        if result.exit_code in (0, 1):
            continue
        error_code(result)
        assert files_under(out) == set(), result.output


REPORT_FOOTER_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["kind", "meta", "code", "count", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
COLUMN_CHANGES = {
    "drop": lambda c: None,
    "string": lambda c: pa.array([None if v is None else str(v) for v in c.to_pylist()], pa.string()),
    "float": lambda c: pa.array([float(len(str(v))) for v in c.to_pylist()], pa.float64()),
    "nulls": lambda c: pa.nulls(len(c), c.type),
    "large_string": lambda c: c.cast(pa.large_string()) if pa.types.is_string(c.type) else c,
}
VALUE_CHANGES = st.sampled_from([0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e-300, None])


def test_fuzz_report_footer(saved: dict[str, Path], tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(
        which=st.sampled_from(["metrics", "compare"]),
        key=st.sampled_from(["pgdiag.report", "pgdiag.checks", "pgdiag.schema"]),
        value=REPORT_FOOTER_VALUES,
    )
    def case(which: str, key: str, value: object) -> None:
        table = pq.read_table(saved[which])
        metadata = {**table.schema.metadata, key.encode(): json.dumps(value).encode()}
        report = tmp_path / "r" / f"{which}.parquet"
        report.parent.mkdir(exist_ok=True)
        pq.write_table(table.replace_schema_metadata(metadata), report)
        _contract(report, tmp_path / "plots")

    case()


def test_fuzz_report_columns_and_values(saved: dict[str, Path], tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(
        which=st.sampled_from(["metrics", "compare"]),
        column=st.sampled_from(sorted(REPORT_SCHEMA)),
        change=st.sampled_from(sorted(COLUMN_CHANGES)),
        values=st.lists(VALUE_CHANGES, min_size=1, max_size=4),
    )
    def case(which: str, column: str, change: str, values: list) -> None:
        table = pq.read_table(saved[which])
        new = COLUMN_CHANGES[change](table.column(column))
        index = table.schema.get_field_index(column)
        table = table.drop([column]) if new is None else table.set_column(index, column, new)
        if "value" in table.column_names and pa.types.is_floating(table.schema.field("value").type):
            cells = table.column("value").to_pylist()
            cells = [values[i % len(values)] if i % 3 == 0 else v for i, v in enumerate(cells)]
            table = table.set_column(
                table.schema.get_field_index("value"), "value", pa.array(cells, pa.float64())
            )
        report = _rewrite(saved[which], tmp_path / "r" / f"{which}.parquet", table)
        _contract(report, tmp_path / "plots")

    case()


def test_fuzz_report_bytes(saved: dict[str, Path], tmp_path: Path, fuzz_examples: int) -> None:
    good = saved["metrics"].read_bytes()

    @fuzz_settings(fuzz_examples)
    @given(cut=st.integers(0, len(good)), noise=st.binary(max_size=64), at=st.integers(0, len(good)))
    def case(cut: int, noise: bytes, at: int) -> None:
        damaged = bytearray(good[:cut] if cut < len(good) - 8 else good)
        damaged[at : at + len(noise)] = noise
        report = tmp_path / "r" / "metrics.parquet"
        report.parent.mkdir(exist_ok=True)
        report.write_bytes(bytes(damaged))
        _contract(report, tmp_path / "plots")

    case()


@pytest.fixture(scope="module")
def analysis_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A whatif and a drift report of the sample run."""
    root = tmp_path_factory.mktemp("analysis")
    for kind in ("whatif", "drift"):
        result = run_cli([kind, SAMPLE / "run_a", "--out", root / kind])
        assert result.exit_code == 0, result.output
    return {kind: root / kind / f"{kind}.parquet" for kind in ("whatif", "drift")}


@pytest.mark.parametrize("kind", ["whatif", "drift"])
@pytest.mark.parametrize(
    "value",
    [lambda v: -abs(v) - 1.0, lambda v: float("nan"), lambda v: float("inf"), lambda v: 1e308],
)
def test_degenerate_whatif_and_drift_reports_still_plot(
    analysis_reports: dict[str, Path], tmp_path: Path, kind: str, value
) -> None:
    source = analysis_reports[kind]
    report = _rewrite(source, tmp_path / "r" / source.name, _with_values(pq.read_table(source), value))
    result = _plot(report, tmp_path / "plots", "--kind", kind)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / f"{kind}.png").read_bytes()[:8] == PNG_MAGIC


def test_drift_change_points_of_another_shape_are_left_out(
    analysis_reports: dict[str, Path], tmp_path: Path
) -> None:
    source = analysis_reports["drift"]
    table = pq.read_table(source)
    header = json.loads(table.schema.metadata[b"pgdiag.report"])
    metric = pl.from_arrow(table).filter(pl.col("breakdown") == "step")["metric"][0]
    header["meta"]["change_points"] = {
        "found": [
            {"metric": metric},
            {"metric": metric, "step": "one", "jump": 1.0, "after": 1.0},
            {"metric": 7, "step": 1, "jump": 1.0, "after": 1.0},
            {"metric": metric, "step": 1, "jump": float("inf"), "after": 1.0},
            {"metric": metric, "step": 1, "jump": 0.5, "after": 0.25},
        ]
    }
    metadata = {**table.schema.metadata, b"pgdiag.report": json.dumps(header).encode()}
    report = tmp_path / "r" / source.name
    report.parent.mkdir()
    pq.write_table(table.replace_schema_metadata(metadata), report)
    result = _plot(report, tmp_path / "plots", "--kind", "drift")
    assert result.exit_code == 0, result.output
    figure = plots.plot_drift(load_report(report))
    labels = [t.get_text() for ax in figure.axes for t in ax.texts]
    assert labels == ["step 1: +0.5"]
