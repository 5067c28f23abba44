"""The verdict functions on hand-built reports: each anomaly at the step where it was planted, thresholds
exactly at their edges, AGREE/DISAGREE by thresholds and by gates, whatif's lossy rules with their worst step,
drift's change points in step order, and check's first problem."""

from __future__ import annotations

import polars as pl

from pgdiag.data.validate import Issue, check_result
from pgdiag.report.gates import GateOutcome, GateResult
from pgdiag.report.report import Report, ReportRow, summary_frame
from pgdiag.report.verdict import (
    check_verdict,
    compare_verdict,
    drift_verdict,
    metrics_verdict,
    report_verdict,
    whatif_verdict,
)

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


WHATIF_PAIR = "r:rollout vs r:old"


def _whatif_report(rules: dict[str, dict[str, float]], steps: dict[str, dict[str, float]]) -> Report:
    """Threshold rows of `rules` ({rule: {metric: value}}, rule "none" the uncorrected batch) and per-step rows
    of whatif/tokens_affected ({rule: {step: fraction}})."""
    rows = [
        ReportRow(
            WHATIF_PAIR, "token", "threshold", rule, f"whatif/{metric}", value, "fraction", "token-mean", 100
        )
        for rule, values in rules.items()
        for metric, value in values.items()
    ]
    rows += [
        ReportRow(WHATIF_PAIR, "token", "threshold/step", f"{rule}|{step}", "whatif/tokens_affected", value,
                  "fraction", "token-mean", 50)
        for rule, per_step in steps.items()
        for step, value in per_step.items()
    ]  # fmt: skip
    return Report("whatif", summary_frame(rows), meta={"pairs": [WHATIF_PAIR]})


def test_whatif_names_the_rules_that_drop_data_with_their_worst_step() -> None:
    report = _whatif_report(
        {
            "none": {"ess_token": 0.9, "ess_seq": 0.5},
            "token_tis:2": {"tokens_affected": 0.2, "tokens_kept": 1.0, "seqs_affected": 0.5},
            "token_mis:0.5,2": {"tokens_affected": 0.05, "tokens_kept": 0.95, "seqs_affected": 0.25},
            "seq_mis:0.5,2": {"tokens_affected": 0.3, "tokens_kept": 0.7, "seqs_affected": 0.25},
            "icepop:0.5,5": {"tokens_affected": 0.1, "tokens_kept": 0.9, "seqs_affected": 0.125},
        },
        {"seq_mis:0.5,2": {"0": 0.1, "1": 0.5}, "icepop:0.5,5": {"0": 0.2, "1": 0.0}},
    )
    verdict = whatif_verdict(report)
    assert verdict.status == "warnings"
    # token TIS truncates (keeps every token); 1 - 0.95 = 0.05 sits on the threshold: not a loss
    assert [(f.kind, f.value) for f in verdict.findings] == [("data_lost", 0.7), ("data_lost", 0.9)]
    assert verdict.line == (
        "whatif: 2 of 4 rules drop more than 5% of the tokens: seq_mis:0.5,2 drops 30% of the tokens, 25% of "
        "the sequences (worst step 1: 50%); icepop:0.5,5 drops 10% of the tokens, 12.5% of the sequences "
        "(worst step 0: 20%); uncorrected ESS: token 0.9, sequence 0.5"
    )
    assert report_verdict(report) == verdict


def test_whatif_clean_names_the_rule_that_touches_most() -> None:
    report = _whatif_report(
        {
            "none": {"ess_token": 0.99, "ess_seq": 0.8},
            "token_tis:2": {"tokens_affected": 0.2, "tokens_kept": 1.0, "seqs_affected": 0.5},
            "icepop:0.5,5": {"tokens_affected": 0.01, "tokens_kept": 0.99, "seqs_affected": 0.125},
        },
        {"token_tis:2": {"0": 0.25, "1": 0.15}},
    )
    verdict = whatif_verdict(report)
    assert verdict.status == "clean" and verdict.findings == ()
    assert verdict.line == (
        "whatif: no rule of 2 drops more than 5% of the tokens; most affected: token_tis:2 truncates or drops "
        "20% of the tokens, 50% of the sequences (worst step 0: 25%); uncorrected ESS: token 0.99, sequence 0.8"
    )
    untouched = _whatif_report({"none": {"ess_token": 1.0}, "seq_tis:5": {"tokens_affected": 0.0}}, {})
    assert "no rule truncates or drops any token" in whatif_verdict(untouched).line


def test_whatif_low_uncorrected_ess_is_a_warning() -> None:
    report = _whatif_report(
        {
            "none": {"ess_token": 0.05, "ess_seq": 0.01},
            "token_tis:2": {"tokens_affected": 0.4, "tokens_kept": 1.0},
        },
        {},
    )
    verdict = whatif_verdict(report)
    assert verdict.status == "warnings"
    assert [(f.kind, f.metric, f.value, f.threshold) for f in verdict.findings] == [
        ("ess_low", "whatif/ess_token", 0.05, 0.1)
    ]
    assert whatif_verdict(_whatif_report({}, {})).status == "NO DATA"


def _drift_report(found: list[dict], series: list[str] | None) -> Report:
    change_points = {"threshold": 6.0, "found": found} | ({"series": series} if series is not None else {})
    meta = {"change_points": change_points, "inputs": {"steps": list(range(30))}, "pairs": [PAIR]}
    return Report("drift", summary_frame([]), meta=meta)


def test_drift_lists_change_points_in_step_order() -> None:
    late = {"metric": "policy/kl_k3", "step": 20, "jump": -0.5, "before": 1.0, "after": 0.5, "score": 7.25}
    early = {
        "metric": "mismatch/abs_mean",
        "step": 9,
        "jump": 0.09,
        "before": 0.01,
        "after": 0.1,
        "score": 12.0,
    }
    verdict = drift_verdict(_drift_report([late, early], ["policy/kl_k3", "mismatch/abs_mean"]))
    assert verdict.status == "anomalies"
    assert [(f.kind, f.metric, f.step, f.value) for f in verdict.findings] == [
        ("change_point", "mismatch/abs_mean", "9", 0.09),
        ("change_point", "policy/kl_k3", "20", -0.5),
    ]
    assert verdict.line == (
        "drift: 2 change points over 30 steps: step 9: mismatch/abs_mean 0.01 → 0.1 (jump +0.09, z 12.0); "
        "step 20: policy/kl_k3 1 → 0.5 (jump -0.5, z 7.2)"
    )
    clean = drift_verdict(_drift_report([], ["policy/kl_k3", "mismatch/abs_mean"]))
    assert (clean.status, clean.line) == ("clean", "drift: no change point in 2 series over 30 steps (z ≥ 6)")
    short = _drift_report([], [])
    short.meta["change_points"]["min_steps"] = 31  # 30 steps: no series is searched
    assert (drift_verdict(short).status, drift_verdict(short).line) == (
        "NO DATA",
        "drift: NO DATA: 30 steps, fewer than the 31 a change-point search needs",
    )
