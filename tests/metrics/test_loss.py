"""Loss aggregation (docs/metrics.md): every native mode and every framework alias against its formula.

The batch has unequal lengths (3, 1, 0, 2), one empty sample (counted in S unless --empty-seqs skip), two
prompt groups, ratios on both sides of the band, and advantages of both signs.
"""

from __future__ import annotations

import math

import pytest
from metrics_batch_factory import make_batch

from pgdiag.errors import UsageError
from pgdiag.metrics.engine import compute_step_native
from pgdiag.metrics.loss import AGGREGATION_ALIASES, NATIVE_MODES, resolve_aggregation
from pgdiag.metrics.settings import MetricSettings

D = [[0.1, -0.1, 0.3], [0.05], [], [-0.3, 0.0]]
A = [1.0, -2.0, 0.5, -1.0]
GROUPS = ["a", "a", "b", "b"]
EPS = 0.2


def clip(x: float) -> float:
    return min(max(x, 1 - EPS), 1 + EPS)


def token_loss(a: float, r: float) -> float:
    return max(-a * r, -a * clip(r))


def per_sample_sums(sequence: bool) -> list[float]:
    """Σ_t ℓ_t (token level) or Σ_t ℓ^G_t (GSPO) per sample, by plain loops."""
    out = []
    for d, a in zip(D, A, strict=True):
        if not d:
            out.append(0.0)
            continue
        seq_ratio = math.exp(math.fsum(d) / len(d))
        out.append(math.fsum(token_loss(a, seq_ratio if sequence else math.exp(x)) for x in d))
    return out


def expected(mode: str, *, divisor: float | None = None, n_samples: int = 4) -> float:
    lengths = [len(d) for d in D]
    sums = per_sample_sums(mode.startswith("gspo"))
    n = sum(lengths)
    if mode in ("token_mean", "gspo_token_mean"):
        return math.fsum(sums) / n
    if mode in ("sample_mean", "gspo_seq_mean"):
        return math.fsum(s / k for s, k in zip(sums, lengths, strict=True) if k) / n_samples
    if mode in ("seq_mean_token_sum", "gspo_length_prop"):
        return math.fsum(sums) / n_samples
    if mode == "token_sum":
        return math.fsum(sums)
    if mode == "constant":
        return math.fsum(sums) / (divisor * n_samples)
    if mode == "prompt_mean":
        return ((sums[0] + sums[1]) / 4 + (sums[2] + sums[3]) / 2) / 2
    raise AssertionError(mode)


def batch():
    old = [[-1.0 - 0.1 * i for i in range(len(d))] for d in D]
    new = [[o + x for o, x in zip(os, d, strict=True)] for os, d in zip(old, D, strict=True)]
    return make_batch(new=new, old=old, advantages=A, groups=GROUPS)


def loss_values(**settings) -> dict[str, float | None]:
    metrics = compute_step_native(batch(), MetricSettings.from_options(new="new", old="old", **settings))
    return {v.key: v.value for v in metrics.values}


@pytest.mark.parametrize("mode", NATIVE_MODES)
def test_every_native_mode_matches_its_formula(mode):
    got = loss_values(divisor=7.0, aggregation=mode)
    assert got[f"loss/{mode}"] == pytest.approx(expected(mode, divisor=7.0), rel=1e-14, abs=1e-15)
    assert got["loss/pg"] == got[f"loss/{mode}"]


def test_empty_seqs_skip_uses_nonempty_samples():
    got = loss_values(divisor=7.0, empty_seqs="skip")
    for mode in ("sample_mean", "seq_mean_token_sum", "constant", "gspo_seq_mean", "gspo_length_prop"):
        assert got[f"loss/{mode}"] == pytest.approx(expected(mode, divisor=7.0, n_samples=3), rel=1e-14)
    assert got["loss/token_mean"] == pytest.approx(expected("token_mean"), rel=1e-14)


# alias, level, extra settings, native mode, divisor for the expected value, S for the expected value
ALIAS_CASES = [
    ("token-mean", "token", {}, "token_mean", None, 4),
    ("verl:token-mean", "token", {}, "token_mean", None, 4),
    ("token-sum", "token", {}, "token_sum", None, 4),
    ("seq-mean-token-mean", "token", {}, "sample_mean", None, 4),
    ("seq-mean-token-mean", "token", {"empty_seqs": "skip"}, "sample_mean", None, 3),
    ("seq-mean-token-sum", "token", {}, "seq_mean_token_sum", None, 4),
    ("seq-mean-token-sum-norm", "token", {"divisor": 7.0}, "constant", 7.0, 4),
    ("grpo", "token", {}, "sample_mean", None, 4),
    ("trl:grpo", "token", {}, "sample_mean", None, 4),
    ("liger:sapo", "token", {}, "sample_mean", None, 4),
    ("bnpo", "token", {}, "token_mean", None, 4),
    ("dapo", "token", {}, "token_mean", None, 4),
    ("dr_grpo", "token", {"divisor": 7.0}, "constant", 7.0, 4),
    ("trl:dr_grpo", "token", {}, "constant", 512.0, 4),
    ("liger:dr_grpo", "token", {"divisor": 40960.0}, "constant", 40960.0, 4),
    ("trl:luspo", "token", {}, "seq_mean_token_sum", None, 4),
    ("miles:sample_mean", "token", {}, "sample_mean", None, 4),
    ("prompt_mean", "token", {}, "prompt_mean", None, 4),
    ("miles:constant", "token", {"divisor": 3.0}, "constant", 3.0, 4),
    ("miles:token_mean", "token", {}, "token_mean", None, 4),
    ("calculate-per-token-loss", "token", {}, "token_mean", None, 4),
    ("fast-llm:grpo", "token", {}, "token_mean", None, 4),
    ("fast-llm:gspo", "token", {}, "gspo_length_prop", None, 4),
    ("pipelinerl:ppo", "token", {}, "seq_mean_token_sum", None, 4),
    ("pipelinerl:ppo", "token", {"batch_size": 8}, "seq_mean_token_sum", None, 8),
    ("seq-mean-token-mean", "sequence", {}, "gspo_seq_mean", None, 4),
    ("token-mean", "sequence", {}, "gspo_token_mean", None, 4),
    ("seq-mean-token-sum", "sequence", {}, "gspo_length_prop", None, 4),
    ("grpo", "sequence", {}, "gspo_seq_mean", None, 4),
    ("dapo", "sequence", {}, "gspo_token_mean", None, 4),
    ("trl:luspo", "sequence", {}, "gspo_length_prop", None, 4),
    ("liger:luspo", "sequence", {}, "gspo_length_prop", None, 4),
    ("fast-llm:grpo", "sequence", {}, "gspo_length_prop", None, 4),
    ("sample_mean", "sequence", {}, "sample_mean", None, 4),  # native names ignore --level
]


@pytest.mark.parametrize(("alias", "level", "extra", "mode", "divisor", "n_samples"), ALIAS_CASES)
def test_alias_resolves_and_gives_the_formula(alias, level, extra, mode, divisor, n_samples):
    settings = MetricSettings.from_options(new="new", old="old", aggregation=alias, level=level, **extra)
    resolved = resolve_aggregation(alias, settings)
    assert resolved.mode == mode
    assert resolved.divisor == divisor
    got = {v.key: v.value for v in compute_step_native(batch(), settings).values}
    assert got["loss/pg"] == pytest.approx(expected(mode, divisor=divisor, n_samples=n_samples), rel=1e-14)


def test_every_alias_rule_is_exercised():
    tested = {alias.split(":")[-1] for alias, *_ in ALIAS_CASES}
    assert {rule.name for rule in AGGREGATION_ALIASES} <= tested


@pytest.mark.parametrize(
    ("alias", "level", "message"),
    [
        ("constant", "token", "needs --divisor"),
        ("seq-mean-token-sum-norm", "token", "needs --divisor"),
        ("dr_grpo", "token", "needs --divisor"),
        ("luspo", "token", "needs a framework prefix"),
        ("ppo", "token", "needs a framework prefix"),
        ("liger:luspo", "token", "no native loss mode at --level token"),
        ("token-sum", "sequence", "no native loss mode at --level sequence"),
        ("dr_grpo", "sequence", "no native loss mode"),
        ("mean", "token", "unknown --aggregation 'mean'"),
        ("verl:grpo", "token", "unknown --aggregation"),
    ],
)
def test_bad_aggregation_is_a_usage_error(alias, level, message):
    with pytest.raises(UsageError) as err:
        resolve_aggregation(alias, MetricSettings.from_options(level=level))
    assert message in err.value.message
    assert err.value.exit_code == 2


def test_non_positive_divisor_is_rejected():
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(UsageError, match="positive"):
            MetricSettings(divisor=bad)
        with pytest.raises(UsageError, match="positive"):
            MetricSettings(grad_divisor=bad)


def test_constant_is_null_without_divisor_when_not_selected():
    metrics = compute_step_native(batch(), MetricSettings.from_options(new="new", old="old"))
    got = {v.key: v.value for v in metrics.values}
    assert got["loss/constant"] is None
    assert got["grad/constant_scale"] is None
    assert any("--divisor" in notice for notice in metrics.notices)


def test_grad_divisor_keys():
    got = loss_values(aggregation="sample_mean", grad_divisor=4.0)
    total_abs_grad = got["grad/token_sum_scale"]  # Σ |g_t| with unit weights
    assert got["grad/grad_divisor_scale"] == pytest.approx(total_abs_grad / 4.0, rel=1e-14)
    assert got["grad/grad_divisor_ratio"] == pytest.approx(
        got["grad/grad_divisor_scale"] / got["grad/sample_mean_scale"], rel=1e-14
    )


def test_grad_scale_by_hand():
    # g_t = −A r unless binding: s0 t3 (A > 0, r = e^0.3 > 1.2) and s3 t1 (A < 0, r = e^−0.3 < 0.8) bind
    abs_g = [math.exp(0.1), math.exp(-0.1), 2.0 * math.exp(0.05), 1.0]
    got = loss_values()
    assert got["grad/token_sum_scale"] == pytest.approx(math.fsum(abs_g), rel=1e-14)
    assert got["grad/token_mean_scale"] == pytest.approx(math.fsum(abs_g) / 6, rel=1e-14)
    assert got["grad/sample_mean_scale"] == pytest.approx(
        (math.fsum(abs_g[:2]) / 3 + abs_g[2] / 1 + abs_g[3] / 2) / 4, rel=1e-14
    )
    # weight sums: S+/S for sample_mean, the share of groups with tokens for prompt_mean, N/S
    assert got["grad/sample_mean_weight_sum"] == pytest.approx(3 / 4, rel=1e-15)
    assert got["grad/prompt_mean_weight_sum"] == pytest.approx(1.0, rel=1e-15)
    assert got["grad/seq_mean_token_sum_weight_sum"] == pytest.approx(6 / 4, rel=1e-15)
    # length elasticity: token_mean weight ∝ length (1), sample_mean length-neutral (0)
    assert got["grad/token_mean_length_elasticity"] == pytest.approx(1.0, rel=1e-12)
    assert got["grad/sample_mean_length_elasticity"] == 0.0
