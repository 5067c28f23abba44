"""Every plot kind on the sample data and on a report with a tiny bucket: title, units and counts are read back
from the matplotlib figure objects (texts, tick labels, bar patches, line data), never from pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sample_paths import SAMPLE_DATA

from pgdiag.errors import UsageError
from pgdiag.report import plots
from pgdiag.report.report import Report, ReportRow, summary_frame

SAMPLE = SAMPLE_DATA
PAIR = "run_a:new vs run_b:new"


@pytest.fixture(scope="module")
def comparison():
    from pgdiag.compare.api import compare_runs
    from pgdiag.data.runs import read_run

    return compare_runs(read_run(SAMPLE / "run_a"), read_run(SAMPLE / "run_b"))


@pytest.fixture(scope="module")
def metrics_report() -> Report:
    from pgdiag.data.runs import read_run
    from pgdiag.metrics.api import compute_metrics

    return compute_metrics(read_run(SAMPLE / "run_a"))


def _tiny_bucket_report() -> Report:
    """Two position buckets (n = 1000 and n = 1), a step with 2 tokens, and the 0.0016..0.0020 range of |Δ|
    that looks dramatic on an axis not starting at 0."""
    rows = [
        ReportRow(
            PAIR, "token", "position", "0", "mismatch/abs_mean", 0.0016, "nats", "token-mean", 1000, 0, 1
        ),
        ReportRow(PAIR, "token", "position", "1", "mismatch/abs_mean", 0.0020, "nats", "token-mean", 1, 1, 2),
        ReportRow(
            PAIR, "token", "prob_bucket", "[0,0.5)", "mismatch/abs_mean", 0.0018, "nats", "t", 3, 0, 0.5
        ),
        ReportRow(
            PAIR, "token", "prob_bucket", "[0.5,1]", "mismatch/abs_mean", 0.0017, "nats", "t", 998, 0.5, 1
        ),
        ReportRow(PAIR, "token", "step", "0", "mismatch/abs_mean", 0.0016, "nats", "token-mean", 999, 0, 0),
        ReportRow(PAIR, "token", "step", "1", "mismatch/abs_mean", 0.0020, "nats", "token-mean", 2, 1, 1),
    ]
    return Report("compare", summary_frame(rows), meta={"pairs": [PAIR]})


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def _bars(ax) -> list:
    from matplotlib.patches import Rectangle

    return [p for p in ax.patches if isinstance(p, Rectangle)]


@pytest.mark.parametrize(
    ("kind", "breakdown", "xlabel"),
    [("by-position", "position", "response position"), ("by-prob", "prob_bucket", "probability")],
)
def test_bucket_plots_on_sample_data(comparison, kind, breakdown, xlabel) -> None:
    report = comparison.report
    fig = plots.build_figures(report, kinds=(kind,)).figures[kind]
    ax = fig.axes[0]
    rows = report.summary.filter(
        (pl.col("breakdown") == breakdown) & (pl.col("metric") == "mismatch/abs_mean")
    ).sort("bucket_lo")
    assert ax.get_title().startswith("mean |Δ| by")
    assert ax.get_ylabel() == "mean |Δ| (nats)" and xlabel in ax.get_xlabel()
    # one bar and one count per bucket, in bucket order; the bar height is the report's value
    assert [t.get_text() for t in ax.get_xticklabels()] == rows["bucket"].to_list()
    assert _texts(ax) == [f"n={n:,}" for n in rows["n"].to_list()]
    bars = _bars(ax)
    assert [b.get_height() for b in bars] == pytest.approx(rows["value"].to_list())
    assert [b.get_alpha() for b in bars] == [1.0 if n >= 30 else 0.3 for n in rows["n"].to_list()]
    assert ax.get_ylim()[0] == 0.0  # mean |Δ| is a magnitude
    assert ax.get_legend().get_texts()[0].get_text() == "run_a:new vs run_b:new"


def test_sample_position_plot_fades_its_14_token_bucket(comparison) -> None:
    ax = plots.plot_by_position(comparison.report).axes[0]
    faded = [t for t, b in zip(_texts(ax), _bars(ax), strict=True) if b.get_alpha() < 1]
    assert faded == ["n=14"]  # [16,32) holds 14 of 1,756 tokens
    assert "faded: n < 30" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_tiny_bucket_is_faded_counted_and_axis_starts_at_zero() -> None:
    report = _tiny_bucket_report()
    ax = plots.plot_by_position(report).axes[0]
    assert _texts(ax) == ["n=1,000", "n=1"]
    assert [b.get_alpha() for b in _bars(ax)] == [1.0, plots.FADED_ALPHA]
    bottom, top = ax.get_ylim()
    assert bottom == 0.0 and top >= 0.0020  # not a 0.0016..0.0020 zoom
    ax = plots.plot_by_prob(report).axes[0]
    assert _texts(ax) == ["n=3", "n=998"] and _bars(ax)[0].get_alpha() == plots.FADED_ALPHA
    ax = plots.plot_by_step(report).axes[0]
    assert ax.get_xticks().tolist() == [0, 1]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0\nn=999", "1\nn=2"]
    assert ax.collections[0].get_alpha().tolist() == [1.0, plots.FADED_ALPHA]


def test_by_step_has_integer_ticks_with_counts(comparison) -> None:
    report = comparison.report
    ax = plots.plot_by_step(report).axes[0]
    rows = report.summary.filter((pl.col("breakdown") == "step") & (pl.col("metric") == "mismatch/abs_mean"))
    steps = sorted(int(b) for b in rows["bucket"].to_list())
    assert ax.get_xticks().tolist() == steps == [0, 1, 2, 3]  # no half steps
    n_of = dict(zip(rows["bucket"].cast(pl.Int64).to_list(), rows["n"].to_list(), strict=True))
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{s}\nn={n_of[s]:,}" for s in steps]
    assert sum(n_of.values()) == 1756
    assert ax.get_title() == "mean |Δ| per step" and ax.get_ylabel() == "mean |Δ| (nats)"
    assert ax.get_ylim()[0] == 0.0


def test_dlogp_hist_leaves_out_the_empty_outer_bins(comparison) -> None:
    report = comparison.report
    rows = report.summary.filter(pl.col("breakdown") == "dlogp")
    ax = plots.plot_dlogp_hist(report).axes[0]
    heights = [b.get_height() for b in _bars(ax)]
    assert sum(heights) == 1756 == rows["value"].sum()  # every token is in a drawn bin
    # 29 bins in the report, 14 of them empty; drawn: the occupied range plus one empty bin either side
    assert rows.height == 29 and (rows["value"] == 0).sum() == 14
    assert len(heights) == 17 and heights[0] == 0 and heights[-1] == 0 and all(h > 0 for h in heights[1:-1])
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels.index("0 (exact)") == labels.index("[-1e-06,0)") + 1 == labels.index("[0,1e-06)") - 1
    assert ax.get_title() == "Δ histogram  (n = 1,756 tokens)"
    assert ax.get_xlabel() == "Δ = run_b:new − run_a:new (nats, bin edges)" and ax.get_ylabel() == "tokens"


def test_dlogp_hist_from_tokens_uses_the_data_range() -> None:
    tokens = pl.DataFrame({"lp_a": [-1.0, -2.0, -3.0, -0.5], "lp_b": [-1.1, -2.0, -2.9, -0.5]})
    ax = plots.plot_dlogp_hist(tokens, bins=4).axes[0]
    heights = [b.get_height() for b in _bars(ax)]
    assert sum(heights) == 4 and heights[0] == 1 and heights[-1] == 1  # no empty bin beyond the data


def test_worst_trace_names_the_streams(comparison) -> None:
    trace = comparison.trace()
    ax = plots.plot_worst_trace(trace).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["run_a:new", "run_b:new", "Δ = run_b:new − run_a:new"]
    assert ax.get_title() == (
        f"worst sequence: step {trace['step'][0]}, sample {trace['sample_id'][0]}  ({trace.height} tokens)"
    )
    assert ax.get_ylabel() == "log-prob (nats)" and ax.get_xlabel() == "response position (tokens)"
    assert ax.lines[0].get_ydata().tolist() == trace["lp_a"].to_list()


def test_dlogp_vs_logprob_replaces_the_hexbin_of_near_equal_runs(comparison) -> None:
    pair = comparison.pair
    plot_set = plots.build_figures(comparison.report, tokens=pair, trace=comparison.trace())
    assert list(plot_set.figures) == [
        "dlogp-vs-logprob",
        "dlogp-hist",
        "by-prob",
        "by-position",
        "by-step",
        "worst-trace",
    ]
    assert "near-equal" in plot_set.skipped["hexbin"] and "dlogp-vs-logprob" in plot_set.skipped["hexbin"]
    ax = plot_set.figures["dlogp-vs-logprob"].axes[0]
    assert ax.get_ylabel() == "Δ = run_b:new − run_a:new (nats)"
    assert ax.get_xlabel() == "log-prob, run_a:new (nats)"
    assert ax.get_title() == "Δ vs log-prob  (n = 1,756 tokens)"
    assert ax.collections[0].get_array().sum() == 1756  # every token in a hexagon
    # the Δ axis spans Δ, not the log-prob range: a near-equal pair is not a line on y = x
    assert max(abs(v) for v in ax.get_ylim()) < 0.2
    # asked for by name, the hexbin is drawn anyway, with the stream names on its axes
    hexbin = plots.build_figures(comparison.report, kinds=("hexbin",), tokens=pair).figures["hexbin"]
    assert hexbin.axes[0].get_ylabel() == "log-prob, run_b:new (nats)"


def test_hexbin_kept_for_runs_that_differ() -> None:
    rng = np.random.default_rng(0)
    lp_a = -rng.exponential(2.0, 500)
    tokens = pl.DataFrame({"lp_a": lp_a, "lp_b": lp_a + rng.normal(0, 1.0, 500)})
    plot_set = plots.build_figures(tokens=tokens)
    assert list(plot_set.figures) == ["dlogp-vs-logprob", "hexbin", "dlogp-hist"] and not plot_set.skipped
    assert plot_set.figures["hexbin"].axes[0].collections[0].get_array().sum() == 500


def test_all_says_what_it_skipped_and_named_kinds_fail(comparison) -> None:
    plot_set = plots.build_figures(comparison.report)  # a saved report: no token data, no trace
    assert set(plot_set.skipped) == {"dlogp-vs-logprob", "hexbin", "worst-trace"}
    assert "--tokens-out" in plot_set.skipped["hexbin"]
    with pytest.raises(UsageError, match="plot hexbin: needs token data") as info:
        plots.build_figures(comparison.report, kinds=("hexbin",))
    assert info.value.code == "E511"  # the plot's input lacks its data
    with pytest.raises(UsageError, match="unknown plot kind"):
        plots.build_figures(comparison.report, kinds=("pie",))


TREND_UNITS = {
    "trend-kl": "nats",
    "trend-clip": "fraction",
    "trend-ess": "fraction of N",
    "trend-ratio": "ratio",
    "trend-mismatch": "nats",
}


def _per_step(report: Report, metric: str) -> dict[int, tuple[float | None, int]]:
    rows = report.summary.filter((pl.col("breakdown") == "step") & (pl.col("metric") == metric))
    return {int(b): (v, n) for b, v, n in rows.select("bucket", "value", "n").iter_rows()}


@pytest.mark.parametrize("kind", list(TREND_UNITS))
def test_trend_plots_of_a_metrics_report(metrics_report, kind) -> None:
    fig = plots.build_figures(metrics_report, kinds=(kind,)).figures[kind]
    ax = fig.axes[0]
    panel = plots.TREND_PANELS[kind]
    assert ax.get_title().startswith(panel.title)
    assert ax.get_ylabel() == TREND_UNITS[kind]
    assert ax.get_xlabel() == "step" and ax.get_xticks().tolist() == [0, 1, 2, 3]
    first = ax.lines[0].get_label()
    counts = _per_step(metrics_report, first)
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{s}\nn={counts[s][1]:,}" for s in range(4)]
    for line in ax.lines:
        values = _per_step(metrics_report, line.get_label())
        assert line.get_ydata().tolist() == pytest.approx([values[s][0] for s in range(4)])
    assert [line.get_label() for line in ax.lines] == [
        m for m in panel.metrics if m in _metrics(metrics_report)
    ]
    if kind == "trend-ratio":
        assert ax.get_yscale() == "log"  # ratio max 275 next to ratio min 1.5e-4
    elif kind != "trend-kl":
        assert ax.get_ylim()[0] == 0.0


def _metrics(report: Report) -> set[str]:
    return set(report.summary.filter(pl.col("breakdown") == "step")["metric"].to_list())


def test_trend_loss_draws_every_mode_on_its_own_axes(metrics_report) -> None:
    fig = plots.plot_trend(metrics_report, "trend-loss")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    modes = [m for m in metrics_report.metric_names() if m.startswith("loss/")]
    with_values = [m for m in modes if any(v is not None for v, _ in _per_step(metrics_report, m).values())]
    assert titles == with_values and "loss/token_mean" in titles and "loss/constant" not in titles
    assert "loss" in fig.get_suptitle()


def test_anomaly_marks_on_trend_plots(metrics_report) -> None:
    ratio_max = _per_step(metrics_report, "policy/ratio_max")[1][0]
    mark = plots.Mark("policy/ratio_max", 1, f"ratio max {ratio_max:.0f} > 10")
    ax = plots.plot_trend(metrics_report, "trend-ratio", marks=[mark]).axes[0]
    assert _texts(ax) == ["ratio max 275 > 10"]
    ring = ax.collections[-1]
    assert ring.get_offsets().tolist() == [[1.0, pytest.approx(ratio_max)]]
    assert ring.get_edgecolor()[0].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_metrics_report_all_trends_and_tiny_step() -> None:
    rows = [
        ReportRow("r:old vs r:new", "token", "step", str(s), m, v, u, "token", n, s, s)
        for s, n in ((0, 400), (1, 1))
        for m, v, u in (("policy/kl_k3", 0.01 * (s + 1), "nats"), ("policy/ess_token", 0.9 - 0.85 * s, "1"))
    ]
    report = Report("metrics", summary_frame(rows), meta={"pairs": ["r:old vs r:new"]})
    plot_set = plots.build_figures(report)
    assert list(plot_set.figures) == ["trend-kl", "trend-ess"]
    assert set(plot_set.skipped) == {"trend-clip", "trend-ratio", "trend-mismatch", "trend-loss"}
    assert "rollout stream" in plot_set.skipped["trend-mismatch"]
    ax = plot_set.figures["trend-ess"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0\nn=400", "1\nn=1"]
    assert ax.get_title().endswith("r:old vs r:new")


def test_save_figures_writes_each_kind(comparison, tmp_path) -> None:
    plot_set = plots.build_figures(comparison.report, kinds=("by-step", "dlogp-hist"))
    written = plots.save_figures(plot_set, tmp_path, fmt="svg")
    assert set(written) == {"by-step", "dlogp-hist"}
    assert all(Path(p).read_text().lstrip().startswith("<?xml") for p in written.values())
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_many_steps_keep_integer_ticks() -> None:
    rows = [
        ReportRow(
            "r:old vs r:new", "token", "step", str(s), "policy/kl_k3", 0.001 * s, "nats", "token", 50, s, s
        )
        for s in range(40)
    ]
    report = Report("metrics", summary_frame(rows), meta={})
    ax = plots.plot_trend(report, "trend-kl").axes[0]
    fig = ax.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # the locator places its ticks at draw time
    ticks = [t for t in ax.get_xticks().tolist() if 0 <= t <= 39]
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks)
    assert ax.lines[0].get_xdata().tolist() == list(range(40))


def test_key_style_report_says_why_it_has_no_trends() -> None:
    rows = [ReportRow("r:old vs r:new", "token", "step", "0", "actor/ppo_kl", 0.1, "nats", "token", 5, 0, 0)]
    report = Report("metrics", summary_frame(rows), meta={"settings": {"key_style": "verl"}})
    plot_set = plots.build_figures(report)
    assert not plot_set.figures and set(plot_set.skipped) == set(plots.TREND_KINDS)
    assert (
        plot_set.skipped["trend-kl"]
        == "trend plots read pgdiag's own keys; this report has --key-style verl keys"
    )


def test_whatif_and_drift_reports_draw_their_own_figure() -> None:
    from pgdiag.errors import UsageError

    rows = [
        ReportRow(
            "r:rollout vs r:old", "token", "threshold", rule, metric, value, "fraction", "token-mean", 9
        )
        for rule, metric, value in (
            ("none", "whatif/ess_token", 0.9),
            ("token_tis:2", "whatif/tokens_kept", 1.0),
            ("token_tis:2", "whatif/ess_token_after", 0.95),
        )
    ]
    whatif = plots.build_figures(
        Report("whatif", summary_frame(rows), meta={"pairs": ["r:rollout vs r:old"]})
    )
    assert list(whatif.figures) == ["whatif"] and whatif.skipped == {}
    (ax,) = whatif.figures["whatif"].axes
    assert ax.collections[0].get_offsets().tolist() == [[1.0, 0.95]]  # tokens kept, ESS after
    steps = [
        ReportRow(
            "r:old vs r:new", "token", "step", str(s), "actor/ppo_kl", 0.1 * s, "nats", "token", 5, s, s
        )
        for s in range(3)
    ]
    meta = {"settings": {"key_style": "verl"}, "change_points": {"found": []}}
    drift = plots.build_figures(Report("drift", summary_frame(steps), meta=meta))
    assert list(drift.figures) == ["drift"] and set(drift.skipped) == set(plots.TREND_KINDS)
    assert drift.figures["drift"].axes[0].lines[0].get_ydata().tolist() == pytest.approx([0.0, 0.1, 0.2])
    with pytest.raises(UsageError, match="plot whatif: needs a whatif report"):
        plots.build_figures(Report("drift", summary_frame(steps), meta=meta), kinds=("whatif",))
