"""Advantage, entropy, group and count metrics of docs/metrics.md.

Why: a policy-gradient step is only as informative as its advantages. GRPO-style advantages are centred per
prompt group, so Σ_{i∈g} Ā_i ≈ 0 (`advantage/group_seq_sum_absmax`); under token weighting what the update
actually pushes is Σ_{i∈g} Σ_t A, which is not 0 when lengths differ (`group_token_sum_absmax`). Groups
whose rewards all agree carry no signal (`group_zero_std_frac`). The counts make every exclusion visible:
nothing is dropped silently.

How: a token phase (`build_*_tables`, once per batch) turns the valid-token arrays (N,) into per-sample
sums; the reduce phase (`add_*`) works on the rows of one step, with per-sample group codes (S,)
compacted to 0..P−1, and writes into a `MetricSink`.

Worked example: g1 = {s1: A = +1 over 3 tokens, s2: A = −1 over 4}, g2 = {s3: +0.5 over 3, s4: −0.5
over 3}: Σ Ā_i is 0 in both groups, Σ_t A is −1 in g1 and 0 in g2, so group_token_sum_absmax = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.pooled import QuantileSummary, extremum_of, quantiles_of
from pgdiag.metrics.reduce import SAMPLE_AXIS, TOKEN_AXIS, TokenReducer, extremum


@dataclass(frozen=True)
class AdvantageTables:
    """Per-sample sums (S,) of the advantage quantities on the valid tokens m'."""

    reducer: TokenReducer
    sum_adv: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t A
    sum_abs: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t |A|
    m2_adv: np.ndarray = field(metadata=SAMPLE_AXIS)  # Σ_t (A − Ā_i)²
    n_pos: np.ndarray = field(metadata=SAMPLE_AXIS)
    n_neg: np.ndarray = field(metadata=SAMPLE_AXIS)
    n_zero: np.ndarray = field(metadata=SAMPLE_AXIS)
    min_adv: np.ndarray = field(metadata=SAMPLE_AXIS)  # NaN for empty samples
    max_adv: np.ndarray = field(metadata=SAMPLE_AXIS)


def build_advantage_tables(advantages: np.ndarray, reducer: TokenReducer) -> AdvantageTables:
    """Token phase of `advantage/*` over the valid tokens (N,) of `reducer`.

    When every sample has a single advantage value (a per-sequence advantage broadcast over its tokens,
    the common case) the sums follow from A_i and N_i without further token passes.
    """
    min_adv, max_adv = reducer.sample_min(advantages), reducer.sample_max(advantages)  # (S,)
    ne = reducer.nonempty
    n_i = reducer.n_per_sample.astype(np.float64)
    if np.all(min_adv[ne] == max_adv[ne]):
        adv = np.where(ne, max_adv, 0.0)  # (S,) A_i
        return AdvantageTables(
            reducer=reducer,
            sum_adv=adv * n_i,
            sum_abs=np.abs(adv) * n_i,
            m2_adv=np.zeros_like(n_i),
            n_pos=np.where(adv > 0, n_i, 0.0),
            n_neg=np.where(adv < 0, n_i, 0.0),
            n_zero=np.where(ne & (adv == 0), n_i, 0.0),
            min_adv=min_adv,
            max_adv=max_adv,
        )
    sums = reducer.sample_sums
    sum_adv = sums(advantages)
    scratch = np.empty_like(advantages)  # float64 copy of each indicator while it is counted
    return AdvantageTables(
        reducer=reducer,
        sum_adv=sum_adv,
        sum_abs=sums(np.abs(advantages)),
        m2_adv=reducer.centred_m2(advantages, sum_adv),
        n_pos=sums(advantages > 0, scratch),
        n_neg=sums(advantages < 0, scratch),
        n_zero=sums(advantages == 0, scratch),
        min_adv=min_adv,
        max_adv=max_adv,
    )


def add_advantage_metrics(t: AdvantageTables, sink: MetricSink) -> None:
    """`advantage/mean`, `abs_mean`, `std`, `min`, `max`, `frac_pos/neg/zero` and `count/adv_nonconstant_samples`."""
    red = t.reducer
    n_tok, n_red = red.n_tokens, red.population
    ne = red.nonempty
    sink.add("advantage/mean", red.mean_of_sums(t.sum_adv), n_red)
    sink.add("advantage/abs_mean", red.mean_of_sums(t.sum_abs), n_red)
    sink.add("advantage/std", red.spread_of_moments(t.sum_adv, t.m2_adv), n_red)
    sink.add("advantage/min", extremum(t.min_adv[ne], "min"), n_tok)
    sink.add("advantage/max", extremum(t.max_adv[ne], "max"), n_tok)
    sink.add("advantage/frac_pos", red.mean_of_sums(t.n_pos), n_red)
    sink.add("advantage/frac_neg", red.mean_of_sums(t.n_neg), n_red)
    sink.add("advantage/frac_zero", red.mean_of_sums(t.n_zero), n_red)
    varying = t.max_adv[ne] != t.min_adv[ne]  # (S+,)
    sink.add("count/adv_nonconstant_samples", np.count_nonzero(varying), red.n_nonempty)


def add_group_metrics(
    sum_adv: np.ndarray | None,
    reward: np.ndarray | None,
    reducer: TokenReducer,
    group_of_sample: np.ndarray,
    n_groups: int,
    zero_std_atol: float,
    sink: MetricSink,
) -> None:
    """`advantage/group_*` and `grad/group_token_share_*` over the P groups of the step.

    `sum_adv` (S,) holds Σ_t A per sample (None without advantages). The zero-std test uses the per-sample
    reward when `reward` (S,) has any non-null value (null rewards are left out), else Ā_i of the samples
    with valid tokens; groups with fewer than two values are not tested.
    """
    red = reducer
    n_i = red.n_per_sample
    n_tokens = red.n_tokens
    if n_groups and n_tokens:
        shares = np.bincount(group_of_sample, weights=n_i, minlength=n_groups) / n_tokens  # (P,)
        sink.add("grad/group_token_share_max", float(np.max(shares)), n_groups)
        sink.add("grad/group_token_share_min", float(np.min(shares)), n_groups)
    else:
        sink.add("grad/group_token_share_max", None, n_groups)
        sink.add("grad/group_token_share_min", None, n_groups)
    mean_adv = None
    if sum_adv is not None and n_tokens == 0:
        sink.add("advantage/group_seq_sum_absmax", None, n_groups)
        sink.add("advantage/group_token_sum_absmax", None, n_groups)
    elif sum_adv is not None:
        ne = red.nonempty
        adv_sums = sum_adv  # (S,) Σ_t A
        mean_adv = adv_sums[ne] / n_i[ne]  # (S+,) Ā_i
        seq_sums = np.bincount(group_of_sample[ne], weights=mean_adv, minlength=n_groups)  # (P,)
        token_sums = np.bincount(group_of_sample, weights=adv_sums, minlength=n_groups)  # (P,)
        sink.add("advantage/group_seq_sum_absmax", extremum(np.abs(seq_sums), "max"), n_groups)
        sink.add("advantage/group_token_sum_absmax", extremum(np.abs(token_sums), "max"), n_groups)
    known = None if reward is None else ~np.isnan(reward)
    if known is not None and known.any():
        values, groups = reward[known], group_of_sample[known]
    elif mean_adv is not None:
        values, groups = mean_adv, group_of_sample[red.nonempty]
    else:
        return
    sink.add(*_zero_std_fraction(values, groups, n_groups, zero_std_atol))


def _zero_std_fraction(
    values: np.ndarray, groups: np.ndarray, n_groups: int, atol: float
) -> tuple[str, float | None, int]:
    """(key, fraction of tested groups whose population std of `values` is ≤ atol, groups tested)."""
    counts = np.bincount(groups, minlength=n_groups)  # (P,)
    means = np.bincount(groups, weights=values, minlength=n_groups) / np.maximum(counts, 1)
    dev = values - means[groups]
    with np.errstate(invalid="ignore"):
        std = np.sqrt(np.bincount(groups, weights=dev * dev, minlength=n_groups) / np.maximum(counts, 1))
    tested = counts >= 2
    n_tested = int(np.count_nonzero(tested))
    value = None if n_tested == 0 else np.count_nonzero(std[tested] <= atol) / n_tested
    return "advantage/group_zero_std_frac", value, n_tested


@dataclass(frozen=True)
class EntropyTables:
    """Entropies (N_H,) of the tokens valid for the policy family with a finite H, and their sums (S,)."""

    reducer: TokenReducer
    entropy: np.ndarray | QuantileSummary = field(metadata=TOKEN_AXIS)
    sum_entropy: np.ndarray = field(metadata=SAMPLE_AXIS)


def build_entropy_tables(entropy: np.ndarray, reducer: TokenReducer) -> EntropyTables:
    """Token phase of `entropy/*`; `entropy` (N,) holds the valid tokens of `reducer`, non-finite left out."""
    finite = np.isfinite(entropy)
    if not finite.all():
        reducer, entropy = reducer.subset(finite), entropy[finite]
    return EntropyTables(reducer, entropy, reducer.sample_sums(entropy))


def add_entropy_metrics(t: EntropyTables, sink: MetricSink) -> None:
    """`entropy/mean` (R) and its token quantiles and extrema."""
    n_tok = t.reducer.n_tokens
    sink.add("entropy/mean", t.reducer.mean_of_sums(t.sum_entropy), t.reducer.population)
    p5, p50, p95 = quantiles_of(t.entropy, (0.05, 0.5, 0.95))
    sink.add("entropy/p5", p5, n_tok)
    sink.add("entropy/p50", p50, n_tok)
    sink.add("entropy/p95", p95, n_tok)
    sink.add("entropy/min", extremum_of(t.entropy, "min"), n_tok)
    sink.add("entropy/max", extremum_of(t.entropy, "max"), n_tok)


def add_counts(
    n_positions: int,
    reducer: TokenReducer,
    group_of_sample: np.ndarray,
    n_groups: int,
    groups_split: int,
    sink: MetricSink,
) -> None:
    """The `count/*` keys of the step that do not belong to one family."""
    n_tokens = reducer.n_tokens
    n_samples = int(reducer.n_per_sample.shape[0])
    members = np.bincount(group_of_sample, minlength=n_groups)
    sink.add("count/tokens", n_tokens, n_positions)
    sink.add("count/tokens_masked", n_positions, n_positions)
    sink.add("count/tokens_invalid", n_positions - n_tokens, n_positions)
    sink.add("count/samples", n_samples, n_samples)
    sink.add("count/samples_empty", n_samples - reducer.n_nonempty, n_samples)
    sink.add("count/docs", reducer.n_docs, n_samples)
    sink.add("count/groups", n_groups, n_samples)
    sink.add("count/groups_singleton", int(np.count_nonzero(members == 1)), n_groups)
    sink.add("count/groups_split", groups_split, n_groups)


def finite_fraction_notice(name: str, n_left_out: int, n_total: int) -> str:
    """Notice text for tokens a family left out for a non-finite input."""
    share = 100.0 * n_left_out / n_total if n_total else math.nan
    return f"{name}: {n_left_out} of {n_total} loss positions left out (non-finite input, {share:.3g} %)"
