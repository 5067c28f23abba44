"""The whatif verdict's findings beyond lost data (docs/whatif.md): signal, weights, PSIS k̂.

* `signal_low`: a rule keeps less than `SIGNAL_MIN` (80 %) of Σ|A| in the loss;
* `one_sign`: a rule's lost signal is mostly of one sign of A (the other sign loses under a quarter as much, and
  the larger loss is at least 5 %): it biases the update, not only shrinks it;
* `length_collapse`: exp(ΣΔ) has median < 0.5 while the token ratio is within 1 ± 0.01;
* `chi2_negative`: verl's chi2_seq < 0, explained (the sequence weights' mean is below 1);
* `psis_unreliable`: a step whose k̂ exceeds min(1 − 1/log10 S, 0.7).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from pgdiag.report.findings import Finding

if TYPE_CHECKING:
    from pgdiag.report.report import Report

SIGNAL_MIN = 0.8
ONE_SIGN_MIN_LOSS = 0.05
ONE_SIGN_SHARE = 0.25


def _pct(value: float) -> str:
    return f"{100 * value:.3g}%"


def whatif_signal_findings(report: Report) -> list[Finding]:
    """Findings of the signal and weight metrics of a whatif report (none when the metrics are absent)."""

    rows = report.summary.filter(pl.col("breakdown") == "threshold")
    values = {(b, m): v for b, m, v in rows.select("bucket", "metric", "value").iter_rows()}
    rules = [b for b in rows["bucket"].unique(maintain_order=True).to_list() if b != "none"]
    found: list[Finding] = []
    for rule in rules:
        kept = values.get((rule, "whatif/signal_kept"))
        if kept is not None and kept < SIGNAL_MIN:
            message = f"{rule} keeps {_pct(kept)} of the signal Σ|A|"
            found.append(Finding("signal_low", "whatif/signal_kept", None, kept, SIGNAL_MIN, message))
        pos, neg = values.get((rule, "whatif/signal_kept_pos")), values.get((rule, "whatif/signal_kept_neg"))
        if pos is None or neg is None:
            continue
        lost = {"A > 0": 1.0 - pos, "A < 0": 1.0 - neg}
        side = max(lost, key=lambda k: lost[k])
        other = lost["A < 0" if side == "A > 0" else "A > 0"]
        if lost[side] >= ONE_SIGN_MIN_LOSS and other < ONE_SIGN_SHARE * lost[side]:
            message = f"{rule} drops mostly {side} ({_pct(lost[side])} of its signal vs {_pct(other)})"
            found.append(
                Finding("one_sign", "whatif/signal_kept", None, lost[side], ONE_SIGN_MIN_LOSS, message)
            )
    if values.get(("none", "whatif/length_collapse")) == 1.0:
        median = values.get(("none", "whatif/seq_weight_sum_median"))
        message = (
            f"length collapse: median sequence weight exp(ΣΔ) {median:.3g} while the token ratio is within 1 ± 1%"
            " (use exp(mean Δ), e.g. seq_mean_is)"
        )
        found.append(Finding("length_collapse", "whatif/length_collapse", None, median, 0.5, message))
    chi2 = values.get(("none", "whatif/chi2_seq"))
    if chi2 is not None and chi2 < 0:
        mean = values.get(("none", "whatif/seq_weight_mean"))
        message = (
            f"chi2_seq {chi2:.3g} < 0: the sequence weights average {mean:.3g} < 1, so E[w²] − 1 can be negative;"
            f" normalised chi2 {values.get(('none', 'whatif/chi2_seq_normalised')) or 0:.3g}"
        )
        found.append(Finding("chi2_negative", "whatif/chi2_seq", None, chi2, 0.0, message))
    found += _psis_findings(report)
    return found


def _psis_findings(report: Report) -> list[Finding]:

    steps = report.summary.filter(pl.col("breakdown") == "psis/step")
    per_step: dict[str, dict[str, float | None]] = {}
    for bucket, metric, value in steps.select("bucket", "metric", "value").iter_rows():
        per_step.setdefault(bucket, {})[metric] = value
    bad = [
        (step, m["whatif/psis_khat_seq"], m["whatif/psis_khat_threshold"])
        for step, m in per_step.items()
        if m.get("whatif/psis_khat_seq") is not None
        and m.get("whatif/psis_khat_threshold") is not None
        and m["whatif/psis_khat_seq"] > m["whatif/psis_khat_threshold"]  # type: ignore[operator]
    ]
    if not bad:
        return []
    step, khat, limit = max(bad, key=lambda item: item[1])
    message = (
        f"sequence IS unreliable at {len(bad)} of {len(per_step)} steps (PSIS k̂ {khat:.3g} > {limit:.3g} "
        f"at step {step})"
    )
    return [Finding("psis_unreliable", "whatif/psis_khat_seq", step, khat, limit, message)]
