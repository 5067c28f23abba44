"""The one-file HTML report: its content (escaped, self-contained, atomically written), the CLI's `--html` on
`compare`, `metrics` and `plot`, and the page in a real headless Chromium (DevTools protocol over a pipe): no
console error, every image decoded, the verdict visible above the fold."""

from __future__ import annotations

import html
import json
import re
import struct
import sys
from pathlib import Path

import polars as pl
import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.errors import UsageError
from pgdiag.report import plots
from pgdiag.report.html import render_html, write_html
from pgdiag.report.report import Report, ReportRow, summary_frame

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chromium_page import VIEWPORT, chromium_binary, open_page

SAMPLE = SAMPLE_DATA
needs_chromium = pytest.mark.skipif(chromium_binary() is None, reason="no chromium binary on PATH")


def _invoke(*args: object):
    return CliRunner().invoke(build_app(), [str(a) for a in args])


def _hostile_report() -> Report:
    """A report whose labels and messages carry markup: the page must show them as text."""
    pair = "<b>a</b>:new vs b&c:new"
    rows = [
        ReportRow(pair, "token", "all", "all", "mismatch/abs_mean", 0.25, "nats", "token-mean", 4),
        ReportRow(pair, "sequence", "all", "all", "mismatch/abs_mean", 0.5, "nats", "seq-mean", 2),
        ReportRow(pair, "token", "position", "0", "mismatch/abs_mean", 0.25, "nats", "token-mean", 4, 0, 1),
    ]
    checks = pl.DataFrame(
        {
            "code": ["W401"],
            "severity": ["warning"],
            "count": [1],
            "message": ["<script>alert(1)</script>"],
            "step": [0],
            "sample_id": ["s"],
            "pos": [1],
        }
    )
    worst = pl.DataFrame(
        {
            "pair": [pair],
            "step": [0],
            "sample_id": ["s<1>"],
            "pos": [3],
            "resp_pos": [1],
            "token_id": [7],
            "lp_a": [-1.0],
            "lp_b": [-0.75],
            "dlogp": [0.25],
            "context": ["Hello <world> & more"],
        }
    )
    return Report(
        "compare",
        summary_frame(rows),
        meta={"pairs": [pair], "join": "id"},
        checks=checks,
        worst_tokens=worst,
    )


def test_page_escapes_user_strings_and_embeds_everything() -> None:
    report = _hostile_report()
    plot_set = plots.build_figures(report, kinds=("by-position",))
    page = render_html(report, verdict="compare: DISAGREE <worst>", status="DISAGREE", plot_set=plot_set)
    assert "<b>a</b>" not in page and "&lt;b&gt;a&lt;/b&gt;:new vs b&amp;c:new" in page
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "Hello &lt;world&gt; &amp; more" in page  # the worst token's decoded context
    assert "compare: DISAGREE &lt;worst&gt;" in page and 'class="verdict bad"' in page
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [alt for alt, _ in images] == ["by-position"]
    assert not re.search(r"(src|href)=\"(https?:|//)", page)  # nothing fetched from the network
    # the verdict comes before every table and image
    assert page.index('id="verdict"') < page.index("<table") < page.index("<img")


def test_metric_table_marks_anomalies() -> None:
    rows = [
        ReportRow("r:old vs r:new", "token", b, s, "policy/ess_token", v, "1", "token", 10)
        for b, s, v in (("all", "all", 0.5), ("step", "0", 0.9), ("step", "1", 0.05))
    ]
    report = Report(
        "metrics", summary_frame(rows), meta={"pairs": ["r:old vs r:new"], "settings": {"eps": 0.2}}
    )
    page = render_html(
        report,
        verdict="metrics: 1 anomaly",
        status="anomalies",
        findings=["step 1: policy/ess_token 0.05 < 0.1"],
        marks=[plots.Mark("policy/ess_token", 1, "ESS 0.05 < 0.1")],
    )
    assert '<td class="anomaly" title="ESS 0.05 &lt; 0.1">0.05</td>' in page
    assert page.count('class="anomaly"') == 1
    assert "<li>step 1: policy/ess_token 0.05 &lt; 0.1</li>" in page
    assert '<td class="name">settings.eps</td>' in page


def test_write_is_atomic_and_refuses_to_clobber(tmp_path: Path) -> None:
    report = _hostile_report()
    path = write_html(report, tmp_path / "r.html", verdict="v")
    assert path.read_text().startswith("<!doctype html>")
    with pytest.raises(UsageError, match="exists") as info:
        write_html(report, path, verdict="v")
    assert info.value.code == "E502"
    write_html(report, path, verdict="again", overwrite=True)
    assert "again" in path.read_text()
    with pytest.raises(UsageError, match="is a directory"):
        write_html(report, tmp_path, verdict="v")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # no temp file left


def test_html_path_is_checked_before_any_work(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text("keep me")
    missing_run = tmp_path / "no-such-run"
    for command in ("compare", "metrics"):
        result = _invoke(command, missing_run, "--html", page, "--json")
        assert result.exit_code == 2, result.output
        assert json.loads(result.stdout)["error"]["code"] == "E502"  # not E501 for the run: nothing was read
    assert page.read_text() == "keep me"


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """The sample-data pages, written by the CLI: compare (with --out, then plot --html) and metrics."""
    root = tmp_path_factory.mktemp("html")
    compare = _invoke(
        "compare",
        SAMPLE / "run_a",
        SAMPLE / "run_b",
        "--out",
        root / "parity",
        "--tokenizer",
        SAMPLE / "tiny-qwen",
        "--html",
        root / "compare.html",
        "--json",
    )
    assert compare.exit_code == 0, compare.output
    assert json.loads(compare.stdout)["files"]["html"] == str(root / "compare.html")
    metrics = _invoke(
        "metrics", SAMPLE / "run_a", "--out", root / "m", "--html", root / "metrics.html", "--json"
    )
    assert metrics.exit_code == 0, metrics.output
    replot = _invoke("plot", root / "m", "--out", root / "m-plots", "--html", root / "replot.html", "--json")
    assert replot.exit_code == 0, replot.output
    assert json.loads(replot.stdout)["files"]["html"] == str(root / "replot.html")
    return {
        "compare": root / "compare.html",
        "metrics": root / "metrics.html",
        "replot": root / "replot.html",
    }


def test_sample_pages_hold_tables_plots_and_settings(pages) -> None:
    compare = pages["compare"].read_text()
    for kind in ("dlogp-vs-logprob", "dlogp-hist", "by-prob", "by-position", "by-step", "worst-trace"):
        assert f'<img alt="{kind}"' in compare
    assert "<code>hexbin</code>: near-equal runs" in compare  # said, not silently left out
    assert "worst tokens" in compare and "worst sequences" in compare and "by position" in compare
    assert "run_a:new vs run_b:new" in compare and "1,756 tokens" in compare
    # the worst tokens with their text, decoded by the sample checkpoint's tokenizer
    worst = pl.read_parquet(pages["compare"].parent / "parity" / "compare.worst_tokens.parquet").row(
        0, named=True
    )
    assert worst["token_text"] and worst["context"] and worst["token_text"] in worst["context"]
    assert html.escape(json.dumps(worst["token_text"], ensure_ascii=False)) in compare
    assert html.escape(worst["context"]) in compare
    metrics = pages["metrics"].read_text()
    for kind in ("trend-kl", "trend-clip", "trend-ess", "trend-ratio", "trend-mismatch", "trend-loss"):
        assert f'<img alt="{kind}"' in metrics
    assert "policy/ratio_max" in metrics and "settings.eps_low" in metrics.replace("clip.", "")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@needs_chromium
@pytest.mark.parametrize("name", ["compare", "metrics", "replot"])
def test_page_in_headless_chromium(pages, name, tmp_path) -> None:
    page = open_page(pages[name])
    assert page.errors == []
    probe = page.probe
    html_images = pages[name].read_text().count("<img ")
    assert len(probe["images"]) == html_images >= 5
    assert all(image["complete"] and image["width"] > 100 for image in probe["images"]), probe["images"]
    verdict = probe["verdict"]
    assert verdict["visible"] and verdict["text"].strip()
    assert verdict["top"] >= 0 and verdict["bottom"] <= probe["innerHeight"] == VIEWPORT[1]  # above the fold
    assert probe["scripts"] == 0 and probe["external"] == []
    assert _png_size(page.screenshot) == VIEWPORT
    (tmp_path / f"{name}.png").write_bytes(page.screenshot)


@needs_chromium
def test_chromium_probe_sees_broken_pages(tmp_path) -> None:
    """The browser check can fail: a missing image and a console error are reported."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<!doctype html><html><body><div id="verdict">v</div><img src="missing.png">'
        '<script>console.error("boom")</script></body></html>'
    )
    page = open_page(bad)
    assert any("boom" in e for e in page.errors) and any("missing.png" in e for e in page.errors)
    assert page.probe["images"][0]["width"] == 0


def test_plot_html_uses_the_verdict_a_report_carries(tmp_path) -> None:
    rows = [
        ReportRow("r:old vs r:new", "token", b, s, "policy/ratio_max", v, "ratio", "token", 50, lo, lo)
        for b, s, v, lo in (("all", "all", 40.0, None), ("step", "0", 2.0, 0), ("step", "1", 40.0, 1))
    ]
    finding = {
        "kind": "ratio_max",
        "metric": "policy/ratio_max",
        "step": "1",
        "value": 40.0,
        "threshold": 10.0,
        "message": "step 1: policy/ratio_max 40 > 10",
    }
    verdict = {
        "command": "metrics",
        "status": "anomalies",
        "line": "metrics: 1 anomaly: step 1 ratio max",
        "findings": [finding, {**finding, "step": None, "metric": None, "message": "pooled"}],
    }
    meta = {"pairs": ["r:old vs r:new"], "verdict": verdict}
    Report("metrics", summary_frame(rows), meta=meta).write(tmp_path / "rep")
    page = tmp_path / "page.html"
    result = _invoke("plot", tmp_path / "rep", "--out", tmp_path / "figs", "--html", page, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"]["plots"] == {
        "trend-ratio": str(tmp_path / "figs" / "trend-ratio.png")
    }
    text = page.read_text()
    assert '<span class="word">anomalies</span>metrics: 1 anomaly: step 1 ratio max' in text
    assert '<td class="anomaly" title="policy/ratio_max 40 &gt; 10">40</td>' in text
    assert plots.finding_marks(verdict["findings"]) == [
        plots.Mark("policy/ratio_max", 1, "policy/ratio_max 40 > 10")
    ]


def test_verdict_lists_only_the_findings_its_line_leaves_out() -> None:
    report = _hostile_report()
    shown = "step 1: policy/ess_token 0.05 < 0.1"
    page = render_html(
        report, verdict=f"metrics: 2 anomalies: {shown}; and 1 more", findings=[shown, "hidden"]
    )
    assert "<li>hidden</li>" in page and f"<li>{shown.replace('<', '&lt;')}</li>" not in page
