"""`pgdiag report` round-trips every report kind (metrics, compare, whatif, drift): the stored values come back
unchanged in `--json`, `--pivot` and `--markdown`, and gates are re-evaluated on them."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.report.report import load_report
from tests.analysis.test_drift import synthetic_run

SAMPLE = SAMPLE_DATA


def invoke(*args: str):
    from pgdiag.cli.app import build_app

    return CliRunner().invoke(build_app(), list(args))


def saved(kind: str, tmp_path: Path) -> Path:
    out = tmp_path / kind
    run_a, run_b = str(SAMPLE / "run_a"), str(SAMPLE / "run_b")
    args = {
        "metrics": ("metrics", run_a),
        "compare": ("compare", run_a, run_b),
        "whatif": ("whatif", run_a, "--token-tis", "2"),
        "drift": ("drift", str(synthetic_run(tmp_path, jump=True))),
    }[kind]
    result = invoke(*args, "--out", str(out), "-q")
    assert result.exit_code in (0, 1), result.output
    return out / f"{kind}.parquet"


@pytest.mark.parametrize("kind", ["metrics", "compare", "whatif", "drift"])
def test_round_trip(kind: str, tmp_path: Path):
    path = saved(kind, tmp_path)
    stored = load_report(path)
    result = invoke("report", str(path), "--json", "-q")
    assert result.exit_code in (0, 1), result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    assert obj["kind"] == kind
    assert obj["summary"] == json.loads(json.dumps(stored.to_json_dict()["summary"]))
    # --pivot: the wide table as CSV, one row per (pair, scope, breakdown, bucket)
    pivot = invoke("report", str(path), "--pivot", "-q")
    table = list(csv.DictReader(io.StringIO(pivot.stdout)))
    assert len(table) == stored.wide().height
    md = tmp_path / f"{kind}.md"
    assert invoke("report", str(path), "--markdown", str(md), "-q").exit_code in (0, 1)
    text = md.read_text()
    assert text.startswith(f"### pgdiag {kind}:")
    if kind == "whatif":
        assert "token_tis:2" in text and "whatif/tokens_affected" in text
    if kind == "drift":
        assert "| mismatch/abs_mean" not in text and "`mismatch/abs_mean`" in text


def test_gates_are_re_evaluated_on_stored_values(tmp_path: Path):
    path = saved("metrics", tmp_path)
    stored = load_report(path)
    kl = stored.value("policy/kl_k3", breakdown="all", bucket="all")
    assert kl is not None
    fail = invoke("report", str(path), "--fail-on", f"policy/kl_k3>{kl / 2!r}", "--json", "-q")
    assert fail.exit_code == 1
    gate = json.loads(fail.stdout.strip().splitlines()[-1])["gates"][0]
    assert gate["value"] == pytest.approx(kl) and gate["status"] == "fail"
    ok = invoke("report", str(path), "--fail-on", f"policy/kl_k3>{kl * 2!r}", "-q")
    assert ok.exit_code == 0


@pytest.mark.parametrize("kind", ["metrics", "compare", "whatif", "drift"])
def test_html_re_renders_every_kind(kind: str, tmp_path: Path):
    import html

    from pgdiag.report.verdict import report_verdict

    path = saved(kind, tmp_path)
    stored = load_report(path)
    page = tmp_path / f"{kind}.html"
    result = invoke("report", str(path.parent), "--html", str(page), "--json", "-q")
    assert result.exit_code in (0, 1), result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["files"] == {"html": str(page)}
    text = page.read_text()
    verdict = report_verdict(stored)
    assert f"{kind} report" in text and html.escape(verdict.line) in text
    # the saved report carries the verdict its command printed: the same one, derived again here
    assert stored.meta["verdict"]["line"] == verdict.line
    figures = {"metrics": "trend-kl", "compare": "worst-trace", "whatif": "whatif", "drift": "drift"}[kind]
    assert f'<img alt="{figures}"' in text  # compare: the worst trace beside the report is drawn
