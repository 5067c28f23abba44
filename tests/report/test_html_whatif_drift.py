"""The one-file HTML pages of `whatif` and `drift`: written by `--html` on each command, by `report --html` and
by `plot --html` from the saved reports; every number in their tables read back from the page equals the
report's value; and each page in a real headless Chromium (no console error, every image decoded, the verdict
visible above the fold)."""

from __future__ import annotations

import json
import sys
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.report.report import Report, load_report
from tests.analysis.test_drift import JUMP_AT, synthetic_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chromium_page import VIEWPORT, chromium_binary, open_page

SAMPLE = SAMPLE_DATA
needs_chromium = pytest.mark.skipif(chromium_binary() is None, reason="no chromium binary on PATH")


def _invoke(*args: object):
    return CliRunner().invoke(build_app(), [str(a) for a in args])


class _Tables(HTMLParser):
    """Every <table> of a page with the <h3> heading before it: rows of (text, class) cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[tuple[str, str]]]]] = []
        self.heading = ""
        self._in_heading = False
        self._cell: list[str] | None = None
        self._cell_class = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h3":
            self._in_heading, self.heading = True, ""
        elif tag == "table":
            self.tables.append((self.heading.strip(), []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell, self._cell_class = [], dict(attrs).get("class") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "h3":
            self._in_heading = False
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append(("".join(self._cell), self._cell_class))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_heading:
            self.heading += data


def _tables(page: Path) -> dict[str, list[dict[str, tuple[str, str]]]]:
    """{heading: [{column: (text, class)}]} of every table whose heading is unique (the first wins)."""
    parser = _Tables()
    parser.feed(page.read_text())
    out: dict[str, list[dict[str, tuple[str, str]]]] = {}
    for heading, rows in parser.tables:
        if rows and heading not in out:
            header = [text for text, _ in rows[0]]
            out[heading] = [dict(zip(header, row, strict=True)) for row in rows[1:]]
    return out


def _table(tables: dict, starts: str) -> list[dict[str, tuple[str, str]]]:
    (heading,) = [h for h in tables if h.startswith(starts)]
    return tables[heading]


def _number(text: str) -> float | None:
    return None if text == "—" else float(text.replace(",", ""))


def _close(text: str, value: float | None) -> bool:
    """A cell equals a report value to the digits it is written with (6 significant, 5 in scientific form)."""
    number = _number(text)
    if number is None or value is None:
        return number is None and value is None
    return number == pytest.approx(value, rel=1e-4, abs=1e-12)


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """whatif (the sample run, default grid) and drift (a planted jump) pages from each command, and the same
    reports re-rendered from their saved files by `report --html` and `plot --html`."""
    root = tmp_path_factory.mktemp("analysis-html")
    whatif = _invoke(
        "whatif", SAMPLE / "run_a", "--out", root / "w", "--html", root / "whatif.html", "--json", "-q"
    )
    assert whatif.exit_code == 0, whatif.output
    run = synthetic_run(root, jump=True)
    drift = _invoke("drift", run, "--out", root / "d", "--html", root / "drift.html", "--json", "-q")
    assert drift.exit_code == 0, drift.output
    for kind, result in (("whatif", whatif), ("drift", drift)):
        obj = json.loads(result.stdout)
        assert obj["files"]["html"] == str(root / f"{kind}.html")
        saved = json.loads((root / kind[0] / f"{kind}.json").read_text())
        assert saved["files"]["html"] == str(
            root / f"{kind}.html"
        )  # the report, written last, lists the page
        (root / f"{kind}.verdict.json").write_text(json.dumps(obj["verdict"]))
    rerendered = _invoke("report", root / "w", "--html", root / "whatif-report.html", "--json", "-q")
    assert rerendered.exit_code == 0, rerendered.output
    assert json.loads(rerendered.stdout)["files"]["html"] == str(root / "whatif-report.html")
    replot = _invoke("plot", root / "d", "--out", root / "figs", "--html", root / "drift-plot.html", "--json")
    assert replot.exit_code == 0, replot.output
    assert set(json.loads(replot.stdout)["files"]["plots"]) >= {"drift", "trend-mismatch"}
    return {
        "whatif": root / "whatif.html",
        "drift": root / "drift.html",
        "whatif-report": root / "whatif-report.html",
        "drift-plot": root / "drift-plot.html",
    }


def _report(pages: dict[str, Path], name: str) -> Report:
    kind = name.split("-")[0]
    return load_report(pages[name].parent / kind[0])


@pytest.mark.parametrize("name", ["whatif", "whatif-report"])
def test_whatif_tables_equal_the_report(pages, name) -> None:
    report = _report(pages, name)
    tables = _tables(pages[name])
    rules = report.meta["settings"]["rules"]
    kept = _table(tables, "data kept and ESS")
    labels = [
        r["rule"][0] if r["threshold"][0] == "defaults" else f"{r['rule'][0]}:{r['threshold'][0]}"
        for r in kept
    ]
    assert labels == ["none:no correction", *rules]
    columns = {
        "tokens hit": "whatif/tokens_affected",
        "sequences hit": "whatif/seqs_affected",
        "tokens kept": "whatif/tokens_kept",
        "token ESS after": "whatif/ess_token_after",
        "sequence ESS after": "whatif/ess_seq_after",
    }
    for row, rule in zip(kept[1:], rules, strict=True):
        for column, metric in columns.items():
            value = report.value(metric, breakdown="threshold", bucket=rule)
            assert _close(row[column][0], value), (rule, column, row[column], value)
    none = kept[0]  # the uncorrected batch: ESS before any rule
    assert _close(
        none["token ESS after"][0], report.value("whatif/ess_token", breakdown="threshold", bucket="none")
    )
    assert _close(
        none["sequence ESS after"][0], report.value("whatif/ess_seq", breakdown="threshold", bucket="none")
    )
    loss = _table(tables, "pg loss under each aggregation mode")
    modes = [c for c in loss[0] if c not in ("rule", "threshold")]
    assert {"token_mean", "sample_mean", "seq_mean_token_sum"} <= set(modes)
    for row, rule in zip(loss, ["none", *rules], strict=True):
        for mode in modes:
            metric = f"whatif/loss/{mode}" if rule == "none" else f"whatif/loss_delta/{mode}"
            assert _close(row[mode][0], report.value(metric, breakdown="threshold", bucket=rule)), (
                rule,
                mode,
            )
    steps = _table(tables, "where: fraction of tokens hit per step")
    for row, rule in zip(steps, rules, strict=True):
        places = {
            c.split(" (n=")[0]: cell
            for c, cell in row.items()
            if c not in ("rule", "threshold", "worst step")
        }
        local = report.summary.filter(
            (pl.col("breakdown") == "threshold/step") & pl.col("bucket").str.starts_with(f"{rule}|")
        )
        values = {b.split("|")[1]: v for b, v in local.select("bucket", "value").iter_rows()}
        assert list(places) == list(values) == ["0", "1", "2", "3"]  # the sample run's steps
        top = max(values.values())
        first_top = next(w for w, v in values.items() if v == top)
        for where, (text, css) in places.items():
            assert _close(text, values[where]), (rule, where)
            assert (css == "worst") == (top > 0 and values[where] == top), (rule, where)  # the largest, lit
        assert row["worst step"][0] == ("—" if top == 0 else f"{first_top} ({places[first_top][0]})")
    assert _table(tables, "where: fraction of tokens hit per env") and _table(
        tables, "where: fraction of tokens hit per position"
    )


@pytest.mark.parametrize("name", ["drift", "drift-plot"])
def test_drift_tables_equal_the_report(pages, name) -> None:
    report = _report(pages, name)
    tables = _tables(pages[name])
    found = report.meta["change_points"]["found"]
    assert found and {cp["step"] for cp in found} == {JUMP_AT}
    points = _table(tables, "change points")
    assert [(int(r["step"][0]), r["metric"][0]) for r in points] == [
        (cp["step"], cp["metric"]) for cp in found
    ]
    for row, cp in zip(points, found, strict=True):
        for column in ("before", "after", "jump"):
            assert _close(row[column][0], cp[column]), (cp, column)
        assert _number(row["z"][0]) == pytest.approx(cp["score"], rel=1e-5)
    series = _table(tables, "per-step series searched for change points")
    searched = report.meta["change_points"]["series"]
    assert "mismatch/abs_mean" in searched
    assert [c.split(" (")[0] for c in series[0]] == ["step", *searched]
    assert [int(r["step"][0]) for r in series] == report.meta["inputs"]["steps"]
    marked = {(cp["metric"], cp["step"]) for cp in found}
    for row in series:
        step = int(row["step"][0])
        for column, (text, css) in row.items():
            if column == "step":
                continue
            metric = column.split(" (")[0]
            assert _close(text, report.value(metric, breakdown="step", bucket=str(step))), (step, metric)
            assert (css == "anomaly") == ((metric, step) in marked), (step, metric)


def test_pages_carry_the_commands_verdict(pages) -> None:
    for kind in ("whatif", "drift"):
        verdict = json.loads((pages[kind].parent / f"{kind}.verdict.json").read_text())
        assert (
            verdict["command"] == kind
            and verdict["status"] == {"whatif": "warnings", "drift": "anomalies"}[kind]
        )
        page = pages[kind].read_text()
        assert f'<span class="word">{verdict["status"]}</span>{_escaped(verdict["line"])}' in page
        # re-rendered from the saved report: the same verdict, derived again from the stored values
        other = pages["whatif-report" if kind == "whatif" else "drift-plot"].read_text()
        assert _escaped(verdict["line"]) in other
    assert "seq_mis:0.5,2 drops" in pages["whatif"].read_text()


def _escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


@needs_chromium
@pytest.mark.parametrize("name", ["whatif", "drift", "whatif-report", "drift-plot"])
def test_page_in_headless_chromium(pages, name) -> None:
    page = open_page(pages[name])
    assert page.errors == []
    probe = page.probe
    alts = [image["alt"] for image in probe["images"]]
    expected = {
        "whatif": ["whatif"],
        "drift": [
            "drift",
            "trend-kl",
            "trend-clip",
            "trend-ess",
            "trend-ratio",
            "trend-mismatch",
            "trend-loss",
        ],
    }
    assert alts == expected[name.split("-")[0]]
    assert all(image["complete"] and image["width"] > 100 for image in probe["images"]), probe["images"]
    verdict = probe["verdict"]
    assert verdict["visible"] and verdict["text"].startswith(("warnings", "anomalies"))
    assert verdict["top"] >= 0 and verdict["bottom"] <= probe["innerHeight"] == VIEWPORT[1]  # above the fold
    assert probe["scripts"] == 0 and probe["external"] == []
