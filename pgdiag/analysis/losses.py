"""Gradient parity between two loss definitions on one batch (`whatif --losses A,B`, docs/whatif.md).

A loss definition is `FORM@MODE`: FORM is `vanilla` (ℓ_t = −A_t·log π_θ) or any whatif rule (`cispo:0.2,0.28`,
`dppo_tv:0.2,0.2`, `token_tis:2`, ...), MODE an aggregation of docs/metrics.md (`token_mean`, `sample_mean`,
`prompt_mean`, `seq_mean_token_sum`, `token_sum`, `constant` with `--divisor`). On each step (one optimiser batch)
the gradient of the aggregated loss with respect to log π_θ(t) is g_t = c_{i(t)}·f_t: f_t the form's per-token
coefficient (the rule's, with its framework's stop-gradient semantics; −A_t for vanilla), c_i the aggregation
weight of the token's sample, over the tokens the form keeps in its loss mask.

Per step: `losses/rel_l2` = ‖g_A − g_B‖ / ‖g_A‖, split along g_A − g_B = (c_A − c_B)·f_A + c_B·(f_A − f_B) into
`losses/rel_l2_aggregation` = ‖(c_A − c_B)·f_A‖ / ‖g_A‖ and `losses/rel_l2_factor` = ‖c_B·(f_A − f_B)‖ / ‖g_A‖
(the two bound the total by the triangle inequality), and `losses/grad_norm_ratio` = ‖g_B‖ / ‖g_A‖: the grad-norm
gap the loss alone explains.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pgdiag.analysis.rules import PROXIMAL_THETA, Replay, RuleEffect
from pgdiag.analysis.settings import CorrectionRule, LossForm
from pgdiag.data.batch import TokenBatch
from pgdiag.metrics.loss import sample_weights
from pgdiag.report.report import ReportRow

EffectOf = Callable[[CorrectionRule, Replay], RuleEffect]


def token_terms(
    batch: TokenBatch, form: LossForm, replay: Replay, effect_of: EffectOf, divisor: float | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(c, f), both (M,): the aggregation weight of each token's sample (0 off the form's loss mask; one
    aggregation per step) and the form's per-token factor f_t; g = c·f. None when a step's weights are not
    computable (zero denominator, or `constant` without a divisor)."""
    assert batch.advantages is not None
    if form.rule is None:
        factor, keep = -batch.advantages, np.ones(batch.n_tokens, dtype=bool)
    else:
        effect = effect_of(form.rule, replay)
        keep = effect.keep
        factor = (
            effect.grad if effect.grad is not None else -batch.advantages * np.where(keep, effect.weight, 0.0)
        )
    tok_sample = batch.token_sample()
    kept = np.bincount(tok_sample, weights=keep.astype(np.float64), minlength=batch.n_samples)
    weight = np.zeros(batch.n_samples)
    for step in np.unique(batch.step):
        rows = np.flatnonzero(batch.step == step)
        groups, codes = np.unique(batch.group[rows], return_inverse=True)
        c = sample_weights(form.mode, kept[rows], codes, len(groups), len(rows), divisor)
        if c is None:
            return None
        weight[rows] = c
    return np.where(keep, weight[tok_sample], 0.0), factor


def loss_parity_rows(
    batch: TokenBatch,
    pair: tuple[LossForm, LossForm],
    replays: dict[bool, Replay],
    effect_of: EffectOf,
    divisor: float | None,
    on: str,
) -> list[ReportRow]:
    """Rows of breakdown `losses/step` (bucket `A vs B|step`) and `losses` (bucket `A vs B`, max over steps).
    Proximal→θ forms use the `new` replay when there is one, else θ = π_old (every ratio 1)."""
    a, b = pair
    label = f"{a.label} vs {b.label}"
    later = replays.get(True, _unit_replay(replays[False]))
    terms = []
    for form in pair:
        theta = form.rule is not None and form.rule.pair == PROXIMAL_THETA
        terms.append(token_terms(batch, form, later if theta else replays[False], effect_of, divisor))
    if terms[0] is None or terms[1] is None:
        return []
    (c_a, f_a), (c_b, f_b) = terms
    g_a, g_b = c_a * f_a, c_b * f_b
    tok_sample = batch.token_sample()
    rows: list[ReportRow] = []
    for step in np.unique(batch.step):
        tok = np.isin(tok_sample, np.flatnonzero(batch.step == step))
        norm_a = float(np.linalg.norm(g_a[tok]))
        values = {
            "losses/rel_l2": _rel(g_a[tok] - g_b[tok], norm_a),
            "losses/rel_l2_aggregation": _rel((c_a[tok] - c_b[tok]) * f_a[tok], norm_a),
            "losses/rel_l2_factor": _rel(c_b[tok] * (f_a[tok] - f_b[tok]), norm_a),
            "losses/grad_norm_ratio": _rel(g_b[tok], norm_a),
        }
        for metric, value in values.items():
            n = int(tok.sum())
            where = f"{label}|{int(step)}"
            rows.append(ReportRow(on, "token", "losses/step", where, metric, value, "ratio", "l2", n))
    return rows + worst_step_rows(rows)


def worst_step_rows(step_rows: list[ReportRow]) -> list[ReportRow]:
    """Rows of breakdown `losses` (bucket `A vs B`): each metric's maximum over the `losses/step` rows, with the
    tokens of every step (`n`)."""
    worst: dict[tuple[str, str, str], float] = {}
    tokens: dict[tuple[str, str, str], int] = {}
    for row in step_rows:
        if row.breakdown != "losses/step":
            continue
        key = (row.pair, row.bucket.rpartition("|")[0], row.metric)
        tokens[key] = tokens.get(key, 0) + row.n
        if row.value is not None:
            worst[key] = max(worst.get(key, row.value), row.value)
    return [
        ReportRow(on, "token", "losses", label, metric, value, "ratio", "max", tokens[(on, label, metric)])
        for (on, label, metric), value in worst.items()
    ]


def _rel(x: np.ndarray, norm: float) -> float | None:
    return float(np.linalg.norm(x)) / norm if norm > 0 else None


def _unit_replay(replay: Replay) -> Replay:
    """θ = π_old: the proximal→θ forms at the first mini-batch (every ratio 1)."""
    return Replay(
        replay.cur, replay.cur, replay.offsets, replay.step, replay.pos, replay.advantages, replay.reward
    )
