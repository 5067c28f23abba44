"""The verdict functions on hand-built reports: each anomaly at the step where it was planted, thresholds
exactly at their edges, AGREE/DISAGREE by thresholds and by gates, and check's first problem."""

from __future__ import annotations

import polars as pl

from pgdiag.data.validate import Issue, check_result
from pgdiag.report.gates import GateOutcome, GateResult
from pgdiag.report.report import Report, ReportRow, summary_frame
from pgdiag.report.verdict import check_verdict, compare_verdict, metrics_verdict

PAIR = "r:old vs r:new"


def _metrics_report(per_step: dict[str, dict[str, float]], statuses: dict[str, str] | None = None) -> Report:
    rows = [
        ReportRow(PAIR, "token", "step", step, metric, value, "1", "tok", 10)
        for step, values in per_step.items()
        for metric, value in values.items()
    ]
    steps = [{"step": s, "status": (statuses or {}).get(s, "ok")} for s in per_step] + [
        {"step": "all", "status": "ok"}
    ]
    return Report("metrics", summary_frame(rows), meta={"steps": steps, "pairs": [PAIR]})


def test_each_anomaly_is_named_with_its_step() -> None:
    report = _metrics_report(
        {
            "0": {"policy/ess_token": 0.9, "policy/ratio_max": 11.0, "policy/kl_k3": 0.001},
            "1": {"policy/ess_token": 0.1, "policy/clip_frac_binding": 0.3, "policy/kl_k3": 0.001},
            "2": {"policy/ess_token": 0.05, "policy/ratio_max": 10.0, "policy/kl_k3": 0.05},
            "3": {"count/tokens": 0.0},
        },
        statuses={"3": "empty"},
    )
    verdict = metrics_verdict(report)
    found = [(f.kind, f.step, f.value) for f in verdict.findings]
    # ESS 0.1 and ratio max 10 sit on the thresholds: not anomalies; the KL median is 0.001 -> limit 0.01
    assert found == [
        ("ratio_max", "0", 11.0),
        ("clip_frac", "1", 0.3),
        ("ess_low", "2", 0.05),
        ("kl_jump", "2", 0.05),
        ("empty_step", "3", None),
    ]
    assert verdict.status == "anomalies"
    assert verdict.line.startswith("metrics: 5 anomalies: step 0: policy/ratio_max 11 > 10; ")
    assert verdict.line.endswith("; and 2 more")
    assert next(f for f in verdict.findings if f.kind == "kl_jump").threshold == 0.01
    assert verdict.as_dict()["findings"][0] == {
        "kind": "ratio_max",
        "metric": "policy/ratio_max",
        "step": "0",
        "value": 11.0,
        "threshold": 10.0,
        "message": "step 0: policy/ratio_max 11 > 10",
    }


def test_no_anomaly_is_clean() -> None:
    report = _metrics_report({"0": {"policy/ess_token": 0.5, "policy/kl_k3": 0.02}})
    verdict = metrics_verdict(report)  # one step: no KL jump can be judged
    assert (verdict.status, verdict.findings) == ("clean", ())
    assert verdict.line.startswith("metrics: no anomaly")


def _compare_report(values: dict[str, float]) -> Report:
    rows = [ReportRow(PAIR, "token", "all", "all", m, v, "nats", "tok", 100) for m, v in values.items()]
    rows += [
        ReportRow(PAIR, "token", "position", b, "mismatch/abs_mean", v, "nats", "tok", n)
        for b, v, n in (("0", 0.001, 50), ("[8,16)", 0.03, 7))
    ]
    tokens = pl.DataFrame({"pair": [PAIR], "step": [4], "sample_id": ["4:1"], "pos": [12], "dlogp": [-0.5]})
    return Report("compare", summary_frame(rows), meta={"pairs": [PAIR]}, worst_tokens=tokens)


def test_compare_agrees_or_disagrees_by_the_recommended_thresholds() -> None:
    close = compare_verdict(_compare_report({"mismatch/abs_mean": 0.01, "mismatch/kl_k3": 0.002}))
    # 0.01 / 0.02 = 0.5 of its threshold beats 0.002 / 0.01 = 0.2: abs_mean is the worst statistic
    assert close.status == "AGREE" and not close.findings
    assert close.line == (
        "compare: AGREE (recommended thresholds): worst mismatch/abs_mean 0.01 ≤ 0.02; "
        "worst at position [8,16) (0.03, n=7), token step 4 sample 4:1 pos 12 (Δ -0.5)"
    )
    far = compare_verdict(_compare_report({"mismatch/abs_mean": 0.01, "mismatch/tmpe": 1.2}))
    assert far.status == "DISAGREE"  # (1.2 - 1) / 0.05 = 4 times its threshold
    assert far.line.startswith("compare: DISAGREE (recommended thresholds): worst mismatch/tmpe 1.2 > 1.05")
    assert [f.metric for f in far.findings] == ["mismatch/tmpe"]


def test_compare_follows_the_gates_when_given() -> None:
    report = _compare_report({"mismatch/abs_mean": 0.5})  # far past the default threshold
    passed = GateResult(
        "pass", (GateOutcome("abs_mean>1", "fail", PAIR, "mismatch/abs_mean", 0.5, "pass"),), 0
    )
    assert compare_verdict(report, passed).line.startswith("compare: AGREE (1 gates passed): worst")
    failed = GateResult(
        "fail", (GateOutcome("abs_mean>0.1", "fail", PAIR, "mismatch/abs_mean", 0.5, "fail"),), 1
    )
    verdict = compare_verdict(report, failed)
    assert verdict.status == "DISAGREE"
    assert verdict.line.startswith(f"compare: DISAGREE (1 gates): {PAIR}: gate abs_mean>0.1 (0.5); worst at")


def test_check_names_the_first_error_before_warnings() -> None:
    assert check_verdict(check_result([])).line == "check: clean"
    result = check_result(
        [Issue("W215", "warning", 2, "empty mask"), Issue("E201", "error", 1, "length 3 != 4")]
    )
    verdict = check_verdict(result)
    assert verdict.status == "errors"
    assert verdict.line == "check: errors (1 error, 1 warning); first: error[E201] length 3 != 4"
