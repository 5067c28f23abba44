"""Gates (docs/cli.md): grammar, resolution of names, profiles, missing values, exit codes."""

from __future__ import annotations

import pytest

from pgdiag.errors import UsageError
from pgdiag.report.gates import PROFILES, evaluate_gates, parse_gate
from pgdiag.report.report import Report, ReportRow, summary_frame


def _report(
    values: dict[str, float | None], *, scope: str = "token", pair: str = "a:rollout vs a:old"
) -> Report:
    rows = [ReportRow(pair, scope, "all", "all", k, v, "nats", "token", 10) for k, v in values.items()]
    # a per-step row must never be gated
    rows.append(ReportRow(pair, scope, "step", "3", "mismatch/kl_k3", 99.0, "nats", "token", 10))
    return Report("compare", summary_frame(rows))


@pytest.mark.parametrize(
    ("expr", "scope", "name", "op", "threshold"),
    [
        ("k3>1e-3", "token", "kl_k3", ">", 1e-3),
        (" mismatch/abs_mean >= 0.02 ", "token", "mismatch/abs_mean", ">=", 0.02),
        ("seq.mismatch/k1<-0.5", "sequence", "mismatch/kl_k1", "<", -0.5),
        ("tok.tau_dev<=inf", "token", "tau_dev", "<=", float("inf")),
        ("tau>2", "token", "tau_fit", ">", 2.0),
    ],
)
def test_parse_gate(expr: str, scope: str, name: str, op: str, threshold: float) -> None:
    gate = parse_gate(expr)
    assert (gate.scope, gate.name, gate.op, gate.threshold) == (scope, name, op, threshold)


@pytest.mark.parametrize("expr", ["k3", "k3 > ", "k3>abc", "k3=1", ">1", "k3>nan"])
def test_parse_gate_rejects_malformed(expr: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_gate(expr)
    assert info.value.code == "E110"


def test_fail_warn_and_pass() -> None:
    report = _report({"mismatch/kl_k3": 2e-3, "mismatch/abs_mean": 0.01})
    result = evaluate_gates(report, fail_on=["k3>1e-3"], warn_on=["mismatch/abs_mean>0.005"])
    statuses = {(g.expr, g.status) for g in result.gates}
    assert statuses == {("k3>1e-3", "fail"), ("mismatch/abs_mean>0.005", "warn")}
    assert (result.status, result.exit_code) == ("fail", 1)
    # 2e-3 > 1e-2 is false: only the warning remains
    result = evaluate_gates(report, fail_on=["k3>1e-2"], warn_on=["mismatch/abs_mean>0.005"])
    assert (result.status, result.exit_code) == ("warn", 0)
    assert [g.value for g in result.gates] == [2e-3, 0.01]


def test_only_breakdown_all_rows_are_gated() -> None:
    # the per-step row holds 99.0; the pooled row 0.0 passes
    result = evaluate_gates(_report({"mismatch/kl_k3": 0.0}), fail_on=["k3>1"])
    assert result.exit_code == 0 and [g.value for g in result.gates] == [0.0]


def test_null_value_fails_as_missing_and_warn_passes() -> None:
    report = _report({"entropy/mean": None})
    result = evaluate_gates(report, fail_on=["entropy/mean>1"])
    assert [g.status for g in result.gates] == ["missing"] and result.exit_code == 1
    result = evaluate_gates(report, warn_on=["entropy/mean>1"])
    assert [g.status for g in result.gates] == ["pass"] and result.exit_code == 0


def test_known_but_absent_metric_is_missing() -> None:
    result = evaluate_gates(
        _report({"mismatch/kl_k3": 0.0}), fail_on=["entropy/mean>1"], known_metrics=["entropy/mean"]
    )
    assert [g.status for g in result.gates] == ["missing"]


def test_unknown_metric_suggests() -> None:
    with pytest.raises(UsageError) as info:
        evaluate_gates(_report({"mismatch/kl_k3": 0.0}), fail_on=["mismatch/kl_k4>1"])
    assert info.value.code == "E110" and "mismatch/kl_k3" in (info.value.hint or "")


def test_ambiguous_stat_needs_family_unless_default() -> None:
    report = _report({"mismatch/kl_k3": 0.5, "policy/kl_k3": 0.0})
    with pytest.raises(UsageError, match="several families"):
        evaluate_gates(report, fail_on=["k3>0.1"])
    result = evaluate_gates(report, fail_on=["k3>0.1"], default_family="mismatch")
    assert [(g.metric, g.status) for g in result.gates] == [("mismatch/kl_k3", "fail")]


def test_scope_selects_rows() -> None:
    token = _report({"mismatch/abs_mean": 0.001})
    seq = _report({"mismatch/abs_mean": 0.5}, scope="sequence")
    report = Report("compare", token.summary.vstack(seq.summary))
    assert evaluate_gates(report, fail_on=["abs_mean>0.1"]).exit_code == 0
    assert evaluate_gates(report, fail_on=["seq.abs_mean>0.1"]).exit_code == 1


def test_tau_dev_is_distance_from_one() -> None:
    report = _report({"mismatch/tau_fit": 0.7})
    result = evaluate_gates(report, fail_on=["tau_dev>0.02"])
    assert result.gates[0].value == pytest.approx(0.3) and result.exit_code == 1


def test_any_failing_pair_fails() -> None:
    good = _report({"mismatch/kl_k3": 0.0}, pair="a:rollout vs a:old")
    bad = _report({"mismatch/kl_k3": 1.0}, pair="b:rollout vs b:old")
    result = evaluate_gates(Report("compare", good.summary.vstack(bad.summary)), fail_on=["k3>0.5"])
    assert sorted(g.status for g in result.gates) == ["fail", "pass"] and result.exit_code == 1


def test_profile_skips_absent_families_and_explicit_wins() -> None:
    report = _report({"mismatch/abs_mean": 0.015, "mismatch/kl_k3": 1e-4, "mismatch/tmpe": 1.01})
    result = evaluate_gates(report, profile="recommended")
    by_expr = {g.expr: g.status for g in result.gates}
    # frac_out_2x and tau_fit are absent from this report: listed as skipped, not missing
    assert by_expr["mismatch/frac_out_2x>1e-3"] == "skipped" and by_expr["tau_dev>0.02"] == "skipped"
    assert by_expr["mismatch/abs_mean>0.02"] == "pass" and by_expr["mismatch/abs_mean>0.01"] == "warn"
    assert result.status == "warn"
    # an explicit fail gate on the same name and scope replaces the profile's
    result = evaluate_gates(report, fail_on=["mismatch/abs_mean>0.001"], profile="recommended")
    fails = [g.expr for g in result.gates if g.status == "fail"]
    assert fails == ["mismatch/abs_mean>0.001"]
    assert set(PROFILES) == {"recommended", "nemo", "verl", "slime", "deterministic", "exact"}


def test_unknown_profile() -> None:
    with pytest.raises(UsageError, match="unknown profile"):
        evaluate_gates(_report({}), profile="strictest")


def test_profile_gate_absent_at_its_scope_is_skipped() -> None:
    # mismatch/tmpe exists only at batch scope here (e.g. a side-by-side row): the token-scope profile gate
    # on it is skipped, not "missing"
    token = _report({"mismatch/abs_mean": 0.001})
    batch = _report({"mismatch/tmpe": 9.0}, scope="batch")
    result = evaluate_gates(Report("compare", token.summary.vstack(batch.summary)), profile="nemo")
    statuses = {g.expr: g.status for g in result.gates}
    assert statuses == {"mismatch/tmpe>1.05": "skipped", "mismatch/kl_k3>1e-3": "skipped"}
    assert result.exit_code == 0 and result.status == "pass"
