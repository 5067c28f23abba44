"""`pgdiag whatif` end to end on the shipped run: the table, `--json` equal to the library's report, `--out`
round trip, the plot, and bad thresholds or streams as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pgdiag.analysis.settings import CorrectionRule, WhatifSettings
from pgdiag.analysis.whatif import whatif
from pgdiag.data.runs import read_run
from pgdiag.report.report import load_report

RUN = str(Path(__file__).resolve().parents[2] / "sample_data" / "run_a")


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
    assert obj["command"] == "whatif" and obj["inputs"]["streams"] == ["rollout", "old"]
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
    assert set(obj["worst"]["token_tis:2"]) == {"step", "env", "position"}
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
        (("--icepop", "0.5"), "E503"),
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
