"""What a correction rule leaves of the gradient, and honest weights (docs/whatif.md, "Signal" and "Weights").

Per rule (`signal_sums` over each piece, `signal_metrics` at the end): the share of Σ|A| still in the loss,
split by the sign of A, and the ratio Σ|g_t| / Σ|A_t| of the rule's per-token gradient coefficients
(`RuleEffect.grad`, or −A·w on kept tokens) to vanilla policy gradient's; the raw weights (before truncation or
masking) beside the applied ones.

Per batch (`BatchWeights`, over the pieces): nonfinite log ratios, tokens beyond each framework's log-ratio clamp,
exp(ΣΔ) beside exp(mean Δ) per sequence, the `length_collapse` flag, verl's chi2 with its normalised form, and
PSIS k̂ per step (`step_psis`): of the sequence weights exp(ΣΔ) (the estimate), and as labelled heuristics of the
geometric-mean sequence weights and of the token weights (neither is a set of i.i.d. importance weights).
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


SIGNAL_SUMS = 11  # the length of `signal_sums`


def signal_sums(effect: RuleEffect, advantages: np.ndarray | None) -> np.ndarray:
    """(11,) the sums `signal_metrics` divides, over one piece's tokens: tokens, Σ applied weight, Σ raw weight,
    max raw weight, Σ|A| (all, kept, A > 0, kept A > 0, A < 0, kept A < 0) and Σ|g|. Sums of pieces add (the max:
    `add_signal_sums`)."""
    applied = np.where(effect.keep, effect.weight, 0.0)
    n = applied.shape[0]
    raw = effect.raw if effect.raw is not None else np.ones(n)
    out = np.zeros(SIGNAL_SUMS)
    out[0] = n
    if n:
        out[1:4] = float(np.sum(applied)), float(np.sum(raw)), float(np.max(raw))
    else:
        out[3] = -np.inf
    if advantages is None:
        return out
    a = np.abs(advantages)
    live = effect.keep & (effect.weight != 0)
    grad = effect.grad if effect.grad is not None else -advantages * applied
    pos, neg = advantages > 0, advantages < 0
    out[4:10] = (
        float(a.sum()),
        float(a[live].sum()),
        float(a[pos].sum()),
        float(a[live & pos].sum()),
        float(a[neg].sum()),
        float(a[live & neg].sum()),
    )
    out[10] = float(np.abs(grad).sum())
    return out


def add_signal_sums(total: np.ndarray | None, piece: np.ndarray) -> np.ndarray:
    """The `signal_sums` of two pieces together."""
    if total is None:
        return piece
    out = total + piece
    out[3] = max(total[3], piece[3])
    return out


def signal_metrics(sums: np.ndarray, has_advantages: bool) -> dict[str, float | None]:
    """`whatif/signal_kept{,_pos,_neg}`, `whatif/grad_coef_ratio` (None without advantages or when Σ|A| = 0)
    and the raw/applied weight means of one rule, from its `signal_sums` over every piece."""
    n = int(sums[0])
    out: dict[str, float | None] = {
        "whatif/weight_applied_mean": float(sums[1]) / n if n else None,
        "whatif/weight_raw_mean": float(sums[2]) / n if n else None,
        "whatif/weight_raw_max": float(sums[3]) if n else None,
    }
    if not has_advantages:
        return out
    out["whatif/signal_kept"] = _ratio(float(sums[5]), float(sums[4]))
    out["whatif/signal_kept_pos"] = _ratio(float(sums[7]), float(sums[6]))
    out["whatif/signal_kept_neg"] = _ratio(float(sums[9]), float(sums[8]))
    out["whatif/grad_coef_ratio"] = _ratio(float(sums[10]), float(sums[4]))
    return out


class BatchWeights:
    """Honest weights of the uncorrected batch over its pieces (the module docstring): counts and sums add, and
    the medians of the sequence weights are exact from the per-sequence values (two floats a sequence)."""

    def __init__(self) -> None:
        self.counts = np.zeros(1 + len(CLAMPS))  # nonfinite, beyond each clamp
        self.sums = np.zeros(6)  # tokens, Σ token ratio, samples, Σ exp(2·ΣΔ), Σ w, Σ w²
        self.w_sum: list[np.ndarray] = []  # (S',) exp(clamp ΣΔ) of the non-empty sequences, per piece
        self.w_mean: list[np.ndarray] = []  # (S',) exp(mean Δ)

    def add(self, log_ratio: np.ndarray, offsets: np.ndarray) -> None:
        """One piece: `log_ratio` (M,), `offsets` (S + 1,)."""
        finite = np.isfinite(log_ratio)
        d = np.where(finite, log_ratio, 0.0)
        counts = np.diff(offsets)
        owner = np.repeat(np.arange(counts.shape[0]), counts)
        self.counts[0] += float(np.sum(~finite))
        for i, (_, bound) in enumerate(CLAMPS):
            self.counts[1 + i] += float(np.sum(np.abs(d) > bound))
        seq_sum = np.bincount(owner, weights=d, minlength=counts.shape[0])  # (S,)
        filled = seq_sum[counts > 0]
        self.w_sum.append(np.exp(np.clip(filled, -20.0, 20.0)))
        self.w_mean.append(np.exp(filled / counts[counts > 0]))
        # verl's chi2_seq = E[exp(2·clamp(ΣΔ))] − 1 (over all sequences) is negative whenever the batch's weights
        # have second moment below 1, e.g. a mean weight below 1; the normalised form E[w²]/E[w]² − 1 is >= 0.
        all_sum = np.clip(seq_sum, -20.0, 20.0)
        w_all = np.exp(all_sum)
        self.sums += (
            d.shape[0],
            float(np.sum(np.exp(np.clip(d, -20.0, 20.0)))),
            counts.shape[0],
            float(np.sum(np.exp(2.0 * all_sum))),
            float(np.sum(w_all)),
            float(np.sum(w_all**2)),
        )

    def metrics(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"whatif/nonfinite_log_ratio": float(self.counts[0])}
        for i, (name, _) in enumerate(CLAMPS):
            out[f"whatif/log_ratio_beyond_{name}"] = float(self.counts[1 + i])
        w_sum = np.concatenate(self.w_sum) if self.w_sum else np.zeros(0)
        if w_sum.shape[0] == 0:
            return out
        n_tok, ratio_sum, n_seq, chi2_sum, w1, w2 = (float(x) for x in self.sums)
        token_ratio = ratio_sum / n_tok
        median_sum = float(np.median(w_sum))
        out["whatif/seq_weight_sum_median"] = median_sum  # exp(ΣΔ), verl's sequence IS
        out["whatif/seq_weight_mean_median"] = float(np.median(np.concatenate(self.w_mean)))  # NeMo-RL
        out["whatif/token_ratio_mean"] = token_ratio
        collapse = (
            median_sum < LENGTH_COLLAPSE_MEDIAN and abs(token_ratio - 1.0) <= LENGTH_COLLAPSE_TOKEN_BAND
        )
        out["whatif/length_collapse"] = 1.0 if collapse else 0.0
        out["whatif/chi2_seq"] = chi2_sum / n_seq - 1.0
        out["whatif/seq_weight_mean"] = w1 / n_seq
        out["whatif/chi2_seq_normalised"] = (w2 / n_seq) / (w1 / n_seq) ** 2 - 1.0
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


def psis_step_rows(
    batch: TokenBatch, log_ratio: np.ndarray, pair: str
) -> tuple[list[ReportRow], list[float]]:
    """PSIS k̂ of every step of `batch` (breakdown `psis/step`), never pooled, and the fitted k̂ of the sequence
    weights per step (for `psis_summary_rows`)."""
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
    return rows, per_step


def psis_summary_rows(per_step: list[float], pair: str) -> list[ReportRow]:
    """The maximum and median of the steps' k̂ (bucket none)."""
    summary = {
        "whatif/psis_khat_seq_max": max(per_step) if per_step else None,
        "whatif/psis_khat_seq_median": float(np.median(per_step)) if per_step else None,
    }
    return [
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
        for metric, value in summary.items()
    ]
