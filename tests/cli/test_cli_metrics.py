"""`pgdiag metrics` and `pgdiag check` end to end: the worked example of docs/metrics.md through the CLI,
gates and exit codes, report files, and every bad input as one line with the documented exit code."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.report.report import load_report
from tests.rollout_factory import write_rollouts_file

# docs/metrics.md: two groups x two samples; one prompt token each, then the response; s3's third response
# token is masked (its log-probs are null, as the schema requires off the loss mask).
WORKED = [
    ("s1", "g1", 1.0, [1, 1, 1], [-1.0, -2.0, -0.5], [-1.0, -1.7, -0.8]),
    ("s2", "g1", -1.0, [1, 1, 1, 1], [-0.3, -1.5, -3.0, -0.9], [-0.05, -1.8, -2.95, -0.9]),
    ("s3", "g2", 0.5, [1, 1, 0, 1], [-0.7, -1.2, -2.5, -0.4], [-0.5, -1.25, -9.0, -0.3]),
    ("s4", "g2", -0.5, [1, 1, 1], [-1.1, -0.3, -2.0], [-1.35, -0.3, -1.85]),
]


def worked_rows(step: int = 0) -> list[dict]:
    rows = []
    for k, (sid, group, adv, mask, old, new) in enumerate(WORKED):
        n = len(mask)

        def on_mask(values: list[float], mask: list[int] = mask) -> list[float | None]:
            return [None] + [v if m else None for v, m in zip(values, mask, strict=True)]

        rows.append(
            {
                "step": step,
                "sample_id": sid,
                "group_id": group,
                "input_ids": [7] + [10 + k + i for i in range(n)],
                "prompt_len": 1,
                "loss_mask": [False] + [bool(m) for m in mask],
                "old_logprobs": on_mask(old),
                "new_logprobs": on_mask(new),
                "advantages": on_mask([adv] * n),
                "reward": adv,
            }
        )
    return rows


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def worked(tmp_path: Path) -> Path:
    path = tmp_path / "worked.parquet"
    write_rollouts_file(path, worked_rows())
    return path


def invoke(runner: CliRunner, *args: str):
    return runner.invoke(build_app(), [str(a) for a in args], catch_exceptions=False)


def test_worked_example_through_the_cli(runner: CliRunner, worked: Path) -> None:
    result = invoke(runner, "metrics", worked, "--aggregation", "constant", "--divisor", "4", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == "pgdiag.result/v1" and data["status"] == "ok"
    values = data["summary"]["t:old vs t:new"]
    expected = {
        "loss/token_mean": 0.080553,
        "loss/sample_mean": 0.001114,
        "loss/prompt_mean": 0.073046,
        "loss/constant": 0.065450,
        "loss/pg": 0.065450,
        "loss/seq_mean_token_sum": 0.261799,
        "loss/gspo_seq_mean": -0.014961,
        "loss/gspo_length_prop": 0.205117,
        "policy/ratio_mean": 1.029633,
        "policy/clip_frac_band": 0.461538,
        "policy/clip_frac_binding": 0.307692,
        "policy/kl_k1": -0.011538,
        "policy/kl_k3": 0.018095,
        "policy/ess_token": 0.967279,
        "policy/logratio_absmax": 0.3,
        "grad/token_mean_scale": 0.552710,
        "advantage/group_token_sum_absmax": 1.0,
        "count/tokens": 13,
        "count/samples": 4,
    }
    for key, value in expected.items():
        assert values[key] == pytest.approx(value, abs=1e-6), key
    assert data["inputs"]["n_tokens"] == 13 and data["settings"]["divisor"] == 4.0
    assert data["per_step"]["0"]["loss/token_mean"] == pytest.approx(0.080553, abs=1e-6)


def test_sample_metric_reduction(runner: CliRunner, worked: Path) -> None:
    result = invoke(runner, "metrics", worked, "--metric-reduction", "sample", "--json", "-q")
    values = json.loads(result.stdout)["summary"]["t:old vs t:new"]
    assert values["policy/ratio_mean"] == pytest.approx(1.030517, abs=1e-6)
    assert values["policy/clip_frac_binding"] == pytest.approx(0.3125, abs=1e-6)


def test_key_style_verl(runner: CliRunner, worked: Path) -> None:
    result = invoke(runner, "metrics", worked, "--key-style", "verl", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    values = json.loads(result.stdout)["summary"]["t:old vs t:new"]
    assert values["actor/pg_clipfrac"] == pytest.approx(0.307692, abs=1e-6)
    assert values["actor/ppo_kl"] == pytest.approx(-0.011538, abs=1e-6)
    assert values["actor/pg_loss"] == pytest.approx(0.080553, abs=1e-6)


def test_gates_and_exit_zero(runner: CliRunner, worked: Path) -> None:
    result = invoke(runner, "metrics", worked, "--fail-on", "policy/clip_frac_binding>0.3", "--json", "-q")
    assert result.exit_code == 1
    gates = json.loads(result.stdout)["gates"]
    failed = [g for g in gates if g["status"] == "fail"]
    assert [g["expr"] for g in failed] == ["policy/clip_frac_binding>0.3"]
    assert failed[0]["value"] == pytest.approx(4 / 13)
    result = invoke(
        runner, "metrics", worked, "--fail-on", "policy/clip_frac_binding>0.3", "--exit-zero", "-q"
    )
    assert result.exit_code == 0
    result = invoke(runner, "metrics", worked, "--fail-on", "policy/clip_frac_binding>0.5", "-q")
    assert result.exit_code == 0


def test_identity_check(runner: CliRunner, tmp_path: Path) -> None:
    rows = worked_rows()
    for row in rows:
        row["new_logprobs"] = row["old_logprobs"]
    path = tmp_path / "onpolicy.parquet"
    write_rollouts_file(path, rows)
    result = invoke(runner, "metrics", path, "--identity", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    values = json.loads(result.stdout)["summary"]["t:old vs t:new"]
    assert values["policy/logratio_absmax"] == 0.0 and values["policy/kl_k3"] == 0.0
    # loss = -sum(w A) on on-policy data: token_mean = -(3 - 4 + 1 - 1.5) / 13
    assert values["loss/token_mean"] == pytest.approx(-(3 * 1 - 4 * 1 + 3 * 0.5 - 3 * 0.5) / 13)
    # the worked example is not on-policy: the identity gate fails it
    result = invoke(runner, "metrics", tmp_path / "onpolicy.parquet", "--identity", "-q")
    assert result.exit_code == 0
    write_rollouts_file(tmp_path / "w.parquet", worked_rows())
    result = invoke(runner, "metrics", tmp_path / "w.parquet", "--identity", "--identity-tol", "0.1", "-q")
    assert result.exit_code == 1


def test_out_writes_report_that_loads(runner: CliRunner, worked: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports"
    result = invoke(runner, "metrics", worked, "--out", out, "-q")
    assert result.exit_code == 0, result.stderr
    report = load_report(out / "metrics.parquet")
    assert report.value("loss/token_mean") == pytest.approx(0.080553, abs=1e-6)
    steps = report.summary.filter(pl.col("breakdown") == "step")["bucket"].unique().to_list()
    assert steps == ["0"]
    stored = json.loads((out / "metrics.json").read_text())
    files = {"report": str(out / "metrics.parquet"), "json": str(out / "metrics.json")}
    assert stored["command"] == "metrics" and stored["files"] == files
    # existing output: E502, exit 2, nothing overwritten
    before = (out / "metrics.parquet").read_bytes()
    result = invoke(runner, "metrics", worked, "--out", out, "-q")
    assert result.exit_code == 2 and "E502" in result.stderr
    assert (out / "metrics.parquet").read_bytes() == before


def _one_line_error(result, code: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith(f"error[{code}]"), result.stderr
    assert "Traceback" not in result.stderr and len(lines) <= 2


def test_bad_inputs_one_line_and_exit_codes(runner: CliRunner, worked: Path, tmp_path: Path) -> None:
    result = invoke(runner, "metrics", tmp_path / "nope.parquet")
    assert result.exit_code == 2
    _one_line_error(result, "E501")
    result = invoke(runner, "metrics", worked, "--aggregation", "constant")
    assert result.exit_code == 2 and "divisor" in result.stderr
    result = invoke(runner, "metrics", worked, "--fail-on", "policy/clip_frac_bindng>0.2")
    assert result.exit_code == 2 and "clip_frac_binding" in result.stderr
    result = invoke(runner, "metrics", worked, "--new", "rc_missing")
    assert result.exit_code == 2
    _one_line_error(result, "E111")
    # invalid data: a positive log-prob on a loss position is E205, exit 3, with JSON still printed
    rows = worked_rows()
    rows[1]["new_logprobs"][2] = 0.5
    bad = tmp_path / "bad.parquet"
    write_rollouts_file(bad, rows)
    out = tmp_path / "never"
    result = invoke(runner, "metrics", bad, "--json", "--out", out)
    assert result.exit_code == 3
    _one_line_error(result, "E205")
    assert json.loads(result.stdout)["error"]["code"] == "E205"
    assert not out.exists()


def test_check_command(runner: CliRunner, worked: Path, tmp_path: Path) -> None:
    result = invoke(runner, "check", worked, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "ok"
    rows = worked_rows()
    rows[0]["old_logprobs"] = rows[0]["old_logprobs"][:-1]  # length mismatch: E201
    bad = tmp_path / "bad.parquet"
    write_rollouts_file(bad, rows)
    result = invoke(runner, "check", bad, "--json")
    assert result.exit_code == 3
    codes = {c["code"] for c in json.loads(result.stdout)["checks"]}
    assert "E201" in codes
    assert "Traceback" not in result.stderr


def test_list_metrics_prints_the_catalogue_and_help_does_not(runner: CliRunner) -> None:
    from pgdiag.metrics.catalog import METRIC_CATALOG

    env = {"COLUMNS": "80", "NO_COLOR": "1"}
    result = runner.invoke(build_app(), ["metrics", "--list-metrics"], env=env)  # no RUN needed
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    missing = [
        spec.key for spec in METRIC_CATALOG if not any(line.split()[:1] == [spec.key] for line in lines)
    ]
    assert not missing, missing[:5]  # every key whole, at the start of its row, at 80 columns
    help_text = runner.invoke(build_app(), ["metrics", "--help"], env=env).stdout
    assert "--list-metrics" in help_text
    assert "policy/ratio_std" not in help_text and len(help_text.splitlines()) < 200


def test_miles_mismatch_metrics_reaches_the_style(runner: CliRunner) -> None:
    run_a = SAMPLE_DATA / "run_a"
    outputs = {}
    for flags in ((), ("--mismatch-metrics",), ("--tis",)):
        result = invoke(runner, "metrics", run_a, "--key-style", "miles", *flags, "--json", "-q")
        assert result.exit_code == 0, result.stderr
        outputs[flags] = json.loads(result.stdout)["summary"]
    plain, mismatch, tis = outputs[()], outputs[("--mismatch-metrics",)], outputs[("--tis",)]
    pair = next(iter(mismatch))
    assert "train/ois" not in plain[pair] and mismatch[pair]["train/ois"] > 0
    assert mismatch == tis  # one branch of miles' loss
    assert mismatch[pair]["train/pg_loss"] != plain[pair]["train/pg_loss"]  # TIS-weighted
