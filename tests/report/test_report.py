"""Report round trip (docs/compare.md): tidy table, nulls never NaN, infinities kept, atomic files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.report.report import REPORT_SCHEMA, Report, ReportRow, load_report, summary_frame


def _report() -> Report:
    pair = "a:old vs a:new"
    rows = [
        ReportRow(pair, "token", "all", "all", "policy/kl_k3", 0.018095, "nats", "token", 13),
        ReportRow(pair, "token", "all", "all", "entropy/mean", None, "nats", "token", 0),
        ReportRow(pair, "token", "all", "all", "policy/ratio_max", math.inf, "ratio", "tok", 13),
        ReportRow(pair, "token", "step", "0", "policy/kl_k3", math.nan, "nats", "token", 0),
        ReportRow(
            pair,
            "token",
            "prob_bucket",
            "[0.9,0.99)",
            "mismatch/abs_mean",
            0.25,
            "nats",
            "token",
            4,
            0.9,
            0.99,
        ),
    ]
    worst = pl.DataFrame({"pair": [pair], "step": [0], "sample_id": ["s1"], "pos": [3], "dlogp": [0.3]})
    return Report("metrics", summary_frame(rows), meta={"settings": {"eps_low": 0.2}}, worst_tokens=worst)


def test_summary_types_and_nan_becomes_null() -> None:
    summary = _report().summary
    assert dict(summary.schema) == REPORT_SCHEMA
    step_row = summary.filter(pl.col("breakdown") == "step")
    assert step_row["value"].to_list() == [None]  # NaN is never stored


def test_round_trip(tmp_path: Path) -> None:
    report = _report()
    files = report.write(tmp_path / "out")
    assert files.report.name == "metrics.parquet" and files.json.name == "metrics.json"
    loaded = load_report(files.report)
    assert loaded.summary.equals(report.summary)
    assert loaded.meta == {"settings": {"eps_low": 0.2}}
    assert loaded.worst_tokens is not None and loaded.worst_tokens.equals(report.worst_tokens)
    assert loaded.value("policy/kl_k3") == pytest.approx(0.018095)
    assert loaded.value("policy/ratio_max") == math.inf
    assert loaded.value("entropy/mean") is None
    assert loaded.value("mismatch/abs_mean", breakdown="prob_bucket", bucket="[0.9,0.99)") == 0.25
    # a directory holding one report loads too
    assert load_report(tmp_path / "out").summary.equals(report.summary)
    # the dictionary-encoded columns of the report
    schema = pq.read_schema(files.report)
    assert str(schema.field("metric").type).startswith("dictionary")
    # JSON has no infinity: it is written as a string
    data = json.loads(files.json.read_text())
    assert data["summary"]["a:old vs a:new"]["policy/ratio_max"] == "inf"


def test_wide_pivots_one_column_per_metric() -> None:
    wide = _report().wide()
    row = wide.filter(pl.col("breakdown") == "all")
    assert row["policy/kl_k3"].to_list() == [pytest.approx(0.018095)]


def test_no_overwrite_without_flag_and_no_temp_files(tmp_path: Path) -> None:
    report = _report()
    report.write(tmp_path)
    with pytest.raises(UsageError) as info:
        report.write(tmp_path)
    assert info.value.code == "E502"
    report.write(tmp_path, overwrite=True)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_load_rejects_non_report(tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    pl.DataFrame({"a": [1]}).write_parquet(path)
    with pytest.raises(InvalidInputError, match="not a pgdiag report"):
        load_report(path)
    with pytest.raises(UsageError):
        load_report(tmp_path / "missing.parquet")
