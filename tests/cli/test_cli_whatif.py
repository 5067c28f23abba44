"""`pgdiag whatif` end to end on the shipped run: the table, `--json` equal to the library's report, `--out`
round trip, the plot, and bad thresholds or streams as one line with exit 2."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.analysis.settings import CorrectionRule, WhatifSettings
from pgdiag.analysis.whatif import whatif
from pgdiag.data.runs import read_run
from pgdiag.report.report import load_report

RUN = str(SAMPLE_DATA / "run_a")


def invoke(*args: str):
    from pgdiag.cli.app import build_app

    return CliRunner().invoke(build_app(), list(args))


def test_json_out_and_plot_match_the_library(tmp_path: Path):
    out, plot = tmp_path / "rep", tmp_path / "whatif.png"
    result = invoke(
        "whatif", RUN, "--token-tis", "2", "--icepop", "0.5,5", "--seq-mis", "0.5,2", "--json",
        "--out", str(out), "--plot", str(plot),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    assert obj["command"] == "whatif" and obj["inputs"]["streams"] == [
        "rollout",
        "old",
        "new",
    ]  # new: for the proximal→θ rules
    assert list(obj["summary"]) == ["none", "token_tis:2", "seq_mis:0.5,2", "icepop:0.5,5"]
    rules = (
        CorrectionRule("token_tis", 2.0),
        CorrectionRule("seq_mis", 2.0, 0.5),
        CorrectionRule("icepop", 5.0, 0.5),
    )
    library = whatif(read_run(RUN), WhatifSettings(rules=rules))
    for rule in rules:
        for metric in ("whatif/tokens_affected", "whatif/ess_token_after", "whatif/loss_delta/token_mean"):
            expected = library.value(metric, breakdown="threshold", bucket=rule.label)
            assert obj["summary"][rule.label][metric] == pytest.approx(expected)
    assert 0 < obj["summary"]["icepop:0.5,5"]["whatif/tokens_affected"] < 0.05
    assert set(obj["worst"]["token_tis:2"]) == {
        "step",
        "env",
        "position",
        "lag",
    }  # lag: run_a has policy_version
    loaded = load_report(out / "whatif.parquet")
    assert loaded.kind == "whatif"
    assert loaded.summary.equals(library.summary)
    assert plot.stat().st_size > 1000


def test_default_grid_runs():
    result = invoke("whatif", RUN, "--json", "-q")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    assert "token_tis:1.5" in obj["summary"] and "seq_tis:10" in obj["summary"]
    # a larger cap truncates no more tokens than a smaller one
    hit = [obj["summary"][f"token_tis:{c}"]["whatif/tokens_affected"] for c in ("1.5", "2", "3", "5")]
    assert hit == sorted(hit, reverse=True)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("--icepop", "0.5"), "E112"),
        (("--token-mis", "2,0.5"), "E503"),
        (("--behavior", "nope"), "E111"),
        (("--target", "rollout"), "E503"),
    ],
)
def test_bad_options_exit_2(args: tuple[str, ...], code: str):
    result = invoke("whatif", RUN, *args)
    assert result.exit_code == 2
    assert f"error[{code}]" in result.output


@pytest.mark.parametrize("command", ["whatif", "drift"])
def test_existing_plot_is_refused_before_any_work(tmp_path: Path, command: str):
    plot = tmp_path / "kept.png"
    plot.write_bytes(b"not mine")
    out = tmp_path / "report"
    result = invoke(command, RUN, "--plot", str(plot), "--out", str(out), "-q")
    assert result.exit_code == 2 and "E502" in result.stderr
    assert not out.exists() and plot.read_bytes() == b"not mine"  # nothing written, the figure untouched


@pytest.mark.parametrize("command", ["whatif", "drift"])
def test_html_page_is_written_listed_and_carries_the_verdict(tmp_path: Path, command: str):
    from pgdiag.analysis.drift import drift
    from pgdiag.report.verdict import drift_verdict, whatif_verdict

    page = tmp_path / "page.html"
    result = invoke(command, RUN, "--html", str(page), "--json")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    assert obj["files"] == {"html": str(page)}
    assert re.search(rf"html\s+{re.escape(str(page))}", result.stderr)  # the files written: stderr
    library = whatif(read_run(RUN)) if command == "whatif" else drift(read_run(RUN))
    expected = (whatif_verdict if command == "whatif" else drift_verdict)(library)
    assert obj["verdict"] == expected.as_dict()
    assert " ".join(result.stderr.split()).endswith(expected.line)  # the verdict, last on stderr (wrapped)
    text = page.read_text()
    assert text.startswith("<!doctype html>") and f"pgdiag {command}: " in text
    assert html.escape(expected.line) in text and '<img alt="' in text
    again = invoke(command, RUN, "--html", str(page), "--overwrite", "-q")
    assert again.exit_code == 0, again.output


@pytest.mark.parametrize("command", ["whatif", "drift", "report"])
@pytest.mark.parametrize("existing", ["file", "directory"])
def test_bad_html_path_is_refused_before_any_work(tmp_path: Path, command: str, existing: str):
    page = tmp_path / "page.html"
    if existing == "file":
        page.write_text("keep me")
    else:
        page.mkdir()
    out, plot = tmp_path / "report", tmp_path / "figure.png"
    args = {
        "whatif": ("whatif", RUN, "--out", str(out), "--plot", str(plot)),
        "drift": ("drift", RUN, "--out", str(out), "--plot", str(plot)),
        "report": ("report", str(tmp_path / "no-such-report"), "--markdown", str(tmp_path / "comment.md")),
    }[command]
    result = invoke(*args, "--html", str(page), "--json")
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout.strip().splitlines()[-1])["error"]
    assert error["code"] == "E502"  # not E501 for the missing report: nothing was read
    assert error["message"] == f"{page} {'exists' if existing == 'file' else 'is a directory'}"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["page.html"]  # no report, figure, markdown or temp file
    assert page.read_text() == "keep me" if existing == "file" else list(page.iterdir()) == []
