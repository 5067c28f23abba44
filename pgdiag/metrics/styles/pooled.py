"""The `all` row of a key style from its per-step results alone (docs/key-styles.md, "The `all` row").

What: `pool_style_steps(steps, settings)` turns the `StepMetrics` of every step of a `--key-style` run into
the `all` row, without the pooled batch: every key has one pooling rule (`POOL_RULES`, keyed by style and
key, the same table as docs/key-styles.md) that says how the value the framework would compute on the pooled
tokens follows from the step values.

Why: the `metrics` command reads a run step by step with bounded memory, so the pooled batch never exists.
Each style's reductions are sums over tokens, samples or documents divided by a count under a framework
guard, so the pooled value is recovered from the step value and its count: a `mean_guard` value x_s over
N_s tokens has numerator x_s·N_s, a `mean_eps` value has x_s·(N_s + 1e-8), and a fraction of an integer
count recovers that count exactly by rounding (bit-identical to the pooled computation). Loss keys (``mode``)
are the unweighted mean over steps, as before. A Pearson correlation (verl's probability correlation) needs
five partial sums per step, which `compute_step_style(..., partials=True)` adds as values of reduction
``partial`` (`step_partials`; `public_values` strips them from a step row). Statistics over whole prompt
groups cannot be pooled once a group straddles a `--docs-per-step` cut: the `all` row gives null there,
with a notice.

How: `POOL_RULES[style][key]` (`metrics.styles.pool_rules`, the table) is a `PoolRule`: its `kind` (mode, sum,
max, min, mean, std, derived, none) and, for means, the weight of a step (its tokens ``n``, `count/samples` or
`count/docs`), the framework's guard (plain Σ/W, ``max1`` Σ/max(W, 1), ``eps`` Σ/(W + 1e-8)), whether the
numerator is an integer count, an offset (verl's χ² values are mean − 1) and the value of an empty row where a
step with no loss tokens prints none. A key the table does not know gets the rule of its reduction (``mode`` →
mode, ``cnt``/``sum`` → sum), else null with a notice. The status is the pooled tokens' (`empty` when every step
is, `nonfinite` when one is, else `ok`); the notices are the steps' own, each once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.step_metrics import StepMetrics
from pgdiag.metrics.styles.common import div, exp, total
from pgdiag.metrics.styles.common import value as metric_value
from pgdiag.metrics.styles.inputs import StyleInputs
from pgdiag.metrics.styles.pool_rules import (
    EPS,
    MODE,
    NOT_DECOMPOSABLE,
    PARTIAL,
    PEARSON_PARTIALS,
    SUM,
    PoolRule,
    pool_rules,
)
from pgdiag.metrics.values import MetricValue

__all__ = ["pool_style_steps", "public_values", "step_partials"]


def pool_style_steps(steps: Sequence[StepMetrics], settings: MetricSettings) -> StepMetrics:
    """The `all` row of a key-style run from its per-step rows (in step order), without the pooled batch.

    Every key follows its `PoolRule` (`pool_rules(settings)`); the row's status is ``empty`` when every step
    is empty, ``nonfinite`` when a step is, else ``ok`` (the status of the pooled tokens); its notices are
    the steps' notices, each once, plus one per key that could not be pooled.
    """
    rules = pool_rules(settings)
    rows = [s.by_key() for s in steps]
    pooled = _Pool(rows)
    notices: list[str] = []
    for step in steps:
        notices.extend(n for n in step.notices if n not in notices)
    out: dict[str, MetricValue] = {}
    not_pooled: list[str] = []
    straddled: list[str] = []
    derived: list[tuple[str, MetricValue, PoolRule]] = []
    order = _key_order(steps)
    for key in order:
        template = next(row[key] for row in rows if key in row)
        if template.reduction == PARTIAL:
            continue
        rule = rules.get(key) or _fallback_rule(template)
        if rule.kind == "derived":
            derived.append((key, template, rule))
            continue
        if rule.kind == "none":
            not_pooled.append(key)
            out[key] = _value(template, None, pooled.total_n(key))
        elif rule.whole_groups and pooled.groups_straddle():
            straddled.append(key)
            out[key] = _value(template, None, pooled.total_n(key))
        else:
            value, n = pooled.pool(key, rule)
            out[key] = _value(template, value, n)
    for key, template, rule in derived:
        if rule.source == "verl_pearson" and not pooled.has_partials(PEARSON_PARTIALS):
            not_pooled.append(key)
            out[key] = _value(template, None, pooled.total_n(key))
            continue
        value, n = _derive(rule.source, out, pooled)
        out[key] = _value(template, value, n)
    if not_pooled:
        notices.append(
            f"all row: {', '.join(not_pooled)} is null: it cannot be pooled from per-step values "
            "(docs/key-styles.md); see the step rows"
        )
    if straddled:
        notices.append(
            f"all row: {', '.join(straddled)} null: prompt groups straddle --docs-per-step cuts, and a "
            "group split over steps cannot be pooled from per-step values (docs/key-styles.md)"
        )
    ordered = tuple(out[key] for key in order if key in out)
    return StepMetrics(ordered, _pooled_status(steps), tuple(notices))


class _Pool:
    """The per-step values of a run, indexed by key, with the step counts the rules weigh by."""

    def __init__(self, rows: list[dict[str, MetricValue]]) -> None:
        self.rows = rows

    def count(self, row: dict[str, MetricValue], key: str) -> int:
        """A native `count/*` value of one step (0 when absent)."""
        found = row.get(key)
        return 0 if found is None or found.value is None else int(found.value)

    def groups_straddle(self) -> bool:
        """Whether a prompt group straddles a step (only under --docs-per-step)."""
        return any(self.count(row, "count/groups_split") > 0 for row in self.rows)

    def has_partials(self, keys: tuple[str, ...]) -> bool:
        """Whether every step with loss tokens carries the partial values `keys` (`step_partials`)."""
        return all(
            all(k in row for k in keys) for row in self.rows if self.count(row, "count/tokens_masked") > 0
        )

    def total_n(self, key: str) -> int:
        return sum(row[key].n for row in self.rows if key in row)

    def weight(self, row: dict[str, MetricValue], key: str, rule: PoolRule) -> int:
        """A step's weight under `rule`: the value's n, its samples or its documents."""
        if rule.weight == "samples":
            return self.count(row, "count/samples")
        if rule.weight == "docs":
            return self.count(row, "count/docs")
        return row[key].n if key in row else 0

    def pool(self, key: str, rule: PoolRule) -> tuple[float | None, int]:
        """The pooled value and n of `key` under a mode, sum, extremum, mean or std rule."""
        if rule.kind == "mode":
            return _mode_mean([row[key].value for row in self.rows if key in row])
        if rule.kind == "std":
            return self._std(key, rule.source)
        real: list[tuple[float | None, int, int]] = []  # (value, weight, n) of the steps that have one
        filled: list[int] = []  # weights of the steps without loss tokens whose rows add `rule.empty`
        for row in self.rows:
            no_tokens = self.count(row, "count/tokens_masked") == 0
            found = row.get(key)
            if found is not None and not (found.value is None and no_tokens):
                real.append((found.value, self.weight(row, key, rule), found.n))
            elif no_tokens and rule.empty is not None:
                filled.append(self.weight(row, key, rule))
        if not real:
            return None, sum(row[key].n for row in self.rows if key in row)
        n = sum(n for _, _, n in real) + sum(filled)
        if any(v is None for v, _, _ in real):  # a step with tokens gave NaN: so does the pooled set
            return None, n
        values = [float(v) for v, _, _ in real if v is not None]
        if rule.kind == "sum":
            return _sum(values), n
        if rule.kind in ("max", "min"):
            pick = max if rule.kind == "max" else min
            candidates = values + ([rule.empty] if filled and rule.empty is not None else [])
            return _extremum(candidates, pick), n
        return self._mean(rule, real, filled), n

    def _mean(
        self, rule: PoolRule, real: list[tuple[float | None, int, int]], filled: list[int]
    ) -> float | None:
        """Σ_s numerator_s / guard(Σ_s W_s), numerators recovered from the step values."""
        numerators: list[float] = []
        for value, weight, _ in real:
            assert value is not None
            scale = weight + EPS if rule.guard == "eps" else weight
            numerator = (value + rule.offset) * scale
            if rule.integer and math.isfinite(numerator):
                numerator = float(round(numerator))
            numerators.append(numerator)
        if filled and rule.empty is not None:
            numerators += [(rule.empty + rule.offset) * w for w in filled]
        total_weight = sum(w for _, w, _ in real) + sum(filled)
        if rule.guard == "eps":
            denominator = total_weight + EPS
        elif rule.guard == "max1":
            denominator = max(total_weight, 1)
        else:
            denominator = total_weight
        mean = div(_sum(numerators), denominator)
        return None if math.isnan(mean) else mean - rule.offset

    def _std(self, key: str, mean_key: str) -> tuple[float | None, int]:
        """The sample std (ddof 1) of the pooled tokens from each step's n, mean and std (Chan et al.)."""
        parts: list[tuple[int, float, float]] = []  # (n, mean, M2)
        for row in self.rows:
            if mean_key not in row or row[mean_key].n == 0:
                continue
            n, mean = row[mean_key].n, row[mean_key].value
            std = row[key].value if key in row else None
            if mean is None or not math.isfinite(mean) or (n > 1 and std is None):
                return None, self.total_n(key)
            parts.append((n, mean, 0.0 if n == 1 else float(std) ** 2 * (n - 1)))
        n_total = sum(n for n, _, _ in parts)
        if n_total <= 1:
            return None, self.total_n(key)
        grand = math.fsum(n * m for n, m, _ in parts) / n_total
        m2 = math.fsum(m2 + n * (m - grand) ** 2 for n, m, m2 in parts)
        return math.sqrt(m2 / (n_total - 1)), self.total_n(key)


def _derive(source: str, out: dict[str, MetricValue], pooled: _Pool) -> tuple[float | None, int]:
    """A key computed from other pooled keys (and, for verl's IS weights, the steps' E[w²])."""
    if source == "pipelinerl_ess":  # ESS = (Σ r)² / Σ r² / N
        total, squares, tokens = (
            out[k].value
            for k in ("rl/ratio_new_old_sum", "rl/ratio_new_old_squared_sum", "rl/num_output_tokens_sum")
        )
        if total is None or squares is None or tokens is None:
            return None, int(tokens or 0)
        return div(div(total**2, squares), tokens), int(tokens)
    if source in ("verl_is_std", "verl_is_ess"):
        return _verl_is(source, out, pooled)
    if source == "verl_pearson":
        return _verl_pearson(pooled)
    raise ValueError(f"unknown derivation {source!r}")


def _verl_is(source: str, out: dict[str, MetricValue], pooled: _Pool) -> tuple[float | None, int]:
    """verl's IS weight std √(E[w²] − E[w]²) and ESS 1 / E[(w / (E[w] + 1e-8))²] of the pooled tokens.

    A step's E_s[w²] follows from its ESS and mean: ESS_s = (E_s[w] + 1e-8)² / E_s[w²] (both masked means
    with the 1e-8 guard), so Σ w² = E_s[w²]·(N_s + 1e-8) is exact up to rounding.
    """
    mean_key, ess_key = "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"
    n_total = out[mean_key].n
    w_mean = out[mean_key].value
    squares: list[float] = []
    for row in pooled.rows:
        if mean_key not in row or row[mean_key].n == 0:
            continue
        mean, ess = row[mean_key].value, row[ess_key].value
        if mean is None or ess is None:
            return None, n_total
        squares.append((mean + EPS) ** 2 / ess * (row[mean_key].n + EPS))
    if w_mean is None:
        return None, n_total
    second = div(_sum(squares), n_total + EPS)  # E[w²] of the pooled tokens
    if source == "verl_is_std":
        return (math.sqrt(max(second - w_mean**2, 0.0)) if n_total > 1 else 0.0), n_total
    return div(1.0, second / (w_mean + EPS) ** 2), n_total


def _verl_pearson(pooled: _Pool) -> tuple[float | None, int]:
    """Pearson correlation of e^lp_b and e^lp_a over the pooled tokens from each step's means and centred
    sums of squares and cross products (`step_partials`), merged as Chan et al. merge variances."""
    parts = []  # (n, mean_b, mean_a, css_b, css_a, csp)
    for row in pooled.rows:
        n = row[PEARSON_PARTIALS[0]].n if PEARSON_PARTIALS[0] in row else 0
        if n == 0:
            continue
        numbers = [row[k].value for k in PEARSON_PARTIALS]
        if any(v is None for v in numbers):
            return None, pooled.total_n("training/rollout_actor_probs_pearson_corr")
        parts.append((n, *(float(v) for v in numbers if v is not None)))
    n_total = sum(p[0] for p in parts)
    if n_total <= 1:
        return None, n_total
    mean_b = _sum([n * mb for n, mb, *_ in parts]) / n_total
    mean_a = _sum([n * ma for n, _, ma, *_ in parts]) / n_total
    css_b = _sum([cb + n * (mb - mean_b) ** 2 for n, mb, _, cb, _, _ in parts])
    css_a = _sum([ca + n * (ma - mean_a) ** 2 for n, _, ma, _, ca, _ in parts])
    csp = _sum([cp + n * (mb - mean_b) * (ma - mean_a) for n, mb, ma, _, _, cp in parts])
    return div(csp, math.sqrt(css_b * css_a)), n_total


def step_partials(inputs: StyleInputs, settings: MetricSettings) -> tuple[MetricValue, ...]:
    """The extra per-step values (reduction ``partial``) a key needs to be pooled exactly: only verl's
    probability correlation, which needs each step's means and centred sums of e^lp_b and e^lp_a."""
    if settings.key_style != "verl" or not inputs.has_pair:
        return ()
    assert inputs.lp_a is not None and inputs.lp_b is not None
    n = inputs.n_tokens
    if n == 0:
        return ()
    p_b, p_a = exp(inputs.lp_b), exp(inputs.lp_a)  # (M,)
    mean_b, mean_a = float(np.mean(p_b)), float(np.mean(p_a))
    cb, ca = p_b - mean_b, p_a - mean_a  # (M,)
    numbers = (mean_b, mean_a, total(cb * cb), total(ca * ca), total(cb * ca))
    return tuple(metric_value(k, v, "1", PARTIAL, n) for k, v in zip(PEARSON_PARTIALS, numbers, strict=True))


def public_values(step: StepMetrics) -> StepMetrics:
    """`step` without its ``partial`` values (what a report shows)."""
    return replace(step, values=tuple(v for v in step.values if v.reduction != PARTIAL))


def _mode_mean(found: list[float | None]) -> tuple[float | None, int]:
    """The unweighted mean over the steps with a value (the loss keys; ±inf propagates, NaN is null)."""
    numbers = [v for v in found if v is not None]
    if not numbers:
        return None, 0
    if all(math.isfinite(v) for v in numbers):
        return math.fsum(numbers) / len(numbers), len(numbers)
    return sum(numbers) / len(numbers), len(numbers)


def _sum(values: list[float]) -> float:
    """Σ values, exactly rounded when finite (fsum), IEEE otherwise (inf − inf is NaN)."""
    if all(math.isfinite(v) for v in values):
        return math.fsum(values)
    return float(sum(values))


def _extremum(values: list[float], pick) -> float | None:
    """max or min of the step extrema; NaN never reaches here (a NaN step value is null)."""
    return pick(values) if values else None


def _value(template: MetricValue, value: float | None, n: int) -> MetricValue:
    return MetricValue(template.key, value, template.unit, template.reduction, int(n))


def _fallback_rule(template: MetricValue) -> PoolRule:
    """A key `POOL_RULES` does not list: its reduction decides (mode → mean over steps, counts → sum)."""
    if template.reduction == "mode":
        return MODE
    if template.reduction in ("cnt", "sum"):
        return SUM
    return NOT_DECOMPOSABLE


def _key_order(steps: Sequence[StepMetrics]) -> list[str]:
    """Every key of any step once, in the style's order (a key a step lacks goes after its predecessor)."""
    order: list[str] = []
    seen: set[str] = set()
    for step in steps:
        previous = None
        for value in step.values:
            if value.key not in seen:
                order.insert(0 if previous is None else order.index(previous) + 1, value.key)
                seen.add(value.key)
            previous = value.key
    return order


def _pooled_status(steps: Sequence[StepMetrics]) -> str:
    """The status of the pooled tokens: empty when every step is, nonfinite when a step is, else ok."""
    if all(s.status == "empty" for s in steps):
        return "empty"
    if any(s.status == "nonfinite" for s in steps):
        return "nonfinite"
    return "ok"
