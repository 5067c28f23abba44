"""Attribution: from the folds' results to decisions (`decide`), then to shares per cause (`shares`).

Causes are removed one after another in `settings.REMOVAL_ORDER`; k3_i is the pair's mean k3 once causes
1..i are removed, share_i = (k3_{i−1} − k3_i) / k3_0, and `unexplained` = k3_last / k3_0, so the shares sum
to 1. How each cause is removed (docs/explain.md, "Method"):

* logprobs_mode, temperature, sampling_truncation: side b is moved to side a's fitted temperature and kept set
  (and side a's truncation undone) using the sampling grid: deterministic, pgdiag's own logits cancel out;
* tokenization: the template region's tokens count at the level of the others (they are explained);
* staleness: side a's stale samples are replaced by the recompute closest to side a on fresh samples;
* weights: the side that ran other weights is replaced by the recompute closest to it;
* routing: side b moved by (routes replayed − routes recomputed);
* batch_variance, precision: noise pgdiag can only say the mismatch is consistent with: the expected k3 of
  its own configurations (one sequence per forward vs packed; low precision vs the fp32 reference) is
  subtracted, never below 0.

Per group (position bucket, step) the same removals give stage values made monotone (a removal that would raise
a group's k3 gives it share 0 there).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from typing import Any

from pgdiag.explain.causes import Chain, Decisions, Evidence, SideFit
from pgdiag.explain.settings import CONSISTENT_WITH, FIX, REMOVAL_ORDER, WHAT, temperature_label
from pgdiag.explain.signatures import (
    MATERIAL,
    WEIGHTS_FLOOR_FACTOR,
    Signature,
    first_position_rule,
    jitter_rule,
    staleness_rule,
    temperature_rule,
    weights_rule,
    zeros_rule,
)

NOISE = ("batch_variance", "precision")


@dataclass(frozen=True)
class ConfigRoles:
    """Which recompute tag plays which role (None when not run)."""

    reference: str | None
    precision: tuple[str, ...]  # low-precision configurations compared with the reference
    packed: str | None
    single: str | None  # one sequence per forward
    replay: str | None
    recompute_routes: str | None
    kept: str | None = None  # scored over the recorded kept sets (fp32, beside the fp32 reference)

    @property
    def numeric(self) -> tuple[str, ...]:
        """Configurations whose spread is pure numerics (the weights floor)."""
        return tuple(
            dict.fromkeys(c for c in (self.reference, *self.precision, self.packed, self.single) if c)
        )


def decide(
    evidence: Evidence,
    fits: dict[str, SideFit],
    temps: tuple[float, ...],
    roles: ConfigRoles,
    declared_modes: tuple[str, str],
) -> tuple[Decisions, list[Signature], dict[str, Any]]:
    """Decisions, the signatures evaluated, and the evidence each cause reports."""
    summary = evidence.finish()
    k3_0 = summary["k3_0"]
    numeric = roles.numeric
    spread = [evidence.mean(f"{x}|{y}") for x in numeric for y in numeric if x != y]
    floor = WEIGHTS_FLOOR_FACTOR * max(spread) if spread else None
    t_a, t_b = temps[fits["a"].temperature_index], temps[fits["b"].temperature_index]
    k3_t = evidence.mean("k3_after_temperature")
    k3_s = evidence.mean("k3_after_sampling")
    sig_temperature = temperature_rule(t_a, t_b, k3_0 - k3_t, k3_0)
    truncated = fits["a"].variant_index != 0 or fits["b"].variant_index != 0
    before_truncation = k3_t if sig_temperature.fired else k3_0
    truncation = truncated and before_truncation - k3_s > MATERIAL * k3_0
    n = max(evidence.n, 1)
    sig_zeros = zeros_rule(evidence.mean("zeros_a"), evidence.mean("certain"))
    processed = "processed" in declared_modes and declared_modes[0] != declared_modes[1]
    mode = (processed or sig_zeros.fired) and (sig_temperature.fired or truncation)
    sig_template, sig_first, region = first_position_rule(summary["by_position"])

    by_lag = summary["by_lag"]
    stale = [(n_l, k) for lag, (n_l, k, _) in by_lag.items() if lag >= 1]
    fresh = [(n_l, k) for lag, (n_l, k, _) in by_lag.items() if lag == 0]
    stale_k3 = sum(a * b for a, b in stale) / sum(a for a, _ in stale) if stale else None
    fresh_k3 = sum(a * b for a, b in fresh) / sum(a for a, _ in fresh) if fresh else None
    sig_stale = staleness_rule(stale_k3, fresh_k3, floor)

    configs = evidence.configs
    outside = [b for b in summary["by_position"] if _bucket_start(b) >= region]
    n_outside = sum(summary["by_position"][b][0] for b in outside)

    def distance(side: str, config: str) -> float:
        return sum(evidence.sums.get(f"{side}|{config}|{b}", 0.0) for b in outside) / max(n_outside, 1)

    best = {}
    d_side: dict[str, float | None] = {}
    for side in ("a", "b"):
        if not configs:
            best[side], d_side[side] = None, None
            continue
        if side == "a" and sig_stale.fired:
            scores = {c: evidence.mean(f"a0|{c}", evidence.sums.get("n_unlagged", 0.0)) for c in configs}
        else:
            scores = {c: distance(side, c) for c in configs}
        best[side] = min(scores, key=scores.__getitem__)
        d_side[side] = scores[best[side]]
    sig_weights = [weights_rule(side, d_side[side], floor) for side in ("a", "b")]
    weights_side = "".join(side for side, s in zip(("a", "b"), sig_weights, strict=True) if s.fired) or None
    sig_jitter = jitter_rule(k3_0, floor / WEIGHTS_FLOOR_FACTOR if floor is not None else None)

    decisions = Decisions(
        apply={
            "logprobs_mode": bool(mode),
            "temperature": bool(sig_temperature.fired and not mode),
            "sampling_truncation": bool(truncation and not mode),
        },
        tokenization_positions=region,
        stale_lag_min=1 if sig_stale.fired else 0,
        weights_side=weights_side,
        best_config=best,
        batch_pair=(roles.packed, roles.single) if roles.packed and roles.single else None,
        precision_pairs=tuple((c, roles.reference) for c in roles.precision if roles.reference),
        routing_pair=(roles.replay, roles.recompute_routes)
        if roles.replay and roles.recompute_routes
        else None,
    )
    signatures = [sig_zeros, sig_temperature, sig_template, sig_first, sig_stale, *sig_weights, sig_jitter]
    details = {
        "logprobs_mode": {"declared": list(declared_modes), "exact_zero_fraction_a": sig_zeros.value},
        "temperature": {"fitted_a": temperature_label(t_a), "fitted_b": temperature_label(t_b)},
        "sampling_truncation": {
            "kept_set": f"recorded ({evidence.kept_pair[0]})"
            if evidence.kept_pair and fits["a"].variant_index != 0
            else "none recorded: candidate sets from pgdiag's own logits"
        },
        "tokenization": {"template_positions": region, "first_position_ratio": sig_first.value},
        "staleness": {
            "per_lag": [
                {"lag": lag, "tokens": int(a), "k3": k, "abs_mean": m} for lag, (a, k, m) in by_lag.items()
            ]
        },
        "weights": {"floor": floor, "distance_a": d_side["a"], "distance_b": d_side["b"], "closest": best},
        "routing": {"configs": list(decisions.routing_pair or [])},
        "batch_variance": {"configs": list(decisions.batch_pair or [])},
        "precision": {"configs": [list(p) for p in decisions.precision_pairs]},
        "n_tokens": n,
    }
    return decisions, signatures, details


def _bucket_start(index: int) -> int:
    from pgdiag.explain.settings import POSITION_EDGES

    return POSITION_EDGES[index]


@dataclass(frozen=True)
class CauseShare:
    """One cause's part of the pair's mismatch."""

    cause: str
    share: float
    k3_before: float
    k3_after: float
    abs_mean_before: float
    abs_mean_after: float
    evidence: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, in declaration order (the JSON object of `--json`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def stage_values(chain: Chain, key: tuple[str, str]) -> list[tuple[str, float, float]]:
    """[(stage, k3, mean |Δ|)] for one group: start, then after each cause in removal order (monotone)."""
    table = chain.stages[key]
    noise = chain.noise.get(key, {})
    n = max(noise.get("n", 0.0), 1.0)
    out: list[tuple[str, float, float]] = []
    for stage in ("start", *REMOVAL_ORDER):
        _, n_not, k_sum, a_sum = table[stage]
        k3_now, abs_now = (k_sum / n_not, a_sum / n_not) if n_not else (0.0, 0.0)
        if out:
            prev_k3, prev_abs = out[-1][1], out[-1][2]
            if stage in NOISE:
                k3_now, abs_now = prev_k3, prev_abs
                expected = _expected_noise(stage, noise, n)
                k3_now = max(0.0, prev_k3 - expected)
                abs_now = prev_abs * math.sqrt(k3_now / prev_k3) if prev_k3 > 0 else 0.0
            if k3_now > prev_k3:
                k3_now, abs_now = prev_k3, prev_abs
        out.append((stage, k3_now, abs_now))
    return out


def _expected_noise(stage: str, noise: dict[str, float], n: float) -> float:
    if stage == "batch_variance":
        return noise.get("batch_variance", 0.0) / n
    values = [v / n for k, v in noise.items() if k.startswith("precision:")]
    return max(values) if values else 0.0


def shares(chain: Chain, key: tuple[str, str], details: dict[str, Any]) -> list[CauseShare]:
    """Every cause of the vocabulary with its share for one group, sorted by share (largest first)."""
    stages = stage_values(chain, key)
    k3_0 = stages[0][1]
    found = []
    for (_, k_before, a_before), (cause, k_after, a_after) in itertools.pairwise(stages):
        share = (k_before - k_after) / k3_0 if k3_0 > 0 else 0.0
        found.append(CauseShare(cause, share, k_before, k_after, a_before, a_after, details.get(cause, {})))
    last = stages[-1]
    found.append(
        CauseShare("unexplained", last[1] / k3_0 if k3_0 > 0 else 0.0, last[1], last[1], last[2], last[2], {})
    )
    return sorted(found, key=lambda c: -c.share)


def verdict_line(causes: list[CauseShare], nothing: bool) -> tuple[str | None, str]:
    """(top cause, the verdict line naming it, its share and its fix)."""
    if nothing:
        return None, "nothing to explain: the two streams agree bit for bit"
    top = causes[0]
    words = f"consistent with {WHAT[top.cause]}" if top.cause in CONSISTENT_WITH else WHAT[top.cause]
    name = top.cause.replace("_", " ")
    return top.cause, f"{100 * top.share:.0f} % of the mismatch is {name} ({words}): {FIX[top.cause]}"
