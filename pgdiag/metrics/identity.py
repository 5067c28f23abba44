"""Step-0 identity check of docs/metrics.md (`pgdiag metrics --identity`).

What: on on-policy data (lp_old produced by the same weights and numerics as lp_new) every valid token has
d = 0, so r = 1, every clip fraction and KL estimate is 0, every ESS is 1, and the loss reduces to the
weighted advantage mean −Σ m' w_t A_t. The headline parity number is `policy/logratio_absmax` (max |d| in
nats) next to `count/tokens`.

Why: a recompute that is not bit-identical to the trainer's own log-probs shifts every later metric; checking
it at step 0, where the answer is known exactly, separates log-prob numerics from policy drift. The gate
is `policy/logratio_absmax ≤ --identity-tol` (default 0: bit-identical) and no invalid token.

How: `check_identity(step_metrics, tolerance)` on the `StepMetrics` of the step to check; it also lists every
policy key that departs from its on-policy value by more than the tolerance, to say where it breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pgdiag.metrics.step_metrics import StepMetrics

ON_POLICY_ONE = ("policy/ratio_mean", "policy/ratio_min", "policy/ratio_max", "policy/seq_ratio_mean")
ON_POLICY_ONE_PREFIXES = ("policy/ess_",)
ON_POLICY_ZERO_PREFIXES = ("policy/clip_frac", "policy/kl_", "policy/dual_clip_frac", "policy/seq_clip_frac")


@dataclass(frozen=True)
class IdentityCheck:
    """Result of the step-0 identity check on one step."""

    passed: bool
    logratio_absmax: float | None  # max |d| over valid tokens, nats
    tokens: int  # count/tokens
    tokens_invalid: int  # count/tokens_invalid
    tolerance: float
    deviations: tuple[str, ...]  # policy keys away from their on-policy value by more than `tolerance`
    message: str


def on_policy_value(key: str) -> float | None:
    """The exact value `key` takes on on-policy data, None for keys the identity check does not fix."""
    if key in ON_POLICY_ONE or key.startswith(ON_POLICY_ONE_PREFIXES):
        return 1.0
    if key.startswith(ON_POLICY_ZERO_PREFIXES) or key == "policy/logratio_absmax":
        return 0.0
    return None


def check_identity(step: StepMetrics, tolerance: float = 0.0) -> IdentityCheck:
    """Gate `policy/logratio_absmax ≤ tolerance` and `count/tokens_invalid = 0` on one step's metrics."""
    if not tolerance >= 0.0:
        raise ValueError(f"identity tolerance must be >= 0, got {tolerance}")
    values = {v.key: v.value for v in step.values}
    absmax = values.get("policy/logratio_absmax")
    tokens = int(values.get("count/tokens") or 0)
    invalid = int(values.get("count/tokens_invalid") or 0)
    deviations = tuple(
        key
        for key, value in values.items()
        if (target := on_policy_value(key)) is not None
        and value is not None
        and abs(value - target) > tolerance
    )
    if "policy/logratio_absmax" not in values:
        passed, message = False, "identity check needs the policy pair (new and old streams)"
    elif absmax is None:
        passed, message = False, "identity check: no valid tokens"
    else:
        passed = absmax <= tolerance and invalid == 0
        verdict = "passed" if passed else "FAILED"
        message = (
            f"identity {verdict}: max |lp_new − lp_old| = {absmax:.3g} nats over {tokens} tokens "
            f"(tolerance {tolerance:.3g}), {invalid} invalid tokens"
        )
    return IdentityCheck(passed, absmax, tokens, invalid, tolerance, deviations, message)
