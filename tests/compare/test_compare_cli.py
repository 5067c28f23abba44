"""`pgdiag compare` and `pgdiag plot` end to end on rollout files: exit codes, messages, JSON, report files."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from batch_factory import random_samples, write_run
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

import pgdiag.report.gates
from pgdiag.cli.app import build_app
from pgdiag.metrics.settings import MetricSettings
from pgdiag.report.report import load_report

PLOTS = ("dlogp-vs-logprob", "hexbin", "dlogp-hist", "by-prob", "by-position", "by-step", "worst-trace")


def _invoke(*args: str):
    return CliRunner().invoke(build_app(), [str(a) for a in args])


def _perturbed(samples):
    out = copy.deepcopy(samples)
    for s in out:
        s["streams"]["old"] = s["streams"]["old"] - 0.01
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    samples = random_samples(11, 40)
    tempered = random_samples(11, 40, temperature_a=0.7)
    shifted = copy.deepcopy(samples)
    for s in shifted:
        lp = s["streams"]["rollout"]
        s["streams"]["rollout"] = np.concatenate([lp[1:], lp[-1:]])
    return {
        "a": write_run(root / "a.parquet", samples, run="engine", streams={"rollout_logprobs": "rollout"}),
        "same": write_run(
            root / "b.parquet", samples, run="trainer", streams={"rollout_logprobs": "rollout"}
        ),
        "shifted": write_run(
            root / "s.parquet", shifted, run="trainer", streams={"rollout_logprobs": "rollout"}
        ),
        "two_b": write_run(
            root / "t2.parquet",
            _perturbed(tempered),
            run="other",
            streams={"rollout_logprobs": "rollout", "old_logprobs": "old"},
        ),
        "two": write_run(
            root / "t.parquet",
            tempered,
            run="one",
            streams={"rollout_logprobs": "rollout", "old_logprobs": "old"},
        ),
    }


def test_identical_runs_pass_every_profile_with_zero_deltas(runs, tmp_path) -> None:
    out = tmp_path / "report"
    result = _invoke("compare", runs["a"], runs["same"], "--json", "--out", out, "--profile", "recommended")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)
    assert obj["schema"] == "pgdiag.result/v1" and obj["status"] == "ok"
    summary = obj["summary"]["engine:rollout vs trainer:rollout"]
    assert summary["mismatch/abs_mean"] == 0.0 and summary["mismatch/kl_k3"] == 0.0
    assert summary["sequence.mismatch/abs_max"] == 0.0
    assert {g["expr"]: g["status"] for g in obj["gates"] if g["status"] != "pass"} == {
        "tau_dev>0.02": "skipped"
    }
    for profile in ("nemo", "verl", "slime", "deterministic"):
        assert _invoke("compare", runs["a"], runs["same"], "--profile", profile).exit_code == 0, profile


def test_report_files_plots_and_round_trip(runs, tmp_path) -> None:
    out = tmp_path / "rep"
    result = _invoke("compare", runs["two"], "--out", out, "--json", "--by", "position", "--by", "prob_bucket",
                     "--by", "step")  # fmt: skip
    assert result.exit_code == 1, result.output  # no gate given: the recommended profile's fail gates fail
    files = json.loads(result.stdout)["files"]
    for kind in PLOTS:
        path = Path(files["plots"][kind])
        assert path.exists() and path.stat().st_size > 1000, kind
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = load_report(out / "compare.parquet")
    written = pl.read_parquet(out / "compare.parquet")
    assert report.summary.height == written.height
    assert report.kind == "compare" and report.meta["streams"] == {"a": "rollout", "b": "old"}
    assert report.worst_tokens is not None and report.worst_tokens.height == 20
    assert report.worst_seqs is not None and report.worst_seqs.height == 20
    assert report.worst_tokens["dlogp"].abs().is_sorted(descending=True)
    assert set(report.summary["breakdown"].unique()) == {"all", "position", "prob_bucket", "step", "dlogp"}
    assert "W401" in report.checks["code"].to_list()
    markdown = (out / "compare.md").read_text()
    assert "| abs_mean |" in markdown and "W401" in markdown
    redrawn = _invoke("plot", out, "--out", tmp_path / "again", "--json")
    assert redrawn.exit_code == 0, redrawn.output
    again = json.loads(redrawn.stdout)["files"]["plots"]
    assert set(again) == {"dlogp-hist", "by-prob", "by-position", "by-step", "worst-trace"}
    # the token plots need the token table: --kind all says so instead of leaving them out silently
    skipped = json.loads(redrawn.stdout)["plots_skipped"]
    assert set(skipped) == {"dlogp-vs-logprob", "hexbin"} and "--tokens-out" in skipped["hexbin"]
    assert "skipped hexbin: needs token data" in redrawn.stderr
    assert all(Path(p).stat().st_size > 1000 for p in again.values())
    svg = _invoke("plot", out, "--kind", "by-prob", "--format", "svg", "--out", tmp_path / "svg")
    assert svg.exit_code == 0, svg.output
    assert (tmp_path / "svg" / "by-prob.svg").read_text().lstrip().startswith("<?xml")


def test_token_table_redraws_token_plots(runs, tmp_path) -> None:
    tokens = tmp_path / "tokens.parquet"
    assert _invoke("compare", runs["two"], "--tokens-out", tokens, "--exit-zero").exit_code == 0
    table = pl.read_parquet(tokens)
    assert table["dlogp"].to_list() == pytest.approx((table["lp_b"] - table["lp_a"]).to_list())
    result = _invoke("plot", tokens, "--out", tmp_path / "tok", "--json")
    assert result.exit_code == 0, result.output
    plots = json.loads(result.stdout)["files"]["plots"]
    assert set(plots) == {"dlogp-vs-logprob", "hexbin", "dlogp-hist"}


def test_fail_gate_exit_1_and_exit_zero(runs) -> None:
    result = _invoke("compare", runs["two"], "--fail-on", "k3>1e-3", "--json")
    assert result.exit_code == 1
    gate = json.loads(result.stdout)["gates"][0]
    assert gate["status"] == "fail" and gate["metric"] == "mismatch/kl_k3" and gate["value"] > 1e-3
    assert _invoke("compare", runs["two"], "--fail-on", "k3>1e-3", "--exit-zero").exit_code == 0
    assert _invoke("compare", runs["two"], "--warn-on", "mismatch/abs_mean>0.02").exit_code == 0
    assert _invoke("compare", runs["two"], "--strict").exit_code == 1  # W401 under --strict


def test_without_gates_disagree_exits_1_unless_exit_zero(runs) -> None:
    """No gate given: the fail gates of the recommended profile apply (docs/cli.md), so DISAGREE exits 1."""
    result = _invoke("compare", runs["two"], "--json")
    assert result.exit_code == 1, result.output
    obj = json.loads(result.stdout)
    assert obj["status"] == "fail" and obj["verdict"]["status"] == "DISAGREE"
    ran = {(g["expr"], g["kind"]) for g in obj["gates"]}
    fails = {(expr, "fail") for kind, expr in pgdiag.report.gates.PROFILES["recommended"] if kind == "fail"}
    assert ran == fails  # the fail gates only: no warn gate of the profile
    assert any(g["status"] == "fail" for g in obj["gates"])
    assert _invoke("compare", runs["two"], "--exit-zero").exit_code == 0
    same = _invoke("compare", runs["a"], runs["same"], "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["verdict"]["status"] == "AGREE"


def test_shifted_run_exits_3_with_location(runs) -> None:
    result = _invoke("compare", runs["a"], runs["shifted"], "--json")
    assert result.exit_code == 3
    assert "error[E302]" in result.stderr
    assert "looks shifted by -1" in result.stderr and "step 0, sample s0" in result.stderr
    assert json.loads(result.stdout)["error"]["code"] == "E302"


def test_tokens_out_is_not_written_when_compare_exits_3(runs, tmp_path) -> None:
    out = tmp_path / "tok"
    result = _invoke("compare", runs["a"], runs["shifted"], "--tokens-out", out / "tokens.parquet")
    assert result.exit_code == 3 and "error[E302]" in result.stderr
    assert not out.exists() or list(out.iterdir()) == []  # neither the table nor its temp file
    result = _invoke("compare", runs["a"], runs["same"], "--tokens-out", out / "tokens.parquet", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"]["tokens"] == str(out / "tokens.parquet")
    assert pl.read_parquet(out / "tokens.parquet")["dlogp"].abs().max() == 0.0  # the same run twice


def test_unknown_gate_is_usage_error(runs) -> None:
    result = _invoke("compare", runs["a"], runs["same"], "--fail-on", "mismatch/nope>1")
    assert result.exit_code == 2
    assert "unknown metric" in result.stderr


def test_side_by_side_metrics_and_deltas(runs) -> None:
    from pgdiag.compare.api import compare_runs
    from pgdiag.data.runs import read_run

    report = compare_runs(
        read_run(runs["two"]), read_run(runs["two_b"]), stream_a="old", metrics=MetricSettings()
    ).report
    batch = report.summary.filter((pl.col("scope") == "batch") & (pl.col("breakdown") == "all"))
    assert set(batch["pair"].unique()) == {
        "one:rollout vs one:old",
        "other:rollout vs other:old",
        "other - one",
    }

    def value(pair: str, metric: str) -> float:
        return batch.filter((pl.col("pair") == pair) & (pl.col("metric") == metric))["value"][0]

    # run b's old stream is run a's minus 0.01 nats everywhere: policy log-ratio mean moves by exactly -0.01
    for metric in ("policy/logratio_mean", "policy/kl_k3", "policy/clip_frac_band"):
        delta = value("other - one", metric)
        assert delta == pytest.approx(
            value("other:rollout vs other:old", metric) - value("one:rollout vs one:old", metric)
        )
    assert value("other - one", "policy/logratio_mean") == pytest.approx(-0.01, abs=1e-6)
    # the compare pair itself: Δ = -0.01 on every token, and the batch rows never feed compare's gates
    assert report.value("mismatch/bias", scope="token") == pytest.approx(-0.01, abs=1e-6)
    from pgdiag.report.gates import evaluate_gates

    gates = evaluate_gates(
        report, fail_on=["policy/kl_k3>0"], default_family="mismatch", known_metrics=["policy/kl_k3"]
    )
    assert [g.status for g in gates.gates] == ["missing"]
    # the per-step plot draws the metric of both runs
    from pgdiag.report.plots import plot_by_step

    lines = plot_by_step(report, metric="policy/kl_k3").axes[0].lines
    assert [line.get_label() for line in lines] == ["one:rollout vs one:old", "other:rollout vs other:old"]
    assert all(len(line.get_xdata()) == 2 for line in lines)


def test_all_row_matches_pgdiag_metrics_mismatch_family(runs) -> None:
    """compare's token-scope `all` row and `pgdiag metrics`' mismatch family are the same numbers."""
    from pgdiag.compare.api import compare_runs
    from pgdiag.data.runs import read_run
    from pgdiag.metrics.api import compute_metrics

    run = read_run(runs["two"])
    ours = compare_runs(run, stream_a="rollout", stream_b="old").report
    theirs = compute_metrics(run, new="old", old="rollout", stream_a="rollout", stream_b="old")
    pair = "one:rollout vs one:old"
    mine = ours.summary.filter((pl.col("scope") == "token") & (pl.col("breakdown") == "all"))
    other = theirs.summary.filter((pl.col("breakdown") == "all") & (pl.col("pair") == pair))
    reference = dict(zip(other["metric"].to_list(), other["value"].to_list(), strict=True))
    shared = [
        (m, v) for m, v in zip(mine["metric"], mine["value"], strict=True) if reference.get(m) is not None
    ]
    assert len(shared) >= 25
    for metric, value in shared:
        assert value == pytest.approx(reference[metric], rel=1e-9, abs=1e-12), metric


def test_tokenizer_decodes_worst_token_context(runs, tmp_path) -> None:
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "rep"
    result = _invoke(
        "compare", runs["two"], "--tokenizer", tmp_path, "--out", out, "--worst-k", "3", "--exit-zero"
    )
    assert result.exit_code == 0, result.output
    worst = pl.read_parquet(out / "compare.worst_tokens.parquet")
    row = worst.row(0, named=True)
    words = row["context"].split()
    assert f"w{row['token_id']}" in words and all(w.startswith("w") for w in words)
    assert 1 <= len(words) <= 17  # ±8 loss tokens of the same sample


def test_footer_semantics_reach_the_checks(tmp_path) -> None:
    from batch_factory import rollout_rows
    from rollout_factory import write_rollouts_file

    samples = random_samples(12, 6)
    streams = {
        "rollout_logprobs": {
            "source_field": "x",
            "tempered": "unknown",
            "logprobs_mode": "raw",
            "head_dtype": "bf16",
        },
        "old_logprobs": {
            "source_field": "y",
            "tempered": False,
            "logprobs_mode": "raw",
            "head_dtype": "fp32",
        },
    }
    path = write_rollouts_file(
        tmp_path / "r.parquet",
        rollout_rows(samples, run="r", streams={"rollout_logprobs": "rollout", "old_logprobs": "old"}),
        streams=streams,
    )
    result = _invoke("compare", path, "--json")
    assert result.exit_code == 0, result.output
    checks = {c["code"]: c["message"] for c in json.loads(result.stdout)["checks"]}
    assert "tempered unknown" in checks["W409"]
    assert (
        "rollout_logprobs head bf16 vs old_logprobs head fp32"
        in checks["W411"].replace("rollout ", "rollout_logprobs ").replace("old ", "old_logprobs ")
        or "bf16" in checks["W411"]
    )


def test_side_by_side_rows_do_not_change_the_profile_verdict(runs) -> None:
    plain = _invoke(
        "compare", runs["two"], runs["two_b"], "--stream-a", "old", "--profile", "recommended", "--json"
    )
    with_metrics = _invoke(
        "compare",
        runs["two"],
        runs["two_b"],
        "--stream-a",
        "old",
        "--profile",
        "recommended",
        "--metrics",
        "--json",
    )
    first, second = json.loads(plain.stdout), json.loads(with_metrics.stdout)
    assert plain.exit_code == with_metrics.exit_code
    assert [(g["expr"], g["status"]) for g in first["gates"]] == [
        (g["expr"], g["status"]) for g in second["gates"]
    ]
    assert "policy/kl_k3" in second["summary"]["other - one"]


def test_runs_with_different_sample_ids_join_on_seq_hash(tmp_path) -> None:
    samples = random_samples(13, 20)
    renamed = copy.deepcopy(samples)
    for i, s in enumerate(renamed):
        s["sample_id"] = f"fastllm-{i}"
    a = write_run(tmp_path / "a.parquet", samples, run="ds", streams={"rollout_logprobs": "rollout"})
    b = write_run(
        tmp_path / "b.parquet", renamed[::-1], run="fastllm", streams={"rollout_logprobs": "rollout"}
    )
    result = _invoke("compare", a, b, "--json", "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout)
    assert obj["inputs"]["n_samples"] == 20
    assert obj["summary"]["ds:rollout vs fastllm:rollout"]["mismatch/abs_max"] == 0.0
    assert load_report(tmp_path / "rep" / "compare.parquet").meta["join"] == "hash"
    forced = _invoke("compare", a, b, "--join", "id")
    assert forced.exit_code == 3 and "error[E304]" in forced.stderr


SAMPLE_DATA = SAMPLE_DATA


def _json_summary(*args: str) -> dict:
    result = _invoke(*args, "--json")
    return json.loads(result.stdout)["summary"]


def test_clip_band_reaches_the_side_by_side_metrics() -> None:
    """`--eps-low/--eps-high` move the side-by-side policy clip band exactly as `pgdiag metrics` computes it."""
    run_a, run_b = SAMPLE_DATA / "run_a", SAMPLE_DATA / "run_b"
    narrow = ("--eps-low", "0.05", "--eps-high", "0.05")
    side = _json_summary("compare", run_a, run_b, "--metrics", *narrow)["run_a:old vs run_a:new"]
    own = _json_summary("metrics", run_a, "--new", "new", "--old", "old", *narrow)["run_a:old vs run_a:new"]
    wide = _json_summary("metrics", run_a, "--new", "new", "--old", "old")["run_a:old vs run_a:new"]
    assert side["policy/clip_frac_band"] == own["policy/clip_frac_band"]
    assert side["policy/clip_frac_band"] > wide["policy/clip_frac_band"]  # a narrower band holds fewer tokens


def test_one_run_defaults_to_the_engine_vs_trainer_pair(tmp_path) -> None:
    """`compare RUN` pairs rollout with old (engine vs trainer, as `metrics` does), not with the updated policy."""
    run_a = SAMPLE_DATA / "run_a"
    result = json.loads(_invoke("compare", run_a, "--json").stdout)
    assert result["inputs"]["streams"] == ["rollout", "old"]
    explicit = _json_summary("compare", run_a, "--stream-a", "rollout", "--stream-b", "old")
    assert result["summary"] == explicit
    metrics = _json_summary("metrics", run_a)["run_a:rollout vs run_a:old"]
    pair = result["summary"]["run_a:rollout vs run_a:old"]
    assert pair["mismatch/abs_mean"] == pytest.approx(metrics["mismatch/abs_mean"], rel=1e-12)
    # without an old stream, the trainer side is the recomputed (new) policy
    samples = random_samples(3, 8)
    no_old = write_run(
        tmp_path / "n.parquet",
        samples,
        run="r",
        streams={"rollout_logprobs": "rollout", "new_logprobs": "old"},
    )
    assert json.loads(_invoke("compare", no_old, "--json").stdout)["inputs"]["streams"] == ["rollout", "new"]


def test_metrics_and_compare_agree_on_a_profile_verdict() -> None:
    """Same pair, same profile: the same exit code, and `tau_dev` (no logits) skipped in both."""
    run_a = SAMPLE_DATA / "run_a"
    loose = (
        "--profile",
        "recommended",
        "--fail-on",
        "mismatch/abs_mean>1",
        "--fail-on",
        "mismatch/frac_out_2x>1",
    )
    results = [json.loads(_invoke(cmd, run_a, *loose, "--json").stdout) for cmd in ("metrics", "compare")]
    assert [r["exit_code"] for r in results] == [0, 0]
    for r in results:
        tau = [g for g in r["gates"] if g["expr"] == "tau_dev>0.02"]
        assert [g["status"] for g in tau] == ["skipped"]
    strict = [_invoke(cmd, run_a, "--profile", "recommended").exit_code for cmd in ("metrics", "compare")]
    assert strict == [1, 1]  # abs_mean 0.026 > 0.02 fails in both


def test_library_outcome_is_the_cli_verdict() -> None:
    """`pgdiag.outcome` on the library's report gives the exit code and gates the CLI prints."""
    import pgdiag

    run_a = SAMPLE_DATA / "run_a"
    gate_settings = pgdiag.GateSettings(profile="recommended", fail_on=("policy/kl_k1>1",))
    for command, report in (
        ("metrics", pgdiag.compute_metrics(pgdiag.read_run(run_a))),
        ("compare", pgdiag.compare_runs(run_a).report),
    ):
        fail_on = ("--fail-on", "policy/kl_k1>1") if command == "metrics" else ()
        cli = json.loads(_invoke(command, run_a, "--profile", "recommended", *fail_on, "--json").stdout)
        if command == "compare":
            gate_settings = pgdiag.GateSettings(profile="recommended")
        verdict = pgdiag.outcome(report, gate_settings)
        assert (verdict.status, verdict.exit_code) == (cli["status"], cli["exit_code"]) == ("fail", 1)
        assert [(g.expr, g.status) for g in verdict.gates.gates] == [
            (g["expr"], g["status"]) for g in cli["gates"]
        ]
    defaults = [g.expr for g in pgdiag.outcome(pgdiag.compute_metrics(pgdiag.read_run(run_a))).gates.gates]
    assert defaults == ["count/tokens_invalid>0"]  # the metrics default gate travels with the report


def test_check_and_compare_name_the_same_first_error() -> None:
    """Runs built from different tokens: `check` and `compare` both report E301 first (tokens before masks)."""
    pair = (SAMPLE_DATA / "run_a", SAMPLE_DATA / "synthetic_a")
    check = json.loads(_invoke("check", *pair, "--json").stdout)
    compare = json.loads(_invoke("compare", *pair, "--json").stdout)
    first_check = next(c["code"] for c in check["checks"] if c["severity"] == "error")
    assert (check["exit_code"], compare["exit_code"]) == (3, 3)
    assert first_check == compare["error"]["code"] == "E301"


def test_metrics_and_compare_reduce_the_same_mismatch_terms() -> None:
    """`metrics.terms` is the one implementation of the per-token mismatch terms: on the same pair the KL, chi-square
    and tmpe values of `metrics` and of compare's parity table are the same numbers, bit for bit."""
    import pgdiag

    run = pgdiag.read_run(SAMPLE_DATA / "run_a")
    ours = pgdiag.compare_runs(run).report  # rollout vs old
    theirs = pgdiag.compute_metrics(run)
    for stat in ("kl_k3", "kl_rev_k3", "chi2_token", "tmpe", "abs_mean", "bias"):
        key = f"mismatch/{stat}"
        assert ours.value(key, scope="token") == theirs.value(key, pair="run_a:rollout vs run_a:old"), stat
