"""`pgdiag explain` end to end: the cost line before the matrix, the cause table, `--json`, `--out` (and
`pgdiag report` on it), the HTML page in headless Chromium, the refusals; and the logprobs_mode cause."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from explain_factory import make_checkpoint, sample_rows, score, write_plant
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.explain.api import explain_run
from pgdiag.explain.settings import ExplainSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
from chromium_page import VIEWPORT, chromium_binary, open_page

needs_chromium = pytest.mark.skipif(chromium_binary() is None, reason="no chromium binary on PATH")


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cli")
    checkpoint = make_checkpoint(root / "ckpt")
    rows = sample_rows(checkpoint, temperature=0.7, steps=2, per_step=4)
    run = write_plant(root / "run", rows, score(checkpoint, rows, temperature=0.7), score(checkpoint, rows))
    return checkpoint, run


def _invoke(*args: object):
    return CliRunner().invoke(build_app(), [str(a) for a in args])


def test_json_out_and_report(planted, tmp_path: Path) -> None:
    checkpoint, run = planted
    out = tmp_path / "ex"
    result = _invoke("explain", run, "--model", checkpoint, "--tokens", 500, "--json", "--out", out)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "explain" and payload["top_cause"] == "temperature"
    causes = payload["causes"]
    assert causes[0]["cause"] == "temperature" and len(causes) == 10
    assert set(causes[0]) == {
        "cause", "share", "k3_before", "k3_after", "abs_mean_before", "abs_mean_after", "evidence",
    }  # fmt: skip
    assert [c["share"] for c in causes] == sorted((c["share"] for c in causes), reverse=True)
    assert sum(c["share"] for c in causes) == pytest.approx(1.0)
    assert payload["verdict"]["line"].startswith(
        "explain rollout vs old: EXPLAINED 100 % of the mismatch is temperature"
    )
    assert "recompute matrix:" in result.stderr and "tokens x 6 configurations" in result.stderr
    assert result.stderr.index("recompute matrix:") < result.stderr.index("recompute ex_ref")  # cost first
    assert (out / "explain.parquet").exists() and (out / "tokens" / "logprobs" / "ex_bf16").is_dir()
    # every configuration is a recompute tag: compare any two afterwards
    compared = _invoke("compare", out / "tokens", "--stream-a", "ex_ref", "--stream-b", "ex_bf16", "--json")
    assert compared.exit_code in (0, 1), compared.output
    assert json.loads(compared.stdout)["inputs"]["streams"] == ["ex_ref", "ex_bf16"]
    again = _invoke("report", out / "explain.parquet", "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["summary"]["rollout vs old"]["explain/temperature"] == pytest.approx(1.0)


def test_refusals(planted, tmp_path: Path) -> None:
    checkpoint, run = planted
    missing = _invoke("explain", run, "--model", checkpoint, "--pair", "rollout,ref", "--out", tmp_path / "a")
    assert missing.exit_code == 2 and "error[E111]" in missing.output
    bad = _invoke("explain", run, "--model", checkpoint, "--pair", "rollout", "--out", tmp_path / "b")
    assert bad.exit_code == 2 and "error[E503]" in bad.output
    tag = _invoke("explain", run, "--model", checkpoint, "--pair", "rollout,rc_x", "--out", tmp_path / "c")
    assert tag.exit_code == 2 and "error[E503]" in tag.output
    assert (
        not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    )  # refused before anything is written


@needs_chromium
def test_page_in_headless_chromium(planted, tmp_path: Path) -> None:
    checkpoint, run = planted
    page = tmp_path / "explain.html"
    result = _invoke(
        "explain", run, "--model", checkpoint, "--tokens", 500, "--out", tmp_path / "ex", "--html", page, "-q"
    )
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "Causes" in text and "Signatures" in text and "missing_temperature" in text
    shown = open_page(page)
    assert shown.errors == []
    probe = shown.probe
    assert len(probe["images"]) >= 1 and all(i["complete"] and i["width"] > 100 for i in probe["images"])
    verdict = probe["verdict"]
    assert verdict["visible"] and "temperature" in verdict["text"]
    assert verdict["bottom"] <= probe["innerHeight"] == VIEWPORT[1]
    assert probe["scripts"] == 0 and probe["external"] == []


def test_processed_logprobs_are_the_logprobs_mode_cause(tmp_path: Path) -> None:
    """vLLM processed_logprobs (tempered and top-p renormalised) against a raw trainer: the footer's mode names
    the cause, so the fix is the logprobs mode, not a temperature."""
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    rows = sample_rows(checkpoint, temperature=0.8, top_p=0.9)
    rollout = score(checkpoint, rows, temperature=0.8, top_p=0.9)
    run = write_plant(
        tmp_path / "run",
        rows,
        rollout,
        score(checkpoint, rows),
        sampling={"engine": "vllm", "logprobs_mode": "processed_logprobs", "temperature": 0.8, "top_p": 0.9},
    )
    result = explain_run(run, checkpoint, ExplainSettings(tokens=10_000))
    assert result.top_cause == "logprobs_mode" and result.causes[0].share >= 0.9
    assert result.fits["a"] == {**result.fits["a"], "temperature": 0.8, "kept_set": "top_p=0.9"}
    assert next(c for c in result.causes if c.cause == "temperature").share == 0.0
    assert "raw log-probs" in result.verdict
