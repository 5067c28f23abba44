"""The signature rules of `pgdiag explain`: each a documented threshold with its source, mapped to one cause.

Every rule reads the `Evidence` fold's statistics (after the sampling causes are mapped out, so a temperature
or kept-set difference does not look like a weight difference) and says whether it fired and on what value.
docs/explain.md lists the same table for users.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# thresholds (docs/explain.md, "Signatures")
WEIGHTS_FLOOR_FACTOR = (
    10.0  # weights: a side's k3 against every configuration > 10x the largest precision spread
)
FIRST_POSITION_RATIO = 5.0  # tokenization / first-token: the leading positions' k3 >= 5x the tail's
TEMPLATE_NATS = 0.1  # tokenization: mean |Δ| at the first response position >= 0.1 nats (template: ~0.8)
STALE_RATIO = 4.0  # staleness: lagged samples' k3 >= 4x the unlagged samples' (and above the floor)
ZERO_FACTOR = 2.0  # exact zeros: side a's exact-0.0 fraction > 2x the tokens the reference gives p ≈ 1
ZERO_MIN = 0.01  # ... and above 1 % of tokens
JITTER_K3 = 1e-4  # jitter floor: k3 < 1e-4 (miles' triage table)
MATERIAL = 0.01  # a sampling correction counts when it lowers the pair's k3 by more than 1 % of k3_0


@dataclass(frozen=True)
class Signature:
    """One rule evaluated: its name, the one cause it maps to, threshold, value, whether it fired, source."""

    name: str
    cause: str
    rule: str
    value: float | None
    threshold: float | None
    fired: bool
    source: str

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, in declaration order (the JSON object of `--json`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def first_position_rule(
    by_position: dict[int, tuple[float, float, float]],
) -> tuple[Signature, Signature, int]:
    """(tokenization signature, engine first-token signature, template region: response positions < N).

    The leading buckets whose mean k3 is >= 5x the tail's (response positions >= 8, else >= 2) form the region;
    it is a template when the first position's mean |Δ| is >= 0.1 nats, an engine's first-token effect when
    smaller (marin-community/marin#1879: max |Δ| 2e-3 .. 0.16)."""
    from pgdiag.explain.settings import POSITION_EDGES

    tail_from = 4 if any(b >= 4 for b in by_position) else 2
    tail = [(n, k) for b, (n, k, _) in by_position.items() if b >= tail_from]
    n_tail = sum(n for n, _ in tail)
    tail_k3 = sum(n * k for n, k in tail) / n_tail if n_tail else None
    first = by_position.get(0)
    ratio = None
    region = 0
    if first is not None and tail_k3 is not None:
        ratio = first[1] / tail_k3 if tail_k3 > 0 else (float("inf") if first[1] > 0 else 0.0)
        for b in sorted(by_position):
            if b >= tail_from or by_position[b][1] < FIRST_POSITION_RATIO * tail_k3:
                break
            region = POSITION_EDGES[b + 1]
    concentrated = ratio is not None and ratio >= FIRST_POSITION_RATIO
    abs_first = first[2] if first is not None else None
    template = concentrated and abs_first is not None and abs_first >= TEMPLATE_NATS
    tokenization = Signature(
        "chat_template",
        "tokenization",
        f"k3 at response position 0 >= {FIRST_POSITION_RATIO:g}x the tail's and mean |Δ| there >= "
        f"{TEMPLATE_NATS:g} nats",
        abs_first,
        TEMPLATE_NATS,
        bool(template),
        "miles/slime triage table (about 0.8 nats per token on an instruct model = chat-template mismatch)",
    )
    first_token = Signature(
        "engine_first_token",
        "batch_variance",
        f"k3 at response position 0 >= {FIRST_POSITION_RATIO:g}x the tail's with mean |Δ| < {TEMPLATE_NATS:g}",
        ratio,
        FIRST_POSITION_RATIO,
        bool(concentrated and not template),
        "marin-community/marin#1879 (first-token log-prob discrepancy, prefill vs decode)",
    )
    return tokenization, first_token, region if template else 0


def weights_rule(side: str, distance: float | None, floor: float | None) -> Signature:
    """`weights` when a side's k3 against every recompute configuration exceeds 10x the precision spread."""
    return Signature(
        f"other_weights_{side}",
        "weights",
        f"min over configurations of k3(side {side}, config) > {WEIGHTS_FLOOR_FACTOR:g} x the largest k3 between "
        "two precision configurations",
        distance,
        floor,
        bool(distance is not None and floor is not None and distance > floor),
        "pgdiag issue 24; miles --ci-inject-rollout-data-min-match-ratio (wrong weights in the engine)",
    )


def staleness_rule(stale_k3: float | None, fresh_k3: float | None, floor: float | None) -> Signature:
    threshold = None if fresh_k3 is None else max(STALE_RATIO * fresh_k3, floor or 0.0)
    return Signature(
        "policy_lag",
        "staleness",
        f"k3 of samples with policy lag >= 1 > max({STALE_RATIO:g}x the lag-0 samples', the weights floor)",
        stale_k3,
        threshold,
        bool(stale_k3 is not None and threshold is not None and stale_k3 > threshold),
        "NeMo-RL importance_sampling/lag_k diagnostics; AReaL version_stats",
    )


def temperature_rule(t_a: float, t_b: float, gain: float, k3_0: float) -> Signature:
    return Signature(
        "missing_temperature",
        "temperature",
        "the sides' fitted temperatures differ and rescaling lowers k3 by > 1 % of k3_0 (Δ proportional to "
        "the log-prob)",
        t_a / t_b if t_a > 0 and t_b > 0 else None,  # None: a side fits its recorded per-token temperatures
        1.0,
        bool(t_a != t_b and gain > MATERIAL * k3_0),
        "thinking-machines-lab/tinker-feedback#148; pgdiag W401",
    )


def zeros_rule(zero_fraction: float, certain_fraction: float) -> Signature:
    threshold = max(ZERO_MIN, ZERO_FACTOR * certain_fraction)
    return Signature(
        "exact_zero_logprobs",
        "logprobs_mode",
        f"side a's exact 0.0 fraction > max({ZERO_MIN:g}, {ZERO_FACTOR:g}x the fraction the reference gives p ≈ 1)",
        zero_fraction,
        threshold,
        bool(zero_fraction > threshold),
        "thinking-machines-lab/tinker-cookbook#396 (sampling-time log-probs with too many zeros)",
    )


def jitter_rule(k3_0: float, floor: float | None) -> Signature:
    threshold = JITTER_K3 if floor is None else max(JITTER_K3, floor / 10)
    return Signature(
        "jitter_floor",
        "precision",
        "the pair's k3 is below max(1e-4, the largest k3 between two precision configurations)",
        k3_0,
        threshold,
        bool(k3_0 < threshold),
        "miles/slime triage table (KL < 1e-4 is jitter)",
    )
