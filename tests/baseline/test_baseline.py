"""The refactor baseline: `metrics` and `compare` summary frames on `sample_data/` equal the saved ones.

Every row is exactly equal, with one stated exception: the `all` row of a framework key style is pooled from
the step rows since `metrics` reads a run step by step (`metrics.styles.pooled.pool_style_steps`,
docs/key-styles.md). Its values are the same sums re-associated (per-step numerators added instead of one
pooled sum), so they agree within 1e-12 relative (measured: at most 2.4e-13, verl's χ² = mean − 1); the keys the
pool rules declare not decomposable (a Pearson correlation) are null there. Per-step rows stay exact.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles.pooled import pool_rules

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_baseline", HERE / "make_baseline.py")
make_baseline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_baseline)
CASES = make_baseline.cases()


def test_every_case_has_a_saved_frame() -> None:
    saved = {p.stem for p in HERE.glob("*.parquet")}
    assert saved == set(CASES)


STYLE_ALL_ROW_RTOL = 1e-12  # the key-style all row pooled from step rows (module docstring)
STYLE_CASES = {"metrics-constant-verl-": "verl"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_summary_frame_equals_baseline(name: str) -> None:
    expected = pl.read_parquet(HERE / f"{name}.parquet")
    got = CASES[name]()
    style = next((s for prefix, s in STYLE_CASES.items() if name.startswith(prefix)), None)
    if style is None:
        assert_frame_equal(got, expected, check_exact=True)
        return
    steps = pl.col("breakdown") != "all"
    assert_frame_equal(got.filter(steps), expected.filter(steps), check_exact=True)
    rules = pool_rules(MetricSettings(key_style=style))
    undecomposable = [k for k, rule in rules.items() if rule.kind == "none"]
    pooled, saved = got.filter(~steps), expected.filter(~steps)
    assert pooled.drop("value").equals(saved.drop("value"))
    gone = pooled.filter(pl.col("metric").is_in(undecomposable))
    assert gone["value"].null_count() == gone.height
    kept = ~pl.col("metric").is_in(undecomposable)
    assert_frame_equal(
        pooled.filter(kept), saved.filter(kept), check_exact=False, rel_tol=STYLE_ALL_ROW_RTOL, abs_tol=0.0
    )


COMPARE_BY_STEP = {
    "compare-run_a-run_b": (("run_a", "run_b"), {}),
    "compare-synthetic_a-synthetic_b": (("synthetic_a", "synthetic_b"), {}),
    "compare-run_a-old-new": (("run_a",), {"stream_a": "old", "stream_b": "new"}),
}
POOLED_RTOL = (
    1e-12  # pooled means, spreads, fits and quantiles of buckets spread over steps (docs/compare.md)
)


@pytest.mark.parametrize("name", sorted(COMPARE_BY_STEP))
def test_compare_read_step_by_step_equals_baseline(name: str) -> None:
    """The compare baselines with every step read as its own piece (`chunk_rows=1`): every row, key and count
    exact, the `step` buckets, the sequence scope and the maxima exact, the pooled rest within 1e-12."""
    import pgdiag

    runs, options = COMPARE_BY_STEP[name]
    sources = [pgdiag.read_run(make_baseline.ROOT / r) for r in runs]
    comparison = pgdiag.compare_runs(*sources, chunk_rows=1, **options)
    assert comparison.pair is None  # read in pieces, not whole
    got, expected = comparison.report.summary, pl.read_parquet(HERE / f"{name}.parquet")
    assert got.drop("value").equals(expected.drop("value"))
    exact = (
        (pl.col("breakdown") == "step")
        | (pl.col("unit") == "count")
        | (pl.col("scope") == "sequence")
        | ((pl.col("breakdown") == "all") & pl.col("metric").str.contains(r"abs_(dprob_)?max"))
    )
    assert_frame_equal(got.filter(exact), expected.filter(exact), check_exact=True)
    assert_frame_equal(
        got.filter(~exact), expected.filter(~exact), check_exact=False, rel_tol=POOLED_RTOL, abs_tol=1e-15
    )
