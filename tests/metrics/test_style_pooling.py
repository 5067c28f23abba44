"""`pool_style_steps`: a key style's `all` row from its per-step results equals the style run on the pooled
batch (the pre-streaming `all` row), for every style and flag, on `sample_data/` and on synthetic runs with
uneven and empty steps, non-finite values and groups straddling `--docs-per-step` cuts; plus hand-computed
two-step examples of every pooling rule.

Tolerance: a value whose pooled arithmetic is the same (counts, sums of integers, extrema, fractions of an
integer count, the loss keys' mean over steps) must be bit-identical. A token, sample or document mean is a
sum regrouped by step (numerator_s = value_s · weight_s, then Σ_s), so it may differ in the last bits:
``|a − b| <= 1e-12·max(|a|, |b|) + 1e-15`` (the absolute part covers means that cancel to ~1e-17 from terms
of order one, such as group-normalised advantages). verl's IS-weight std is E[w²] − E[w]² in one pass on
both sides, so it is compared as std² within 1e-13·E[w²].
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import replace

import numpy as np
import pytest
from metrics_batch_factory import make_batch
from sample_paths import SAMPLE_DATA

import pgdiag
from pgdiag.data.batch import TokenBatch
from pgdiag.data.load import read_token_batch
from pgdiag.metrics.api import metric_streams, resolve_streams
from pgdiag.metrics.engine import StepMetrics
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles import STYLE_NAMES
from pgdiag.metrics.styles.pool_rules import POOL_RULES, PoolRule, pool_rules
from pgdiag.metrics.styles.steps import compute_by_step, compute_step_style

SAMPLE_DATA = SAMPLE_DATA
WHOLE_GROUP_KEYS = {"count/groups", "count/groups_singleton", "count/groups_split", "frac_reward_zero_std"}

# every style with each of its flags (docs/key-styles.md)
STYLE_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("fast-llm", {}),
    ("fast-llm", {"level": "sequence"}),
    ("fast-llm", {"loss_name": "pg"}),
    ("verl", {}),
    ("verl", {"aggregation": "seq-mean-token-mean"}),
    ("verl", {"aggregation": "token-sum"}),
    ("verl", {"aggregation": "seq-mean-token-sum", "empty_seqs": "skip"}),
    ("verl", {"aggregation": "constant", "divisor": 64.0}),
    ("verl", {"rollout_is": "token", "rollout_is_threshold": 1.05}),
    ("verl", {"level": "sequence"}),
    ("verl", {"dual_clip": 2.0}),
    ("trl", {}),
    ("trl", {"aggregation": "grpo"}),
    ("trl", {"aggregation": "bnpo"}),
    ("trl", {"aggregation": "dr_grpo", "divisor": 16.0}),
    ("trl", {"aggregation": "luspo"}),
    ("trl", {"level": "sequence"}),
    ("trl", {"beta": 0.04}),
    ("trl", {"beta": 0.04, "kl_bias_correction": False, "vllm_is": False}),
    ("liger", {}),
    ("liger", {"aggregation": "luspo", "pad_width": 12}),
    ("liger", {"aggregation": "dr_grpo", "divisor": 16.0}),
    ("liger", {"level": "sequence"}),
    ("liger", {"beta": 0.0}),
    ("miles", {}),
    ("miles", {"aggregation": "miles:token_mean"}),
    ("miles", {"aggregation": "prompt_mean"}),
    ("miles", {"aggregation": "constant", "divisor": 32.0}),
    ("miles", {"tis": True}),
    ("miles", {"mismatch_metrics": True, "dual_clip": 3.0}),
    ("pipelinerl", {}),
    ("pipelinerl", {"batch_size": 4}),
    ("pipelinerl", {"group_normalize": True}),
    ("pipelinerl", {"kl_coef": 0.0}),
]


# ---- the reference: the style on the pooled batch (the all row before streaming) -------------------------


def _documents_ignoring_steps(batch: TokenBatch) -> np.ndarray:
    """(S,) document index by consecutive equal sample_id (what --docs-per-step counts)."""
    same = batch.sample_id[1:] == batch.sample_id[:-1]
    return np.concatenate([[0], np.cumsum(~same)]).astype(np.int64)


def reference_all_row(batch: TokenBatch, settings: MetricSettings, steps: list[StepMetrics]) -> StepMetrics:
    """`compute_step_style` on the whole batch with groups keyed by (step, group) (whole again under
    --docs-per-step), the loss (``mode``) keys replaced by their mean over the steps with a value."""
    if settings.docs_per_step is None:
        _, step_code = np.unique(batch.step, return_inverse=True)
        key = step_code.reshape(-1).astype(np.int64) * (int(batch.group.max()) + 1) + batch.group
        _, pooled_group = np.unique(key, return_inverse=True)
        pooled = replace(batch, group=pooled_group.reshape(-1).astype(np.int64))
        n_split = 0
    else:
        step = _documents_ignoring_steps(batch) // settings.docs_per_step
        pooled = batch.with_steps(step)
        steps_of_group = {g: set(step[batch.group == g].tolist()) for g in np.unique(batch.group)}
        n_split = sum(1 for s in steps_of_group.values() if len(s) > 1)
    whole = compute_step_style(pooled, settings, groups_split=n_split)
    values = []
    for v in whole.values:
        if v.reduction == "mode":
            numbers = [s.by_key()[v.key].value for s in steps if v.key in s.by_key()]
            numbers = [x for x in numbers if x is not None]
            mean = None
            if numbers:
                finite = all(math.isfinite(x) for x in numbers)
                mean = (math.fsum(numbers) if finite else sum(numbers)) / len(numbers)
            v = replace(v, value=mean, n=len(numbers))
            if mean is not None and math.isnan(mean):
                v = replace(v, value=None)
        values.append(v)
    return replace(whole, values=tuple(values))


def _exact(rule: PoolRule, unit: str) -> bool:
    """Rules whose pooled arithmetic is the reference's own: the result must be bit-identical."""
    return rule.kind in ("mode", "max", "min") or rule.integer or (rule.kind == "sum" and unit == "count")


def assert_pooled_equals_reference(batch: TokenBatch, settings: MetricSettings) -> StepMetrics:
    """Run the style per step, pool, and compare every key with the reference all row."""
    rows = compute_by_step(
        batch, settings, lambda b, s, n: compute_step_style(b, s, groups_split=n, partials=True)
    )
    steps = [m for label, m in rows if label != "all"]
    got = rows[-1][1]
    assert rows[-1][0] == "all"
    want = reference_all_row(batch, settings, steps)
    assert [v.key for v in got.values] == [v.key for v in want.values]
    assert got.status == want.status
    assert set(want.notices) <= set(got.notices)
    rules = pool_rules(settings)
    straddle = any(s.by_key()["count/groups_split"].value for s in steps)
    for a, b in zip(got.values, want.values, strict=True):
        assert (a.unit, a.reduction) == (b.unit, b.reduction), a.key
        if straddle and a.key in WHOLE_GROUP_KEYS:
            assert a.value is None
            assert any(a.key in n and "straddle" in n for n in got.notices)
            continue
        assert a.n == b.n, (a.key, a.n, b.n)
        if a.value is None or b.value is None:
            assert a.value is b.value, (a.key, a.value, b.value)
            continue
        rule = rules[a.key]
        if _exact(rule, a.unit) or not math.isfinite(b.value):
            assert a.value == b.value, (a.key, a.value, b.value)
        elif a.key == "rollout_corr/rollout_is_std":
            second = next(v.value for v in want.values if v.key == "rollout_corr/rollout_is_mean") ** 2
            assert abs(a.value**2 - b.value**2) <= 1e-13 * (second + b.value**2), (a.key, a.value, b.value)
        else:
            assert abs(a.value - b.value) <= 1e-12 * max(abs(a.value), abs(b.value)) + 1e-15, (
                a.key,
                a.value,
                b.value,
            )
    return got


# ---- sample_data/ -------------------------------------------------------------------------------------------


@functools.cache
def _read_sample(name: str, streams: tuple[str, ...]) -> TokenBatch:
    run = pgdiag.read_run(SAMPLE_DATA / name)
    return read_token_batch(run, streams=list(streams), entropy=[]).batch


def _sample_batch(name: str, settings: MetricSettings) -> tuple[TokenBatch, MetricSettings]:
    settings = resolve_streams(pgdiag.read_run(SAMPLE_DATA / name), settings)
    return _read_sample(name, tuple(metric_streams(settings))), settings


@pytest.mark.parametrize("docs_per_step", [None, 3])
@pytest.mark.parametrize(("style", "flags"), STYLE_FLAGS, ids=[f"{s}-{'-'.join(f)}" for s, f in STYLE_FLAGS])
@pytest.mark.parametrize("run", ["run_a", "synthetic_b"])
def test_sample_runs_pool_to_the_pooled_batch(
    run: str, style: str, flags: dict[str, object], docs_per_step: int | None
) -> None:
    if flags.get("beta"):
        flags = {**flags, "beta": None}  # the sample runs have no reference stream
    settings = MetricSettings.from_options(key_style=style, docs_per_step=docs_per_step, **flags)
    batch, settings = _sample_batch(run, settings)
    assert_pooled_equals_reference(batch, settings)


# ---- synthetic runs: uneven and empty steps, multi-row documents, NaN/inf, straddling groups ---------------


def synthetic_run(*, seed: int, nonfinite: bool = False, group_size: int = 3) -> TokenBatch:
    """Four steps of 5, 3, 2 and 7 rows; step 2's rows have no loss token, some rows elsewhere neither;
    rows 1-2 and 12-13 are one document each (same sample_id); groups of `group_size` consecutive rows."""
    rng = np.random.default_rng(seed)
    steps = [0] * 5 + [1] * 3 + [2] * 2 + [3] * 7
    lengths = [int(x) for x in rng.integers(1, 7, size=len(steps))]
    lengths[3] = lengths[9] = lengths[8] = lengths[15] = 0
    sample_ids = [f"s{i}" for i in range(len(steps))]
    sample_ids[2], sample_ids[13] = sample_ids[1], sample_ids[12]
    groups = [f"g{i // group_size}" for i in range(len(steps))]

    def tokens(scale: float, shift: float) -> list[list[float]]:
        return [list(shift + scale * rng.standard_normal(n)) for n in lengths]

    old = [[-abs(x) for x in row] for row in tokens(1.0, 0.0)]
    new = [
        [o + d for o, d in zip(row, deltas, strict=True)]
        for row, deltas in zip(old, tokens(0.3, 0.0), strict=True)
    ]
    rollout = [
        [o + d for o, d in zip(row, deltas, strict=True)]
        for row, deltas in zip(old, tokens(0.1, 0.0), strict=True)
    ]
    ref = [
        [o + d for o, d in zip(row, deltas, strict=True)]
        for row, deltas in zip(new, tokens(0.2, 0.0), strict=True)
    ]
    advantages = tokens(1.0, 0.1)
    entropy = [[abs(x) for x in row] for row in tokens(1.0, 0.5)]
    reward = [float(x) for x in rng.integers(0, 2, size=len(steps))]
    reward[15] = reward[16] = reward[14]  # a zero-std group at the end
    if nonfinite:
        new[0][0] = math.nan  # step 0: a NaN new log-prob
        rollout[11][0] = -math.inf  # step 3: an infinite rollout log-prob
        advantages[5][0] = math.inf  # step 1: an infinite advantage
    return make_batch(
        new=new,
        old=old,
        rollout=rollout,
        ref=ref,
        advantages=advantages,
        entropy=entropy,
        groups=groups,
        steps=steps,
        sample_ids=sample_ids,
        reward=reward,
        lengths=lengths,
    )


def _synthetic_settings(style: str, flags: dict[str, object], **extra: object) -> MetricSettings:
    roles = {
        "new": "new",
        "old": "old",
        "stream_a": "rollout",
        "stream_b": "old",
        "ref": "ref",
        "entropy": "rc",
    }
    return MetricSettings.from_options(key_style=style, **{**roles, **flags, **extra})


@pytest.mark.parametrize(
    ("nonfinite", "docs_per_step", "group_size"),
    [(False, None, 3), (True, None, 3), (False, 2, 3), (False, 3, 3), (True, 3, 2)],
    ids=["clean", "nonfinite", "docs2-straddling", "docs3-aligned", "docs3-nonfinite"],
)
@pytest.mark.parametrize(("style", "flags"), STYLE_FLAGS, ids=[f"{s}-{'-'.join(f)}" for s, f in STYLE_FLAGS])
def test_synthetic_runs_pool_to_the_pooled_batch(
    style: str, flags: dict[str, object], nonfinite: bool, docs_per_step: int | None, group_size: int
) -> None:
    batch = synthetic_run(seed=7, nonfinite=nonfinite, group_size=group_size)
    settings = _synthetic_settings(style, flags, docs_per_step=docs_per_step)
    got = assert_pooled_equals_reference(batch, settings)
    statuses = {v.key: v for v in got.values}
    assert statuses["count/tokens_masked"].value == batch.n_tokens


def test_every_printed_key_has_a_rule() -> None:
    """Every key any style prints on the fully-fed synthetic run is in POOL_RULES (no fallback in use)."""
    batch = synthetic_run(seed=3)
    for style, flags in STYLE_FLAGS:
        settings = _synthetic_settings(style, flags)
        rules = pool_rules(settings)
        for v in compute_step_style(batch, settings, groups_split=0).values:
            assert v.key in rules, (style, v.key)
    assert set(POOL_RULES) == set(STYLE_NAMES)


# ---- hand-computed two-step examples, one per pooling rule --------------------------------------------------
# step 0: rows A (2 tokens), B (1 token); step 1: rows C (3 tokens), D (no loss token).
# d = new − old: A [0, 0.5], B [0], C [−0.25, 0, 0]; A = +1 except B (−1); ε = 0.2.
OLD = [[-1.0, -2.0], [-0.5], [-1.0, -1.5, -0.25], []]
NEW = [[-1.0, -1.5], [-0.5], [-1.25, -1.5, -0.25], []]
ROLLOUT = [[-1.5, -2.0], [-0.25], [-1.0, -1.75, -0.5], []]
ADV = [[1.0, 1.0], [-1.0], [1.0, 1.0, 1.0], []]
ENTROPY = [[0.5, 1.5], [1.0], [2.0, 0.0, 1.0], []]


def two_steps(**overrides: object) -> TokenBatch:
    fields: dict[str, object] = {
        "new": NEW,
        "old": OLD,
        "rollout": ROLLOUT,
        "advantages": ADV,
        "entropy": ENTROPY,
        "steps": [0, 0, 1, 1],
        "groups": ["g0", "g0", "g1", "g1"],
        "reward": [1.0, 1.0, 0.0, 1.0],
        "lengths": [2, 1, 3, 0],
    }
    fields.update(overrides)
    return make_batch(**fields)  # type: ignore[arg-type]


def all_row(style: str, batch: TokenBatch | None = None, **flags: object) -> dict[str, float | None]:
    batch = two_steps() if batch is None else batch
    settings = _synthetic_settings(style, flags, ref=None)
    rows = compute_by_step(
        batch, settings, lambda b, s, n: compute_step_style(b, s, groups_split=n, partials=True)
    )
    assert rows[-1][0] == "all"
    return {v.key: v.value for v in rows[-1][1].values}


def test_token_means_under_verl_eps_guard_and_counts_exact() -> None:
    got = all_row("verl")
    assert got["actor/pg_clipfrac"] == 1.0 / (6 + 1e-8)  # A's r = e^0.5 binds; C's e^−0.25 (A > 0) does not
    assert got["actor/ppo_kl"] == pytest.approx(-0.25 / (6 + 1e-8), rel=1e-12)
    assert got["actor/pg_clipfrac_lower"] == 0.0
    assert got["critic/advantages/mean"] == pytest.approx(4.0 / 6.0, rel=1e-15)
    assert (got["critic/advantages/max"], got["critic/advantages/min"]) == (1.0, -1.0)
    assert got["count/tokens"] == 6.0 and got["count/samples"] == 4.0 and got["count/samples_empty"] == 1.0


def test_loss_keys_are_the_mean_over_steps() -> None:
    got = all_row("verl")
    # token-mean ℓ = max(−A r, −A clip(r)): A's tokens −1 and −1.2 (e^0.5 clipped), B (A = −1, r = 1) +1
    step0 = (-1.0 - 1.2 + 1.0) / 3
    step1 = (-math.exp(-0.25) - 1.0 - 1.0) / 3  # C: −r (the low clip of e^−0.25 binds only for A < 0)
    assert got["actor/pg_loss"] == pytest.approx((step0 + step1) / 2, rel=1e-12)
    entropy0, entropy1 = (0.5 + 1.5 + 1.0) / 3, (2.0 + 0.0 + 1.0) / 3  # actor/entropy: agg_loss, a loss key
    assert got["actor/entropy"] == pytest.approx((entropy0 + entropy1) / 2, rel=1e-15)


def test_token_mean_under_max1_guard() -> None:
    got = all_row("trl")
    assert got["entropy"] == 1.0  # (0.5 + 1.5 + 1 + 2 + 0 + 1) / max(6, 1)
    # binding high side on Ā_i: A (Ā = 1, r = e^0.5); none low (B has r = 1)
    assert (got["clip_ratio/high_mean"], got["clip_ratio/low_mean"]) == (1.0 / 6.0, 0.0)
    assert got["clip_ratio/high_max"] == 0.5 and got["clip_ratio/low_min"] == 0.0
    assert got["frac_reward_zero_std"] == 0.5  # group (0, g0) = {A, B} has rewards {1, 1}; (1, g1) {0, 1}


def test_sample_mean_of_miles() -> None:
    got = all_row("miles")
    # SM(lp_old − lp_new) = (1/4)(−0.5/2 + 0 + 0.25/3 + 0)
    assert got["train/ppo_kl"] == pytest.approx((-0.25 + 0.25 / 3) / 4, rel=1e-12)
    assert got["train/entropy_loss"] == pytest.approx((1.0 + 1.0 + 1.0 + 0.0) / 4, rel=1e-15)


def test_document_mean_of_fast_llm_and_sums() -> None:
    got = all_row("fast-llm")
    # doc(lp_new) over D = 4 documents: A −1.25, B −0.5, C −1.0, D (no token) 0
    assert got["grpo_new_logprobs"] == pytest.approx((-1.25 - 0.5 - 1.0 + 0.0) / 4, rel=1e-15)
    ratios = [1.0, math.exp(0.5), 1.0, math.exp(-0.25), 1.0, 1.0]
    assert got["grpo_ratio_new_old_sum"] == pytest.approx(math.fsum(ratios), rel=1e-15)
    assert got["grpo_ratio_new_old_squared_sum"] == pytest.approx(math.fsum(r * r for r in ratios), rel=1e-15)
    assert got["grpo_num_tokens"] == 6.0
    assert (got["grpo_max_advantage"], got["grpo_min_advantage"]) == (1.0, -1.0)


def test_pipelinerl_doc_mean_counts_the_empty_rows_and_ess_from_pooled_sums() -> None:
    batch = two_steps(steps=[0, 0, 1, 2], lengths=[2, 1, 3, 0])  # step 2: one row without labels
    got = all_row("pipelinerl", batch)
    # (1/S) Σ_i Σ_t x / N_i over S = 4 rows: the row of the label-less step adds 0 and counts
    assert got["rl/new_logprobs"] == pytest.approx((-1.25 - 0.5 - 1.0) / 4, rel=1e-15)
    ratios = [1.0, math.exp(0.5), 1.0, math.exp(-0.25), 1.0, 1.0]
    ess = math.fsum(ratios) ** 2 / math.fsum(r * r for r in ratios) / 6
    assert got["rl/ess"] == pytest.approx(ess, rel=1e-14)
    assert "rl/max_kl" not in got  # no reference stream: no kl keys


def test_verl_rows_of_a_label_less_step_count_as_ppl_one() -> None:
    batch = two_steps(steps=[0, 0, 1, 2], lengths=[2, 1, 3, 0])
    got = all_row("verl", batch)
    # per-row μ = Σ lp / (N_i + 1e-8) of lp_old (side b) and lp_rollout (side a); the empty row has μ = 0
    mu_b = [-3.0 / (2 + 1e-8), -0.5 / (1 + 1e-8), -2.75 / (3 + 1e-8), 0.0]
    mu_a = [-3.5 / (2 + 1e-8), -0.25 / (1 + 1e-8), -3.25 / (3 + 1e-8), 0.0]
    want_ppl = math.fsum(math.exp(-m) for m in mu_b) / 4
    assert got["rollout_corr/training_ppl"] == pytest.approx(want_ppl, rel=1e-14)
    diffs = [a - b for a, b in zip(mu_a, mu_b, strict=True)]
    assert got["rollout_corr/log_ppl_diff_max"] == pytest.approx(max(diffs), rel=1e-14)
    assert got["rollout_corr/log_ppl_diff_min"] == pytest.approx(min(diffs), rel=1e-14)


def test_verl_std_and_correlation_against_exact_statistics() -> None:
    got = all_row("verl")
    p_b = [math.exp(x) for row in OLD for x in row]
    p_a = [math.exp(x) for row in ROLLOUT for x in row]
    diff = [abs(b - a) for a, b in zip(p_a, p_b, strict=True)]
    assert got["training/rollout_probs_diff_std"] == pytest.approx(statistics.stdev(diff), rel=1e-13)
    assert got["training/rollout_actor_probs_pearson_corr"] == pytest.approx(
        statistics.correlation(p_b, p_a), rel=1e-13
    )


def test_verl_is_weight_std_and_ess_from_step_mean_and_ess() -> None:
    got = all_row("verl", rollout_is="token")
    delta = [b - a for rb, ra in zip(OLD, ROLLOUT, strict=True) for b, a in zip(rb, ra, strict=True)]
    w = [min(math.exp(x), 2.0) for x in delta]
    mean = math.fsum(w) / (6 + 1e-8)
    second = math.fsum(x * x for x in w) / (6 + 1e-8)
    assert got["rollout_corr/rollout_is_mean"] == pytest.approx(mean, rel=1e-14)
    assert got["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(second - mean**2), rel=1e-12)
    assert got["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        (mean + 1e-8) ** 2 / second, rel=1e-13
    )
    assert got["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0


def test_groups_straddling_a_docs_per_step_cut_are_null_with_a_notice() -> None:
    batch = two_steps(groups=["g0", "g1", "g1", "g2"])  # cut after 2 documents: g1 = {B, C} straddles
    settings = _synthetic_settings("trl", {}, ref=None, docs_per_step=2)
    rows = compute_by_step(batch, settings, lambda b, s, n: compute_step_style(b, s, groups_split=n))
    last = rows[-1][1]
    got = last.by_key()
    for key in WHOLE_GROUP_KEYS:
        assert got[key].value is None
    assert any("straddle --docs-per-step" in n for n in last.notices)
    assert got["count/samples"].value == 4.0 and got["entropy"].value == 1.0
    aligned = all_row("trl", two_steps(groups=["g0", "g0", "g1", "g1"]), docs_per_step=2)
    assert (aligned["count/groups"], aligned["count/groups_split"], aligned["frac_reward_zero_std"]) == (
        2.0,
        0.0,
        0.5,
    )


def test_status_and_notices() -> None:
    nan_old = [[math.nan, -2.0], [-0.5], [-1.0, -1.5, -0.25], []]
    settings = _synthetic_settings("verl", {}, ref=None)
    rows = compute_by_step(
        two_steps(old=nan_old), settings, lambda b, s, n: compute_step_style(b, s, groups_split=n)
    )
    assert [m.status for _, m in rows] == ["nonfinite", "ok", "nonfinite"]
    assert rows[-1][1].by_key()["actor/ppo_kl"].value is None  # NaN in step 0 poisons the pooled mean
    empty = two_steps(
        lengths=[0, 0, 0, 0],
        new=[[]] * 4,
        old=[[]] * 4,
        rollout=[[]] * 4,
        advantages=[[]] * 4,
        entropy=[[]] * 4,
    )
    rows = compute_by_step(empty, settings, lambda b, s, n: compute_step_style(b, s, groups_split=n))
    assert [m.status for _, m in rows] == ["empty", "empty", "empty"]
    assert rows[-1][1].by_key()["rollout_corr/kl"].value is None
    dps = _synthetic_settings("verl", {}, ref=None, docs_per_step=2)  # documents A, B | C + D (partial)
    rows = compute_by_step(
        two_steps(sample_ids=["a", "b", "c", "c"]),
        dps,
        lambda b, s, n: compute_step_style(b, s, groups_split=n),
    )
    assert [m.status for _, m in rows] == ["ok", "partial", "ok"]  # the all row is the pooled tokens' status
    assert "step 1: final partial step of --docs-per-step" in rows[-1][1].notices


def test_step_rows_carry_no_partial_values() -> None:
    settings = _synthetic_settings("verl", {}, ref=None)
    rows = compute_by_step(
        two_steps(), settings, lambda b, s, n: compute_step_style(b, s, groups_split=n, partials=True)
    )
    assert all(v.reduction != "partial" for _, m in rows for v in m.values)
    without = compute_by_step(two_steps(), settings, lambda b, s, n: compute_step_style(b, s, groups_split=n))
    assert without[-1][1].by_key()["training/rollout_actor_probs_pearson_corr"].value is None
    assert any("pearson_corr is null" in n for n in without[-1][1].notices)
