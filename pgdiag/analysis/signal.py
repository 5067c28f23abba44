"""What a correction rule leaves of the gradient, and honest weights (docs/whatif.md, "Signal" and "Weights").

Per rule (`rule_signal`): the share of Σ|A| still in the loss, split by the sign of A, and the ratio Σ|g_t| / Σ|A_t|
of the rule's per-token gradient coefficients (`RuleEffect.grad`, or −A·w on kept tokens) to vanilla policy
gradient's; the raw weights (before truncation or masking) beside the applied ones.

Per batch (`batch_weights`): nonfinite log ratios, tokens beyond each framework's log-ratio clamp, exp(ΣΔ) beside
exp(mean Δ) per sequence, the `length_collapse` flag, verl's chi2 with its normalised form, and PSIS k̂ per step
(`step_psis`): of the sequence weights exp(ΣΔ) (the estimate), and as labelled heuristics of the geometric-mean
sequence weights and of the token weights (neither is a set of i.i.d. importance weights).
"""

from __future__ import annotations

import numpy as np

from pgdiag.analysis.psis import khat_threshold, min_sample_size, psis_khat
from pgdiag.analysis.rules import RuleEffect
from pgdiag.data.batch import TokenBatch
from pgdiag.report.report import ReportRow

CLAMPS = (("20", 20.0), ("10", 10.0))  # verl / AReaL / SkyRL clamp Δ to ±20; miles ±10
LENGTH_COLLAPSE_MEDIAN = 0.5
LENGTH_COLLAPSE_TOKEN_BAND = 0.01


def _ratio(top: float, bottom: float) -> float | None:
    return top / bottom if bottom > 0 else None


def rule_signal(effect: RuleEffect, advantages: np.ndarray | None) -> dict[str, float | None]:
    """`whatif/signal_kept{,_pos,_neg}`, `whatif/grad_coef_ratio` (None without advantages or when Σ|A| = 0)
    and the raw/applied weight means of one rule."""
    applied = np.where(effect.keep, effect.weight, 0.0)
    raw = effect.raw if effect.raw is not None else np.ones(applied.shape[0])
    out: dict[str, float | None] = {
        "whatif/weight_applied_mean": float(np.mean(applied)) if applied.shape[0] else None,
        "whatif/weight_raw_mean": float(np.mean(raw)) if raw.shape[0] else None,
        "whatif/weight_raw_max": float(np.max(raw)) if raw.shape[0] else None,
    }
    if advantages is None:
        return out
    a = np.abs(advantages)
    live = effect.keep & (effect.weight != 0)
    grad = effect.grad if effect.grad is not None else -advantages * applied
    total = float(a.sum())
    pos, neg = advantages > 0, advantages < 0
    out["whatif/signal_kept"] = _ratio(float(a[live].sum()), total)
    out["whatif/signal_kept_pos"] = _ratio(float(a[live & pos].sum()), float(a[pos].sum()))
    out["whatif/signal_kept_neg"] = _ratio(float(a[live & neg].sum()), float(a[neg].sum()))
    out["whatif/grad_coef_ratio"] = _ratio(float(np.abs(grad).sum()), total)
    return out


def zero_advantage_groups(advantages: np.ndarray, group_of_token: np.ndarray, n_groups: int) -> int:
    """Groups whose loss tokens all have A = 0 (all-equal rewards): they carry no signal under any rule."""
    total = np.bincount(group_of_token, weights=np.abs(advantages), minlength=n_groups)
    present = np.bincount(group_of_token, minlength=n_groups) > 0
    return int(np.sum(present & (total == 0)))


def batch_weights(log_ratio: np.ndarray, offsets: np.ndarray) -> dict[str, float | None]:
    """Honest weights of the uncorrected batch: see the module docstring. `log_ratio` (M,), `offsets` (S + 1,)."""
    finite = np.isfinite(log_ratio)
    d = np.where(finite, log_ratio, 0.0)
    counts = np.diff(offsets)
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    seq_sum = np.bincount(owner, weights=d, minlength=counts.shape[0])[counts > 0]  # (S',)
    seq_mean = seq_sum / counts[counts > 0]
    out: dict[str, float | None] = {"whatif/nonfinite_log_ratio": float(np.sum(~finite))}
    for name, bound in CLAMPS:
        out[f"whatif/log_ratio_beyond_{name}"] = float(np.sum(np.abs(d) > bound))
    if seq_sum.shape[0] == 0:
        return out
    w_sum = np.exp(np.clip(seq_sum, -20.0, 20.0))
    w_mean = np.exp(seq_mean)
    token_ratio = float(np.mean(np.exp(np.clip(d, -20.0, 20.0))))
    median_sum = float(np.median(w_sum))
    out["whatif/seq_weight_sum_median"] = median_sum  # exp(ΣΔ), verl's sequence IS
    out["whatif/seq_weight_mean_median"] = float(np.median(w_mean))  # exp(mean Δ), NeMo-RL sequence_mean
    out["whatif/token_ratio_mean"] = token_ratio
    collapse = median_sum < LENGTH_COLLAPSE_MEDIAN and abs(token_ratio - 1.0) <= LENGTH_COLLAPSE_TOKEN_BAND
    out["whatif/length_collapse"] = 1.0 if collapse else 0.0
    # verl's chi2_seq = E[exp(2·clamp(ΣΔ))] − 1 (over all sequences) is negative whenever the batch's weights
    # have second moment below 1, e.g. a mean weight below 1; the normalised form E[w²]/E[w]² − 1 is >= 0.
    all_sum = np.clip(np.bincount(owner, weights=d, minlength=counts.shape[0]), -20.0, 20.0)
    out["whatif/chi2_seq"] = float(np.mean(np.exp(2.0 * all_sum)) - 1.0)
    w_all = np.exp(all_sum)
    out["whatif/seq_weight_mean"] = float(np.mean(w_all))
    out["whatif/chi2_seq_normalised"] = float(np.mean(w_all**2) / np.mean(w_all) ** 2 - 1.0)
    return out


def step_psis(log_ratio: np.ndarray, offsets: np.ndarray) -> dict[str, float | None]:
    """PSIS k̂ of one step: sequence weights exp(ΣΔ), and the heuristics exp(mean Δ) and token e^Δ; with the
    sample-size threshold min(1 − 1/log10 S, 0.7) and the minimum sample size 10^(1/(1 − k̂))."""
    counts = np.diff(offsets)
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    nonempty = counts > 0
    seq_sum = np.bincount(owner, weights=log_ratio, minlength=counts.shape[0])[nonempty]
    k_seq = psis_khat(seq_sum)
    return {
        "whatif/psis_khat_seq": k_seq,
        "whatif/psis_khat_threshold": khat_threshold(int(seq_sum.shape[0])),
        "whatif/psis_min_sample_size": min_sample_size(k_seq),
        "whatif/psis_khat_seq_geo": psis_khat(seq_sum / counts[nonempty]),  # heuristic
        "whatif/psis_khat_token": psis_khat(log_ratio),  # heuristic
        "whatif/psis_sequences": float(seq_sum.shape[0]),
    }


def psis_rows(batch: TokenBatch, log_ratio: np.ndarray, pair: str) -> list[ReportRow]:
    """PSIS k̂ per step (breakdown `psis/step`), never pooled, and its max and median over steps (bucket none)."""
    rows: list[ReportRow] = []
    per_step: list[float] = []
    tok_sample = batch.token_sample()
    for step in np.unique(batch.step):
        samples = np.flatnonzero(batch.step == step)
        tok = np.isin(tok_sample, samples)
        offsets = np.concatenate([[0], np.cumsum(batch.n_loss[samples])])
        values = step_psis(log_ratio[tok], offsets)
        if values["whatif/psis_khat_seq"] is not None:
            per_step.append(values["whatif/psis_khat_seq"])
        for metric, value in values.items():
            rows.append(
                ReportRow(
                    pair,
                    "seq",
                    "psis/step",
                    str(int(step)),
                    metric,
                    value,
                    "index",
                    "seq",
                    len(samples),
                    float(step),
                    float(step),
                )
            )
    summary = {
        "whatif/psis_khat_seq_max": max(per_step) if per_step else None,
        "whatif/psis_khat_seq_median": float(np.median(per_step)) if per_step else None,
    }
    for metric, value in summary.items():
        rows.append(
            ReportRow(
                pair,
                "token",
                "threshold",
                "none",
                metric,
                value,
                "index",
                "max" if metric.endswith("max") else "median",
                len(per_step),
            )
        )
    return rows
