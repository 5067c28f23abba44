"""The refactor baseline: `metrics` and `compare` summary frames on `sample_data/` equal the saved ones."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_baseline", HERE / "make_baseline.py")
make_baseline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_baseline)
CASES = make_baseline.cases()


def test_every_case_has_a_saved_frame() -> None:
    saved = {p.stem for p in HERE.glob("*.parquet")}
    assert saved == set(CASES)


# Floating-point sums (means, spreads, fits, correlations) may move in their last bits when numpy, polars or
# pyarrow change their summation order between versions: those rows are held to FLOAT_RTOL (plus FLOAT_ATOL for
# values near zero), as docs/reliability.md says. Rows exact by construction stay exact: keys, counts, fractions
# of counts (a `share` is a ratio of float sums, so it is not one), and order statistics (maxima, minima,
# quantiles), which pick or interpolate stored values.
FLOAT_RTOL, FLOAT_ATOL = 1e-10, 1e-12
EXACT_BY_CONSTRUCTION = (
    (pl.col("unit") == "count")
    | ((pl.col("unit") == "fraction") & ~pl.col("metric").str.contains("share"))  # a share is a ratio of sums
    | pl.col("metric").str.contains(r"(_max|_min|_p\d+)$")
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_summary_frame_equals_baseline(name: str) -> None:
    expected = pl.read_parquet(HERE / f"{name}.parquet")
    got = CASES[name]()
    assert got.drop("value").equals(expected.drop("value"))  # every row, key, unit and count
    exact = EXACT_BY_CONSTRUCTION
    assert_frame_equal(got.filter(exact), expected.filter(exact), check_exact=True)
    np.testing.assert_allclose(
        got.filter(~exact)["value"].to_numpy(),
        expected.filter(~exact)["value"].to_numpy(),
        rtol=FLOAT_RTOL,
        atol=FLOAT_ATOL,
    )


COMPARE_BY_STEP = {
    "compare-run_a-run_b": (("run_a", "run_b"), {}),
    "compare-synthetic_a-synthetic_b": (("synthetic_a", "synthetic_b"), {}),
    "compare-run_a-old-new": (("run_a",), {"stream_a": "old", "stream_b": "new"}),
}


@pytest.mark.parametrize("name", sorted(COMPARE_BY_STEP))
def test_compare_read_step_by_step_equals_baseline(name: str) -> None:
    """The compare baselines with every step read as its own piece (`chunk_rows=1`): every row, key, count and
    order statistic exact, the sums within FLOAT_RTOL (the pooled ones are regrouped by step)."""
    import pgdiag

    runs, options = COMPARE_BY_STEP[name]
    sources = [pgdiag.read_run(make_baseline.ROOT / r) for r in runs]
    comparison = pgdiag.compare_runs(*sources, chunk_rows=1, **options)
    assert comparison.pair is None  # read in pieces, not whole
    got, expected = comparison.report.summary, pl.read_parquet(HERE / f"{name}.parquet")
    assert got.drop("value").equals(expected.drop("value"))
    exact = EXACT_BY_CONSTRUCTION
    assert_frame_equal(got.filter(exact), expected.filter(exact), check_exact=True)
    np.testing.assert_allclose(
        got.filter(~exact)["value"].to_numpy(),
        expected.filter(~exact)["value"].to_numpy(),
        rtol=FLOAT_RTOL,
        atol=FLOAT_ATOL,
    )
